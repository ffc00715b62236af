"""KV-cache writes: ``store_kv_cache`` (K and V rows) and ``store_mla_kv_cache`` (latent + rope).

One program per written token copies its ``[Hkv, D]`` rows into slot ``loc[i]`` of the flat
cache (int64 slot x stride offsets), dividing by the per-tensor scale first for fp8 caches.
Only the addressed slots are touched; a slot outside ``[0, slots)`` masks the store off. ``loc``
may have any stride; values stored into an fp8 cache saturate to its largest finite value.
``store_kv_cache`` writes K and V in one launch: ``_store_kv_plain_kernel`` for the plain form
of a call (one layout for K and V rows, one for both caches, no scale: 10 runtime arguments,
since Triton binds every argument on every launch), else ``_store_kv_kernel``, whose scalar
arguments are computed once per call shape (decode writes the same shape in every layer).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import provider_table
from .._checks import FP8_DTYPES
from ._common import available, launch, next_pow2


@triton.jit
def _saturate(x, limit, SATURATE: tl.constexpr):
    # Into fp8: clamp to the largest finite value (comparisons keep NaN, as the reference does).
    if SATURATE:
        x = x.to(tl.float32)
        x = tl.where(x > limit, limit, tl.where(x < -limit, -limit, x))
    return x


@triton.jit
def _store_rows_kernel(
    SRC, DST, LOC, SCALE,
    stride_src_t, stride_src_h, stride_dst_p, stride_dst_s, stride_dst_h, stride_loc, page_size,
    num_heads, head_dim, col_offset, num_slots, fp8_max,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SCALE: tl.constexpr,
    SATURATE: tl.constexpr,
):
    # dst[loc[i], h, col_offset + d] = src[i, h, d] (/ scale); slots outside [0, num_slots)
    # are skipped (the store is masked off), never written.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(LOC + tok * stride_loc).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_heads)[:, None] & (offs_d < head_dim)[None, :]
    # The slot test is broadcast over heads first: Triton's interpreter rejects a mask built
    # as block & scalar-bool ("mask has unsupported dtype").
    slot_h = slot + tl.zeros([BLOCK_H], dtype=tl.int64)
    mask_slot = (slot_h >= 0) & (slot_h < num_slots)
    mask_store = mask & mask_slot[:, None]
    x = tl.load(SRC + tok * stride_src_t + offs_h[:, None] * stride_src_h + offs_d[None, :],
                mask=mask, other=0.0)
    if HAS_SCALE:
        x = x.to(tl.float32) / tl.load(SCALE)
    x = _saturate(x, fp8_max, SATURATE)
    row = (slot // page_size) * stride_dst_p + (slot % page_size) * stride_dst_s
    tl.store(DST + row + offs_h[:, None] * stride_dst_h + col_offset
             + offs_d[None, :], x.to(DST.dtype.element_ty), mask=mask_store)


@triton.jit
def _store_kv_kernel(
    K, V, K_CACHE, V_CACHE, LOC, K_SCALE, V_SCALE,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_kc_p, stride_kc_s, stride_kc_h,
    stride_vc_p, stride_vc_s, stride_vc_h, stride_loc, page_size_k, page_size_v, num_heads,
    head_dim, head_dim_v, num_slots_k, num_slots_v, fp8_max_k, fp8_max_v,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr, SATURATE_K: tl.constexpr,
    SATURATE_V: tl.constexpr,
):
    # k_cache[loc[i], h, d] = k[i, h, d] (/ k_scale) and v_cache[loc[i], h, e] = v[i, h, e]
    # (/ v_scale) in one program per token; slots outside a cache's [0, slots) are skipped.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(LOC + tok * stride_loc).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    mask_h = offs_h < num_heads
    slot_h = slot + tl.zeros([BLOCK_H], dtype=tl.int64)  # see _store_rows_kernel
    mask_k = (mask_h & (slot_h >= 0) & (slot_h < num_slots_k))[:, None] & (offs_d < head_dim)[None, :]
    mask_v = (mask_h & (slot_h >= 0) & (slot_h < num_slots_v))[:, None] & (offs_e < head_dim_v)[None, :]
    k = tl.load(K + tok * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :],
                mask=mask_k, other=0.0)
    v = tl.load(V + tok * stride_v_t + offs_h[:, None] * stride_v_h + offs_e[None, :],
                mask=mask_v, other=0.0)
    if HAS_K_SCALE:
        k = k.to(tl.float32) / tl.load(K_SCALE)
    if HAS_V_SCALE:
        v = v.to(tl.float32) / tl.load(V_SCALE)
    k = _saturate(k, fp8_max_k, SATURATE_K)
    v = _saturate(v, fp8_max_v, SATURATE_V)
    # Slot -> (page, offset): caches may be paged with any page stride (int64 offsets).
    k_row = (slot // page_size_k) * stride_kc_p + (slot % page_size_k) * stride_kc_s
    v_row = (slot // page_size_v) * stride_vc_p + (slot % page_size_v) * stride_vc_s
    tl.store(K_CACHE + k_row + offs_h[:, None] * stride_kc_h + offs_d[None, :],
             k.to(K_CACHE.dtype.element_ty), mask=mask_k)
    tl.store(V_CACHE + v_row + offs_h[:, None] * stride_vc_h + offs_e[None, :],
             v.to(V_CACHE.dtype.element_ty), mask=mask_v)


@triton.jit
def _store_kv_plain_kernel(
    K, V, K_CACHE, V_CACHE, LOC,
    stride_rows_t, stride_rows_h, stride_cache_s, stride_cache_h, num_slots,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # The plain form of _store_kv_kernel (10 runtime arguments instead of 27): K and V rows
    # with one layout, caches of the rows' dtype with one layout of slot rows, no scale,
    # contiguous loc. k_cache[loc[i], h, d] = k[i, h, d], v likewise; slots outside
    # [0, num_slots) are skipped.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(LOC + tok).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot_h = slot + tl.zeros([BLOCK_H], dtype=tl.int64)  # see _store_rows_kernel
    mask_h = (offs_h < NUM_HEADS) & (slot_h >= 0) & (slot_h < num_slots)
    mask = mask_h[:, None] & (offs_d < HEAD_DIM)[None, :]
    src = tok * stride_rows_t + offs_h[:, None] * stride_rows_h + offs_d[None, :]
    dst = slot * stride_cache_s + offs_h[:, None] * stride_cache_h + offs_d[None, :]
    tl.store(K_CACHE + dst, tl.load(K + src, mask=mask, other=0.0), mask=mask)
    tl.store(V_CACHE + dst, tl.load(V + src, mask=mask, other=0.0), mask=mask)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 cache dtype (stores saturate to it), 0.0 otherwise."""
    return torch.finfo(dtype).max if dtype in FP8_DTYPES else 0.0


