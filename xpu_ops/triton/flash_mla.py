"""The FlashMLA surface in Triton: one kernel that reads the selected slots of a paged latent
cache directly (no gather copy), for ``flash_mla_with_kvcache`` (sparse and dense) and
``flash_mla_sparse_fwd``.

One program per (query row, block of heads): it walks the row's keys in tiles of ``BLOCK_N``
slots, each slot found either in the row's ``indices`` (sparse; -1 and slots outside the cache
masked) or through ``block_table`` (dense; causal rows stop at their bottom-right position),
loads the latent and rope parts of those tokens (fp8 pages: fp8 latent times its tile's float32
scale, bfloat16 rope, read byte-wise when the layout is not 4-byte aligned), and keeps an online
softmax (FlashAttention-2) over the main cache and then the extra cache. All heads share each
loaded key tile. Masked slots are never loaded: NaN garbage cannot reach the result. When the
rows and head blocks do not fill the device (small decode batches), each row's ranks are split
over ``plan_splits`` programs (whole tiles each; the extra cache in the last split) whose float32
partials the same launch merges (FlashDecoding; "last program to finish reduces", as the
paged-attention kernel does): each split stores its partials, passes a barrier and adds 1 to
its (row, head block)'s int32 counter with an ``acq_rel`` gpu-scope atomic; the one that reads
``num_splits - 1`` merges all splits in order 0..S-1 (deterministic whichever program merges),
writes the output and stores 0 back, so the counters are zero before and after every launch
(the stream's split workspace of ``paged_attention`` outside graph capture, ``torch.zeros`` of
the call inside one). The split count depends on shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import provider_table
from ..mla_fp8_layout import fp8_rope_offset, is_model1
from ._common import available, launch, next_pow2, num_sms
from .paged_attention import _workspace, paged_attention


@triton.jit
def _bytes_as(P, offs, mask, NBYTES: tl.constexpr):
    """Little-endian unsigned integer of ``NBYTES`` bytes at byte pointers ``P + offs``."""
    word = tl.load(P + offs, mask=mask, other=0).to(tl.uint32)
    for j in tl.static_range(1, NBYTES):
        word = word | (tl.load(P + offs + j, mask=mask, other=0).to(tl.uint32) << (8 * j))
    return word


@triton.jit
def _load_keys(K, base, valid, offs_v, offs_r, stride_kd, HEAD_DIM: tl.constexpr,
               HEAD_DIM_V: tl.constexpr, ROPE_OFF: tl.constexpr, BLOCK_DV: tl.constexpr,
               IS_FP8: tl.constexpr, ALIGNED: tl.constexpr):
    """Latent ``[BLOCK_N, BLOCK_DV]`` and rope ``[BLOCK_N, BLOCK_DR]`` parts (float32) of the
    tokens at element offsets ``base`` (int64); invalid rows and padding read as 0."""
    mask_v = valid[:, None] & (offs_v[None, :] < HEAD_DIM_V)
    mask_r = valid[:, None] & (offs_r[None, :] < HEAD_DIM - HEAD_DIM_V)
    row = base[:, None]
    if IS_FP8:
        # One float32 scale per tile of 128 latent values: [BLOCK_N, BLOCK_DV / 128], broadcast over
        # the tile through a 3-D view of the latent block.
        tl.static_assert(BLOCK_DV % 128 == 0)
        offs_t = tl.arange(0, BLOCK_DV // 128)
        mask_t = valid[:, None] & (offs_t[None, :] < HEAD_DIM_V // 128)
        latent = tl.load(K + row + offs_v[None, :], mask=mask_v, other=0.0).to(tl.float32)
        KB = K.to(tl.pointer_type(tl.uint8))
        scale_at = row + HEAD_DIM_V + offs_t[None, :] * 4
        rope_at = row + ROPE_OFF + offs_r[None, :] * 2
        if ALIGNED:
            scale = tl.load((KB + scale_at).to(tl.pointer_type(tl.float32)), mask=mask_t,
                            other=0.0)
            rope = tl.load((KB + rope_at).to(tl.pointer_type(tl.bfloat16)), mask=mask_r,
                           other=0.0).to(tl.float32)
        else:  # a view at an odd byte offset: assemble the words byte by byte
            scale = _bytes_as(KB, scale_at, mask_t, 4).to(tl.float32, bitcast=True)
            rope = _bytes_as(KB, rope_at, mask_r, 2).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            rope = rope.to(tl.float32)
        latent = tl.reshape(latent, (latent.shape[0], BLOCK_DV // 128, 128)) * scale[:, :, None]
        latent = tl.reshape(latent, (latent.shape[0], BLOCK_DV))
    else:
        latent = tl.load(K + row + offs_v[None, :] * stride_kd, mask=mask_v,
                         other=0.0).to(tl.float32)
        rope = tl.load(K + row + (HEAD_DIM_V + offs_r[None, :]) * stride_kd, mask=mask_r,
                       other=0.0).to(tl.float32)
    return latent, rope


@triton.jit
def _attend_cache(q_lat, q_rope, m_i, l_i, acc, K, SLOTS, stride_slot, n_start, n_end, page_size,
                  num_pages, stride_kb, stride_kp, stride_kd, scale,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, ROPE_OFF: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
                  DENSE: tl.constexpr, IS_FP8: tl.constexpr, ALIGNED: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Online softmax over ranks ``[n_start, n_end)`` of one row's keys. ``SLOTS`` points at the
    row's indices (sparse: slot ids) or its block-table row (dense: page ids)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    for start in range(n_start, n_end, BLOCK_N):
        ranks = start + offs_n
        valid = ranks < n_end
        if DENSE:
            page = tl.load(SLOTS + (ranks // page_size).to(tl.int64) * stride_slot, mask=valid,
                           other=-1).to(tl.int64)
            offset = (ranks % page_size).to(tl.int64)
        else:
            slot = tl.load(SLOTS + ranks.to(tl.int64) * stride_slot, mask=valid,
                           other=-1).to(tl.int64)
            valid = valid & (slot >= 0) & (slot < num_pages * page_size)
            page = slot // page_size
            offset = slot % page_size
        valid = valid & (page >= 0) & (page < num_pages)
        base = tl.where(valid, page * stride_kb + offset * stride_kp, 0)
        latent, rope = _load_keys(K, base, valid, offs_v, offs_r, stride_kd, HEAD_DIM,
                                  HEAD_DIM_V, ROPE_OFF, BLOCK_DV, IS_FP8, ALIGNED)
        k_lat = latent.to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
        s += tl.dot(q_rope, tl.trans(rope.to(q_rope.dtype)), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["n_keys", "n_keys2"])    # top-k sizes vary: one compile
def _flash_mla_kernel(
    Q, K, SLOTS, TOPK_LEN, K2, SLOTS2, TOPK_LEN2, SEQLENS, SINK, OUT, LSE, MAXL, PART_O, PART_ML,
    COUNTERS,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kp, stride_kd, stride_k2b, stride_k2p, stride_k2d,
    stride_sb, stride_ss, stride_sk, stride_s2b, stride_s2s, stride_s2k,
    stride_len, stride_len2, stride_seqlen, stride_sink,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
    seqlen_q, num_heads, n_keys, n_keys2, page_size, num_pages, page_size2, num_pages2, scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, ROPE_OFF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr, DENSE: tl.constexpr, CAUSAL: tl.constexpr, IS_FP8: tl.constexpr,
    ALIGNED: tl.constexpr, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr,
    HAS_LEN2: tl.constexpr, HAS_SINK: tl.constexpr, STORE_MAX: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(2)
    b = (row // seqlen_q).to(tl.int64)
    s_idx = (row % seqlen_q).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < num_heads
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    q_row = Q + b * stride_qb + s_idx * stride_qs + heads[:, None].to(tl.int64) * stride_qh
    q_lat = tl.load(q_row + offs_v[None, :] * stride_qd,
                    mask=mask_h[:, None] & (offs_v[None, :] < HEAD_DIM_V), other=0.0)
    q_rope = tl.load(q_row + (HEAD_DIM_V + offs_r[None, :]) * stride_qd,
                     mask=mask_h[:, None] & (offs_r[None, :] < HEAD_DIM - HEAD_DIM_V), other=0.0)
    if UPCAST:  # Triton's CPU interpreter multiplies bf16 as raw bits: compute in fp32 there
        q_lat, q_rope = q_lat.to(tl.float32), q_rope.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)

    # Stage 1: the main cache (dense: the request's first cache_seqlens keys, causal rows up to
    # their bottom-right position; sparse: the row's first topk_length indices).
    n_end = n_keys
    if DENSE:
        k_len = tl.minimum(tl.maximum(tl.load(SEQLENS + b * stride_seqlen), 0), n_keys)
        n_end = k_len
        if CAUSAL:
            n_end = tl.minimum(k_len, k_len - seqlen_q + s_idx.to(tl.int32) + 1)
        slots = SLOTS + b * stride_sb
    else:
        if HAS_LEN:
            n_end = tl.minimum(n_end, tl.load(TOPK_LEN + b * stride_len))
        slots = SLOTS + b * stride_sb + s_idx * stride_ss
    # Split-KV: split ``split`` takes its share of the ranks, in whole tiles.
    n_end = tl.maximum(n_end, 0)
    chunk = tl.cdiv(tl.cdiv(n_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    n_start = split * chunk
    m_i, l_i, acc = _attend_cache(q_lat, q_rope, m_i, l_i, acc, K, slots, stride_sk, n_start,
                                  tl.minimum(n_end, n_start + chunk), page_size, num_pages,
                                  stride_kb, stride_kp, stride_kd, scale, HEAD_DIM, HEAD_DIM_V,
                                  ROPE_OFF, BLOCK_N, BLOCK_DV, BLOCK_DR, DENSE, IS_FP8, ALIGNED,
                                  PRECISION)
    # Stage 2: the extra cache, same softmax (in the last split).
    if HAS_EXTRA:
        n_end2 = n_keys2
        if HAS_LEN2:
            n_end2 = tl.minimum(n_end2, tl.load(TOPK_LEN2 + b * stride_len2))
        n_end2 = tl.where(split == NUM_SPLITS - 1, n_end2, 0)
        m_i, l_i, acc = _attend_cache(q_lat, q_rope, m_i, l_i, acc, K2,
                                      SLOTS2 + b * stride_s2b + s_idx * stride_s2s, stride_s2k,
                                      0, n_end2, page_size2, num_pages2, stride_k2b, stride_k2p,
                                      stride_k2d, scale, HEAD_DIM, HEAD_DIM_V, ROPE_OFF,
                                      BLOCK_N, BLOCK_DV, BLOCK_DR, False, IS_FP8, ALIGNED,
                                      PRECISION)
    if NUM_SPLITS == 1:
        _finish(acc, m_i, l_i, heads, mask_h, b, s_idx, SINK, stride_sink, OUT, stride_ob,
                stride_os, stride_oh, LSE, MAXL, stride_lb, stride_lh, stride_ls, HEAD_DIM_V,
                BLOCK_DV, HAS_SINK, STORE_MAX)
    else:  # partials; the last split of this (row, head block) to arrive merges them
        part = (split * tl.num_programs(0) + row).to(tl.int64) * num_heads + heads.to(tl.int64)
        tl.store(PART_O + part[:, None] * BLOCK_DV + offs_v[None, :], acc,
                 mask=mask_h[:, None])
        tl.store(PART_ML + part * 2, m_i, mask=mask_h)
        tl.store(PART_ML + part * 2 + 1, l_i, mask=mask_h)
        # the barrier orders every thread's stores before the counter update; acq_rel at gpu
        # scope releases them to, and acquires the other splits' for, the last arrival
        tl.debug_barrier()
        counter = COUNTERS + row.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:
            acc, m_i, l_i = _merge_partials(PART_O, PART_ML, row, tl.num_programs(0), heads,
                                            mask_h, num_heads, BLOCK_H, BLOCK_DV, NUM_SPLITS)
            _finish(acc, m_i, l_i, heads, mask_h, b, s_idx, SINK, stride_sink, OUT, stride_ob,
                    stride_os, stride_oh, LSE, MAXL, stride_lb, stride_lh, stride_ls,
                    HEAD_DIM_V, BLOCK_DV, HAS_SINK, STORE_MAX)
            tl.store(counter, 0)  # zero again for the next launch (and graph replay)


@triton.jit
def _finish(acc, m_i, l_i, heads, mask_h, b, s_idx, SINK, stride_sink, OUT, stride_ob,
            stride_os, stride_oh, LSE, MAXL, stride_lb, stride_lh, stride_ls,
            HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINK: tl.constexpr,
            STORE_MAX: tl.constexpr):
    """Epilogue: normalise; the sink joins the denominator only (not the LSE); empty rows 0."""
    offs_v = tl.arange(0, BLOCK_DV)
    empty = l_i == 0.0
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    keep = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    if HAS_SINK:
        sink = tl.load(SINK + heads.to(tl.int64) * stride_sink, mask=mask_h, other=0.0)
        keep = keep / (1.0 + tl.exp(sink - tl.where(empty, 0.0, lse)))
    out = acc * keep[:, None]
    o_ptr = OUT + b * stride_ob + s_idx * stride_os + heads[:, None].to(tl.int64) * stride_oh
    tl.store(o_ptr + offs_v[None, :], out.to(OUT.dtype.element_ty),
             mask=mask_h[:, None] & (offs_v[None, :] < HEAD_DIM_V))
    l_ptr = b * stride_lb + s_idx * stride_ls + heads.to(tl.int64) * stride_lh
    tl.store(LSE + l_ptr, lse, mask=mask_h)
    if STORE_MAX:
        tl.store(MAXL + l_ptr, m_i, mask=mask_h)


@triton.jit
def _merge_partials(PART_O, PART_ML, row, num_rows, heads, mask_h, num_heads,
                    BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr):
    # Split-KV merge of one (row, head block): m = max_s m_s, l = sum_s l_s e^{m_s - m},
    # acc = sum_s acc_s e^{m_s - m}, in split order. Loads bypass L1 (.cg): other
    # multiprocessors wrote the partials during this launch.
    offs_v = tl.arange(0, BLOCK_DV)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        part = (split * num_rows + row).to(tl.int64) * num_heads + heads.to(tl.int64)
        m_i = tl.maximum(m_i, tl.load(PART_ML + part * 2, mask=mask_h, other=float("-inf"),
                                      cache_modifier=".cg"))
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        part = (split * num_rows + row).to(tl.int64) * num_heads + heads.to(tl.int64)
        weight = tl.exp(tl.load(PART_ML + part * 2, mask=mask_h, other=float("-inf"),
                                cache_modifier=".cg") - m_safe)
        l_i += weight * tl.load(PART_ML + part * 2 + 1, mask=mask_h, other=0.0,
                                cache_modifier=".cg")
        acc += weight[:, None] * tl.load(PART_O + part[:, None] * BLOCK_DV + offs_v[None, :],
                                         mask=mask_h[:, None], other=0.0, cache_modifier=".cg")
    return acc, m_i, l_i


def _cache_args(cache: torch.Tensor, is_fp8: bool) -> tuple:
    """``(tensor, stride_page, stride_slot, stride_d, page_size, num_pages, aligned)`` of a
    ``[num_pages, page_size, 1, X]`` cache; fp8 pages are passed as bytes (fp8 elements)."""
    page_size = max(cache.shape[1], 1)
    num_pages = cache.shape[0] if cache.shape[1] > 0 else 0
    if is_fp8:
        cache = cache.view(torch.float8_e4m3fn)
    aligned = (not is_fp8 or cache.data_ptr() % 4 == 0 and cache.stride(0) % 4 == 0
               and cache.stride(1) % 4 == 0)
    return cache, cache.stride(0), cache.stride(1), cache.stride(3), page_size, num_pages, aligned


def _blocks(q: torch.Tensor, num_heads: int, head_dim: int, head_dim_v: int) -> dict:
    """Tile sizes: every ``tl.dot`` dimension >= 16; fewer heads and keys per tile as the latent
    grows (the accumulator is ``[BLOCK_H, BLOCK_DV]`` float32)."""
    block_dv = max(next_pow2(head_dim_v), 16)
    cpu = q.device.type == "cpu"
    upcast = cpu and q.dtype != torch.float32
    return dict(BLOCK_H=max(min(next_pow2(num_heads), 16 if block_dv >= 256 else 32), 16),
                BLOCK_N=16 if cpu or block_dv > 256 else 32, BLOCK_DV=block_dv,
                BLOCK_DR=max(next_pow2(head_dim - head_dim_v), 16),
                PRECISION="ieee" if q.dtype == torch.float32 or upcast else None, UPCAST=upcast,
                num_warps=1 if cpu else (8 if block_dv >= 256 else 4))


def _launch(q, q_strides, rows, seqlen_q, main, slots, slot_strides, n_keys, topk_len, extra,
            seqlens, sink, out, out_strides, lse, lse_strides, maxl, *, head_dim_v, scale,
            dense, causal, is_fp8):
    """Launch ``_flash_mla_kernel`` over ``rows`` query rows (``seqlen_q`` per request).
    ``main``/``extra`` are ``_cache_args`` results (``extra``: ``(cache args, slots, strides,
    n_keys, topk_len)`` or None)."""
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    if rows == 0 or num_heads == 0:
        return
    k, k_sb, k_sp, k_sd, page_size, num_pages, aligned = main
    k2, k2_sb, k2_sp, k2_sd, page_size2, num_pages2, aligned2 = main
    slots2, slot2_strides, n_keys2, topk_len2 = q, (0, 0, 0), 0, None
    if extra is not None:
        (k2, k2_sb, k2_sp, k2_sd, page_size2, num_pages2, aligned2), slots2, slot2_strides, \
            n_keys2, topk_len2 = extra
    blocks = _blocks(q, num_heads, head_dim, head_dim_v)
    head_blocks = triton.cdiv(num_heads, blocks["BLOCK_H"])
    splits = plan_splits(q.device, rows * head_blocks, n_keys, blocks["BLOCK_N"])
    part_o, part_ml, counters = _split_buffers(q, splits, rows, num_heads, head_blocks,
                                               blocks["BLOCK_DV"], lse)
    stride0 = lambda t: 0 if t is None else t.stride(0)  # noqa: E731
    maxl_or_lse = lse if maxl is None else maxl
    launch(_flash_mla_kernel, (rows, head_blocks, splits), q.device,
           q, k, slots, q if topk_len is None else topk_len, k2, slots2,
           q if topk_len2 is None else topk_len2, q if seqlens is None else seqlens,
           q if sink is None else sink, out, lse, maxl_or_lse, part_o, part_ml, counters,
           *q_strides, k_sb, k_sp, k_sd, k2_sb, k2_sp, k2_sd, *slot_strides, *slot2_strides,
           stride0(topk_len), stride0(topk_len2), stride0(seqlens), stride0(sink),
           *out_strides, *lse_strides,
           seqlen_q, num_heads, n_keys, n_keys2, page_size, num_pages, page_size2, num_pages2,
           scale, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
           ROPE_OFF=fp8_rope_offset(head_dim_v) if is_fp8 else 0, DENSE=dense, CAUSAL=causal,
           IS_FP8=is_fp8, ALIGNED=aligned and aligned2, HAS_LEN=topk_len is not None,
           HAS_EXTRA=extra is not None, HAS_LEN2=topk_len2 is not None,
           HAS_SINK=sink is not None, STORE_MAX=maxl is not None, NUM_SPLITS=splits, **blocks)


def _split_buffers(q: torch.Tensor, splits: int, rows: int, num_heads: int, head_blocks: int,
                   block_dv: int, dummy: torch.Tensor) -> tuple:
    """``(part_o, part_ml, counters)`` of a split launch: float32 partials ``[splits, rows, H,
    BLOCK_DV]``, their ``(m, l)`` ``[splits, rows, H, 2]`` and one zero int32 counter per (row,
    head block), from the stream's split workspace (``paged_attention._workspace``, whose
    counters every launch leaves zero) or, inside a graph capture and for large launches, new
    buffers of this call; ``dummy`` three times for one split (never read)."""
    if splits == 1:
        return dummy, dummy, dummy
    o_elems, ml_elems = splits * rows * num_heads * block_dv, splits * rows * num_heads * 2
    tiles = rows * head_blocks
    ws = _workspace(q.device, o_elems + ml_elems, 0, tiles)
    if ws is None:
        part = torch.empty(o_elems + ml_elems, dtype=torch.float32, device=q.device)
        counters = torch.zeros(tiles, dtype=torch.int32, device=q.device)
    else:
        part, counters = ws[0], ws[2]
    return part[:o_elems], part[o_elems:o_elems + ml_elems], counters


MAX_SPLITS = 16


def plan_splits(device: torch.device, programs: int, n_keys: int, block_n: int) -> int:
    """Split-KV count from shapes only: 1 when ``programs`` (rows x head blocks) fill the
    device or a row has few keys (< 8 tiles), else enough splits to fill it, each of at least
    4 tiles, at most ``MAX_SPLITS``."""
    sms = num_sms(device)
    if programs >= sms or n_keys < 8 * block_n:
        return 1
    return max(1, min(MAX_SPLITS, sms // max(programs, 1), n_keys // (4 * block_n)))


def _tile_limits(head_dim: int, head_dim_v: int):
    if head_dim_v > 1024 or head_dim - head_dim_v > 256:
        return f"Dv={head_dim_v} > 1024 or D - Dv={head_dim - head_dim_v} > 256 (tile size)"
    return None


def _supports_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
                      causal, is_fp8_kvcache, *args):
    if is_fp8_kvcache and is_model1(q.shape[-1], head_dim_v, k_cache.shape[-1]):
        return "DeepSeek-V4 (MODEL1) fp8 pages run on the reference only"
    return _tile_limits(q.shape[-1], head_dim_v)


def _supports_sparse_fwd(q, kv, indices, sm_scale, d_v, *args):
    return _tile_limits(q.shape[-1], d_v)


def _dense_paged(q, k_cache, block_table, cache_seqlens, head_dim_v, scale, causal):
    """Dense pages through the paged-attention kernel (split-KV planned from shapes), as
    ``flash_mla_prefill`` runs: ``q := q_rope`` against the rope part, ``qv := q_latent``
    against the latent part, which also serves as the values (strided views, no copy)."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    rows = q.reshape(batch * seqlen_q, num_heads, head_dim)
    out = q.new_empty((batch, seqlen_q, num_heads, head_dim_v))
    if rows.shape[0] == 0:
        return out, q.new_empty((batch, num_heads, seqlen_q), dtype=torch.float32)
    cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32,
                                device=q.device)
    lse = paged_attention(rows[..., head_dim_v:], k_cache[..., head_dim_v:],
                          k_cache[..., :head_dim_v], out.view(batch * seqlen_q, num_heads,
                                                              head_dim_v),
                          cache_seqlens, cu_seqlens_q, page_table=block_table, cu_seqlens_k=None,
                          max_seqlen_q=seqlen_q, max_kv_len=block_table.shape[1] * k_cache.shape[1],
                          qv=rows[..., :head_dim_v], q_descale=None, k_descale=None,
                          v_descale=None, sinks=None, softmax_scale=scale, window_left=-1,
                          window_right=0 if causal else -1, softcap=0.0)
    lse = lse.reshape(num_heads, batch, seqlen_q).transpose(0, 1)
    return out, torch.empty(lse.shape, dtype=lse.dtype, device=lse.device).copy_(lse)


