"""KV-cache writes: ``store_kv_cache`` (K and V rows) and ``store_mla_kv_cache`` (latent + rope).

One program per written token copies its ``[Hkv, D]`` rows into slot ``loc[i]`` of the flat
cache (int64 slot x stride offsets), dividing by the per-tensor scale first for fp8 caches.
Only the addressed slots are touched; a slot outside ``[0, slots)`` masks the store off.
``store_kv_cache`` writes K and V in one launch (``_store_kv_kernel``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import providers
from ._common import available, launch, next_pow2


@triton.jit
def _store_rows_kernel(
    SRC, DST, LOC, SCALE,
    stride_src_t, stride_src_h, stride_dst_t, stride_dst_h, num_heads, head_dim, col_offset,
    num_slots,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SCALE: tl.constexpr,
):
    # dst[loc[i], h, col_offset + d] = src[i, h, d] (/ scale); slots outside [0, num_slots)
    # are skipped (the store is masked off), never written.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(LOC + tok).to(tl.int64)
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
    tl.store(DST + slot * stride_dst_t + offs_h[:, None] * stride_dst_h + col_offset
             + offs_d[None, :], x.to(DST.dtype.element_ty), mask=mask_store)


@triton.jit
def _store_kv_kernel(
    K, V, K_CACHE, V_CACHE, LOC, K_SCALE, V_SCALE,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_kc_t, stride_kc_h, stride_vc_t,
    stride_vc_h, num_heads, head_dim, head_dim_v, num_slots_k, num_slots_v,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr,
):
    # k_cache[loc[i], h, d] = k[i, h, d] (/ k_scale) and v_cache[loc[i], h, e] = v[i, h, e]
    # (/ v_scale) in one program per token; slots outside a cache's [0, slots) are skipped.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(LOC + tok).to(tl.int64)
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
    tl.store(K_CACHE + slot * stride_kc_t + offs_h[:, None] * stride_kc_h + offs_d[None, :],
             k.to(K_CACHE.dtype.element_ty), mask=mask_k)
    tl.store(V_CACHE + slot * stride_vc_t + offs_h[:, None] * stride_vc_h + offs_e[None, :],
             v.to(V_CACHE.dtype.element_ty), mask=mask_v)


def store_rows(src, dst, loc, scale, col_offset: int = 0) -> None:
    """Launch ``_store_rows_kernel``: ``src [N, H, D]`` into ``dst [slots, H, >= D]``; entries
    of ``loc`` outside ``[0, slots)`` are skipped."""
    num_tokens, num_heads, head_dim = src.shape
    if num_tokens == 0:
        return
    launch(_store_rows_kernel, (num_tokens,), src.device, src, dst, loc,
           scale if scale is not None else loc, src.stride(0), src.stride(1), dst.stride(0),
           dst.stride(1), num_heads, head_dim, col_offset, dst.shape[0],
           BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim), HAS_SCALE=scale is not None,
           num_warps=4)


def _flat(cache):
    return cache if cache.dim() == 3 else cache.flatten(0, 1)


def _supports_store(k_cache, v_cache, loc, k, v, *args):
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            return f"{name} has a non-unit stride in its last dimension"
    if k_cache.dim() == 4 and k_cache.stride(0) != k_cache.stride(1) * k_cache.shape[1]:
        return "k_cache pages are not contiguous slots"
    if v_cache.dim() == 4 and v_cache.stride(0) != v_cache.stride(1) * v_cache.shape[1]:
        return "v_cache pages are not contiguous slots"
    return None


@providers.register("store_kv_cache", "triton", available=available, supports=_supports_store)
def store_kv_cache(k_cache, v_cache, loc, k, v, k_scale, v_scale):
    """Triton ``store_kv_cache`` (contract: ``xpu_ops/ops/kv_cache.py``).

    One launch of ``_store_kv_kernel``: one program per token copies its K and V rows
    ``[Hkv, D]``/``[Hkv, Dv]`` into slot ``loc[i]``; out-of-range slots are masked off.
    """
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    kc, vc = _flat(k_cache), _flat(v_cache)
    launch(_store_kv_kernel, (num_tokens,), k.device, k, v, kc, vc, loc,
           loc if k_scale is None else k_scale, loc if v_scale is None else v_scale,
           k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc.stride(0), kc.stride(1),
           vc.stride(0), vc.stride(1), num_heads, head_dim, v.shape[2], kc.shape[0], vc.shape[0],
           BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim),
           BLOCK_DV=next_pow2(v.shape[2]), HAS_K_SCALE=k_scale is not None,
           HAS_V_SCALE=v_scale is not None, num_warps=4)


def _supports_mla(kv_cache, loc, k_nope, k_rope):
    if not kv_cache.is_contiguous():
        return "kv_cache is not contiguous (it is written through a flat view)"
    if k_nope.stride(-1) != 1 or k_rope.stride(-1) != 1:
        return "k_nope/k_rope have a non-unit stride in their last dimension"
    return None


@providers.register("store_mla_kv_cache", "triton", available=available, supports=_supports_mla)
def store_mla_kv_cache(kv_cache, loc, k_nope, k_rope):
    """Triton ``store_mla_kv_cache`` (contract: ``xpu_ops/ops/kv_cache.py``).

    Two launches of ``_store_rows_kernel`` into the flat ``[slots, 1, R + r]`` view: ``k_nope`` at
    columns ``[0, R)``, ``k_rope`` at ``[R, R + r)``.
    """
    rows = kv_cache.view(-1, 1, kv_cache.shape[-1])              # [slots, 1, R + r]
    store_rows(k_nope, rows, loc, None)
    store_rows(k_rope, rows, loc, None, col_offset=k_nope.shape[-1])