def cache_geometry(cache, feature_dims: int) -> tuple[int, int, int, int]:
    """``(page stride, slot stride, page_size, slots)`` of a flat ``[slots, *features]`` or
    paged ``[num_pages, page_size, *features]`` cache, any strides (slot = page * page_size +
    offset; a flat cache is pages of one slot)."""
    if cache.dim() == feature_dims + 1:
        return cache.stride(0), 0, 1, cache.shape[0]
    return cache.stride(0), cache.stride(1), cache.shape[1], cache.shape[0] * cache.shape[1]


@functools.lru_cache(maxsize=256)
def _store_kv_launch(device: torch.device, num_tokens: int, k_shape, k_strides, v_shape,
                     v_strides, kc_geometry, kc_head_stride: int, vc_geometry,
                     vc_head_stride: int, loc_stride: int, has_k_scale: bool, has_v_scale: bool,
                     kc_dtype: torch.dtype, vc_dtype: torch.dtype) -> tuple[tuple, dict]:
    """``(scalar arguments, meta)`` of the ``_store_kv_kernel`` launch of one call shape
    (``cache_geometry`` of each cache)."""
    _, num_heads, head_dim = k_shape
    max_k, max_v = fp8_max(kc_dtype), fp8_max(vc_dtype)
    (kp, ks, kps, k_slots), (vp, vs, vps, v_slots) = kc_geometry, vc_geometry
    scalars = (k_strides[0], k_strides[1], v_strides[0], v_strides[1], kp, ks, kc_head_stride,
               vp, vs, vc_head_stride, loc_stride, kps, vps, num_heads, head_dim, v_shape[2],
               k_slots, v_slots, max_k, max_v)
    meta = dict(BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim),
                BLOCK_DV=next_pow2(v_shape[2]), HAS_K_SCALE=has_k_scale,
                HAS_V_SCALE=has_v_scale, SATURATE_K=max_k > 0, SATURATE_V=max_v > 0,
                num_warps=4)
    return scalars, meta


def _store_kv_launch_for(k_cache, v_cache, loc, k, v, k_scale, v_scale) -> tuple[tuple, dict]:
    return _store_kv_launch(k.device, k.shape[0], k.shape, k.stride(), v.shape, v.stride(),
                            cache_geometry(k_cache, 2), k_cache.stride(-2),
                            cache_geometry(v_cache, 2), v_cache.stride(-2), loc.stride(0),
                            k_scale is not None, v_scale is not None, k_cache.dtype,
                            v_cache.dtype)