@provider_table.register("flash_mla_with_kvcache", "triton", available=available,
                    supports=_supports_kvcache)
def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
                           causal, is_fp8_kvcache, indices, attn_sink, extra_k_cache,
                           extra_indices_in_kvcache, topk_length, extra_topk_length):
    """Triton ``flash_mla_with_kvcache`` (contract: ``xpu_ops/ops/flash_mla_kvcache.py``):
    ``_flash_mla_kernel`` reads the slots each row selects (sparse) or its pages (dense fp8 or
    unusual head dims); dense bf16/fp16/fp32 pages run the split-KV paged-attention kernel."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    dense = indices is None
    if dense and not is_fp8_kvcache and 0 < head_dim - head_dim_v <= 256 and head_dim_v <= 512:
        return _dense_paged(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
                            causal)
    out = q.new_empty((batch, seqlen_q, num_heads, head_dim_v))
    lse = q.new_empty((batch, num_heads, seqlen_q), dtype=torch.float32)
    main = _cache_args(k_cache, is_fp8_kvcache)
    if dense:
        slots, slot_strides = block_table, (block_table.stride(0), 0, block_table.stride(1))
        n_keys = block_table.shape[1] * main[4]
    else:
        slots, slot_strides, n_keys = indices, indices.stride(), indices.shape[2]
    extra = None
    if extra_k_cache is not None:
        extra = (_cache_args(extra_k_cache, is_fp8_kvcache), extra_indices_in_kvcache,
                 extra_indices_in_kvcache.stride(), extra_indices_in_kvcache.shape[2],
                 extra_topk_length)
    _launch(q, q.stride(), batch * seqlen_q, seqlen_q, main, slots, slot_strides, n_keys,
            topk_length, extra, cache_seqlens if dense else None, attn_sink, out,
            out.stride()[:3], lse, (lse.stride(0), lse.stride(1), lse.stride(2)), None,
            head_dim_v=head_dim_v, scale=softmax_scale, dense=dense, causal=causal and dense,
            is_fp8=is_fp8_kvcache)
    return out, lse


@provider_table.register("flash_mla_sparse_fwd", "triton", available=available,
                    supports=_supports_sparse_fwd)
def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    """Triton ``flash_mla_sparse_fwd`` (contract: ``xpu_ops/ops/mla_sparse_prefill.py``): each
    token is a one-row request over ``kv`` viewed as one page of ``s_kv`` slots."""
    seqlen_q, num_heads, _ = q.shape
    out = q.new_empty((seqlen_q, num_heads, d_v))
    lse = q.new_empty((seqlen_q, num_heads), dtype=torch.float32)
    max_logits = torch.empty_like(lse)
    main = _cache_args(kv[None], False)
    _launch(q, (q.stride(0), 0, q.stride(1), q.stride(2)), seqlen_q, 1, main, indices,
            (indices.stride(0), 0, indices.stride(2)), indices.shape[2], topk_length, None,
            None, attn_sink, out, (out.stride(0), 0, out.stride(1)), lse,
            (lse.stride(0), lse.stride(1), 0), max_logits, head_dim_v=d_v, scale=sm_scale,
            dense=False, causal=False, is_fp8=False)
    return out, max_logits, lse


__all__ = ["flash_mla_with_kvcache", "flash_mla_sparse_fwd"]