def _store_kv_plain(k_cache, v_cache, loc, k, v) -> bool:
    """Launch ``_store_kv_plain_kernel`` when the call has its plain form (see the kernel; the
    slots of a paged cache must be rows of one stride); False, launching nothing, otherwise."""
    page_stride, slot_stride, page_size, slots = cache_geometry(k_cache, 2)
    if page_size > 1 and page_stride != slot_stride * page_size:
        return False
    if (k_cache.stride() != v_cache.stride() or k.stride() != v.stride() or k.shape != v.shape
            or k_cache.dtype in FP8_DTYPES or loc.stride(0) != 1):
        return False
    num_tokens, num_heads, head_dim = k.shape
    launch(_store_kv_plain_kernel, (num_tokens,), k.device, k, v, k_cache, v_cache, loc,
           k.stride(0), k.stride(1), page_stride if page_size == 1 else slot_stride,
           k_cache.stride(-2), slots, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
           BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim), num_warps=4)
    return True


def store_rows(src, dst, loc, scale, col_offset: int = 0) -> None:
    """Launch ``_store_rows_kernel``: ``src [N, 1, D]`` into the one-head cache ``dst``
    (``[slots, >= D]`` or ``[num_pages, page_size, >= D]``, any strides); entries of ``loc``
    outside ``[0, slots)`` are skipped."""
    num_tokens, num_heads, head_dim = src.shape
    if num_tokens == 0:
        return
    limit = fp8_max(dst.dtype)
    stride_p, stride_s, page_size, num_slots = cache_geometry(dst, 1)
    launch(_store_rows_kernel, (num_tokens,), src.device, src, dst, loc,
           scale if scale is not None else loc, src.stride(0), src.stride(1), stride_p,
           stride_s, 0, loc.stride(0), page_size, num_heads, head_dim, col_offset, num_slots,
           limit, BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim),
           HAS_SCALE=scale is not None, SATURATE=limit > 0, num_warps=4)


def _supports_store(k_cache, v_cache, loc, k, v, *args):
    if (k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and k.stride(-1) == 1
            and v.stride(-1) == 1):
        return None  # the usual call (it runs on every store): no tuple of names to build
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            return f"{name} has a non-unit stride in its last dimension"
    return None


@provider_table.register("store_kv_cache", "triton", available=available, supports=_supports_store)
def store_kv_cache(k_cache, v_cache, loc, k, v, k_scale, v_scale):
    """Triton ``store_kv_cache`` (contract: ``xpu_ops/ops/kv_cache.py``).

    One launch of ``_store_kv_kernel``: one program per token copies its K and V rows
    ``[Hkv, D]``/``[Hkv, Dv]`` into slot ``loc[i]``; out-of-range slots are masked off. The
    plain form of a call (the decode layer's) launches ``_store_kv_plain_kernel``, which takes
    a third of the arguments (Triton binds each one on every launch).
    """
    if k.shape[0] == 0:
        return
    if k_scale is None and v_scale is None and _store_kv_plain(k_cache, v_cache, loc, k, v):
        return
    scalars, meta = _store_kv_launch_for(k_cache, v_cache, loc, k, v, k_scale, v_scale)
    launch(_store_kv_kernel, (k.shape[0],), k.device, k, v, k_cache, v_cache, loc,
           loc if k_scale is None else k_scale, loc if v_scale is None else v_scale, *scalars,
           **meta)


def _supports_mla(kv_cache, loc, k_nope, k_rope):
    if kv_cache.stride(-1) != 1:
        return "kv_cache has a non-unit stride in its last dimension"
    if k_nope.stride(-1) != 1 or k_rope.stride(-1) != 1:
        return "k_nope/k_rope have a non-unit stride in their last dimension"
    return None


@provider_table.register("store_mla_kv_cache", "triton", available=available, supports=_supports_mla)
def store_mla_kv_cache(kv_cache, loc, k_nope, k_rope):
    """Triton ``store_mla_kv_cache`` (contract: ``xpu_ops/ops/kv_cache.py``).

    Two launches of ``_store_rows_kernel`` into the cache's token rows (any strides):
    ``k_nope`` at columns ``[0, R)``, ``k_rope`` at ``[R, R + r)``.
    """
    rows = kv_cache.select(2, 0) if kv_cache.dim() == 4 else kv_cache   # [a, b, R + r]
    store_rows(k_nope, rows, loc, None)
    store_rows(k_rope, rows, loc, None, col_offset=k_nope.shape[-1])


def _supports_store_cache(k, v, k_cache, v_cache, indices):
    if k.dtype in FP8_DTYPES or v.dtype in FP8_DTYPES:
        return "fp8 rows (copied as bytes by the reference provider)"
    return _supports_store(k_cache, v_cache, indices, k, v)


@provider_table.register("store_cache", "triton", available=available,
                         supports=_supports_store_cache)
def store_cache(k, v, k_cache, v_cache, indices):
    """Triton ``store_cache`` (contract: ``xpu_ops/ops/store_cache.py``): ``store_kv_cache``'s
    kernels on one-head views (rows ``[N, 1, D]`` into flat caches ``[S, 1, D]``), which skip
    indices outside ``[0, S)``."""
    store_kv_cache(k_cache.unsqueeze(1), v_cache.unsqueeze(1), indices, k.unsqueeze(1),
                   v.unsqueeze(1), None, None)
