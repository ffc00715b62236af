"""Paged (and ragged) attention: one Triton kernel family for prefill, extend and decode.

``_paged_attention_kernel`` computes FlashAttention-2 style online-softmax attention of packed
queries over keys that live either in a paged cache (``PAGED``: key ``j`` of request ``r`` sits in
page ``page_table[r, j // PAGE_SIZE]``, slot ``j % PAGE_SIZE``) or in ragged rows (``cu_seqlens_k``).

Layout of one program: one request ``r``, one KV head, one tile of ``BLOCK_M`` rows of the packed
M dimension ``m = query_row * G + head_in_group`` (GQA packing: the ``G = Hq / Hkv`` query heads
sharing a KV head share every K/V tile, so a decode step with ``G = 4`` still gives the matrix units
a 16-row tile), and one KV split. The key loop runs only over tiles that some row of the program can
see (causal and sliding window skip whole tiles); partial tiles are masked with ``tl.where``, and
K/V loads past the request's length use ``other=0`` so NaN garbage never enters a product.

Key-tile addressing: by default each key of a tile loads its page id and forms an int64 ``page x
stride + slot x stride`` offset (any page size). With ``_Config.page_tiles`` (the optional path
``page_tiles``; ``XPU_OPS_TRITON_PATHS``) and a power-of-two page size, a tile that starts on a
``BLOCK_N`` boundary covers ``BLOCK_N / page_size`` whole pages or lies inside one page, so the
kernel loads one page id per page, multiplies in int64 once per page and adds int32 in-page slot
offsets (``_page_tile_rows``); with power-of-two head dims the K/V loads carry no column mask.

Split-KV: with few (request, KV head) pairs for the machine, the visible key range is cut into
``num_splits`` pieces; each split program writes an fp32 partial output and its log-sum-exp, and
the same launch merges them ("last program to finish reduces", no second kernel): after its
stores the program passes a barrier and adds 1 to an int32 counter of its tile (one per (m-block,
request x KV head)) with an ``acq_rel`` gpu-scope atomic; the one that reads ``num_splits - 1``
loads all partials of its rows in split order 0..S-1 (the result does not depend on which program
merges), combines them LSE-weighted (sinks added once, empty splits weight 0, ``-inf`` LSE for
rows with no visible key), writes ``out`` and the LSE, and stores 0 back to the counter. No
program waits for another. The counters are zero before and after every launch, so their owner
may reuse them: a ``paged_attention`` call takes ``counters=`` or allocates ``torch.zeros`` for
the call (inside a graph capture that comes from the graph's pool and its memset is replayed);
never one buffer shared by callers that may run concurrently. One-split launches skip all of it. The
split count, scratch and counter sizes depend only on shapes and the device's multiprocessor
count, never on tensor values, so the launch can be captured in a device graph.

Source: FlashAttention-2 (arXiv 2307.08691); split-KV "flash decoding" (Dao et al., 2023); paged
KV cache from vLLM (arXiv 2309.06180); the in-kernel reduction by the last-arriving program from
the CUDA samples' ``threadFenceReduction`` and Stream-K's tile fix-up (Osama et al., PPoPP 2023,
arXiv 2301.03598).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
from torch import Tensor

from .. import providers
from ._common import (ENABLED_PATHS, HAS_TRITON, available, cdiv, descriptors_supported, launch,
                      next_pow2, num_sms, set_descriptor_allocator, warp_specialize_supported)
from .attention_tiles import (_descriptor_kv, _gather_kv, _interior_tiles, _invalid_pages,
                              _load_tile, _mask_scores, _online_softmax, _scores)

if HAS_TRITON:
    import triton
    import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _request_geometry(CACHE_SEQLENS, CU_Q, CU_K, req, stride_seqlens, stride_cu_q, stride_cu_k,
                      total_q, total_k, max_seqlen_q, max_kv_len, PAGED: tl.constexpr):
    # (q_start, q_len, kv_start, kv_len) of request req, from strided metadata, clamped so that
    # inconsistent values never address rows outside q/out (or ragged K/V): rows into
    # [0, total_q], at most max_seqlen_q of them (the grid's bound); keys into [0, max_kv_len]
    # (the page table's capacity, or max_seqlen_k), ragged rows into [0, total_k].
    q_start = tl.minimum(tl.maximum(tl.load(CU_Q + req * stride_cu_q), 0), total_q)
    q_end = tl.minimum(tl.maximum(tl.load(CU_Q + (req + 1) * stride_cu_q), q_start), total_q)
    q_len = tl.minimum(q_end - q_start, max_seqlen_q)
    kv_len = tl.load(CACHE_SEQLENS + req * stride_seqlens)
    kv_start = 0
    if not PAGED:
        kv_start = tl.minimum(tl.maximum(tl.load(CU_K + req * stride_cu_k), 0), total_k)
        kv_end = tl.minimum(tl.maximum(tl.load(CU_K + (req + 1) * stride_cu_k), kv_start),
                            total_k)
        kv_len = tl.minimum(kv_len, kv_end - kv_start)
    kv_len = tl.minimum(tl.maximum(kv_len, 0), max_kv_len)
    return q_start, q_len, kv_start, kv_len


@triton.jit
def _paged_attention_kernel(
    Q, K, V, QV, O, LSE, O_PART, LSE_PART, COUNTERS,
    CACHE_SEQLENS, PAGE_TABLE, CU_Q, CU_K, Q_DESCALE, K_DESCALE, V_DESCALE, SINKS,
    K_START, BLOCK_IDS, Q_USED,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_qvt, stride_qvh, stride_ot, stride_oh, stride_lse_h, stride_pt_b,
    stride_part_s, stride_part_t, stride_part_h, stride_lsep_s, stride_lsep_t,
    stride_seqlens, stride_cu_q, stride_cu_k, stride_pt_p, stride_sinks, stride_qd_b,
    stride_qd_h, stride_kd_b, stride_kd_h, stride_vd_b, stride_vd_h, stride_k_start,
    stride_block_ids, stride_q_used,
    softmax_scale, softcap, window_left, window_right, group, num_heads_kv, head_dim,
    head_dim_v, split_tiles, total_q, total_k, num_pages, max_seqlen_q, max_kv_len,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, HAS_QV: tl.constexpr,
    HAS_Q_DESCALE: tl.constexpr, HAS_K_DESCALE: tl.constexpr, HAS_V_DESCALE: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_K_START: tl.constexpr, HAS_BLOCK_IDS: tl.constexpr,
    HAS_Q_USED: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, PAGE_TILES: tl.constexpr, EVEN_D: tl.constexpr,
    PHASES: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr, GROUP: tl.constexpr,
    DV_SPLIT: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16)
    tl.static_assert(BLOCK_N >= 16)
    LOG2E_C: tl.constexpr = 1.4426950408889634
    LN2_C: tl.constexpr = 0.6931471805599453
    # Heaviest causal tiles (last rows) first; DV_SPLIT programs per row tile, each
    # accumulating one DV_W-column chunk of the output (all of them compute the full scores).
    DV_W: tl.constexpr = DV_PAD // DV_SPLIT
    chunk = tl.program_id(0) % DV_SPLIT
    pid_m = tl.num_programs(0) // DV_SPLIT - 1 - tl.program_id(0) // DV_SPLIT
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    req = pid_bh // num_heads_kv
    kv_head = pid_bh % num_heads_kv

    # ---- request geometry: queries, keys, rows of this program ----
    q_start, q_len, kv_start, kv_len = _request_geometry(
        CACHE_SEQLENS, CU_Q, CU_K, req, stride_seqlens, stride_cu_q, stride_cu_k, total_q,
        total_k, max_seqlen_q, max_kv_len, PAGED)
    row_first = (pid_m * BLOCK_M) // group
    if row_first >= q_len:
        return
    row_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // group, q_len - 1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_row = offs_m // group
    head = kv_head * group + offs_m % group
    mask_m = q_row < q_len
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    offs_dc = chunk * DV_W + tl.arange(0, DV_W)  # this program's output columns
    mask_dc = offs_dc < head_dim_v
    mask_d = offs_d < head_dim
    mask_dv = offs_dv < head_dim_v
    tok = (q_start + q_row).to(tl.int64)

    # Per-row visible key range [lo_row, hi_row] (bottom-right aligned position pos; with
    # seqused_q the first q_used rows align, the others see nothing).
    q_used = q_len
    if HAS_Q_USED:
        q_used = tl.load(Q_USED + req * stride_q_used)
    k_start = 0
    if HAS_K_START:
        k_start = tl.load(K_START + req * stride_k_start)
    pos = kv_len - q_used + q_row
    hi_row = kv_len - 1 + tl.zeros_like(pos)
    lo_row = k_start + tl.zeros_like(pos)
    if window_right >= 0:
        hi_row = tl.minimum(hi_row, pos + window_right)
    if window_left >= 0:
        lo_row = tl.maximum(lo_row, pos - window_left)
    if HAS_Q_USED:
        hi_row = tl.where(q_row < q_used, hi_row, -1)
    if HAS_BLOCK_IDS:  # query block ids; key j has the id of query row j - (kv_len - q_len)
        q_block = tl.load(BLOCK_IDS + tok * stride_block_ids, mask=mask_m, other=-1)
    # Block range: the union over this program's rows (monotone in the row index).
    blk_hi = kv_len
    blk_lo = k_start
    if not HAS_BLOCK_IDS:  # same-block keys may sit past the right bound
        if window_right >= 0:
            blk_hi = tl.minimum(kv_len, kv_len - q_used + row_last + window_right + 1)
    if window_left >= 0:
        blk_lo = tl.maximum(blk_lo, kv_len - q_used + row_first - window_left)
    blk_lo = (blk_lo // BLOCK_N) * BLOCK_N
    if NUM_SPLITS > 1:
        # Fixed-size chunks of split_tiles tiles (from shapes): a short request uses only its
        # first splits, so every program does at most one chunk (load balance across requests).
        blk_lo = blk_lo + split * split_tiles * BLOCK_N
        blk_hi = tl.minimum(blk_hi, blk_lo + split_tiles * BLOCK_N)
    # Keys every row of the program sees: tiles inside [full_lo, full_hi) need no mask.
    full_hi = blk_hi
    if window_right >= 0:
        full_hi = tl.minimum(full_hi, kv_len - q_used + row_first + window_right + 1)
    full_lo = tl.maximum(blk_lo, k_start)
    if window_left >= 0:
        full_lo = tl.maximum(full_lo, kv_len - q_used + row_last - window_left)
    if HAS_Q_USED | HAS_BLOCK_IDS:  # per-row or per-key masks: mask every tile
        full_hi = full_lo

    # ---- load the query tile once; fold scales into one log2-domain multiplier ----
    if TMA:  # rows (token, head in group) of this KV head: a [tokens, GROUP, D] box
        q_desc = tl.make_tensor_descriptor(
            Q + q_start.to(tl.int64) * stride_qt + (kv_head * GROUP).to(tl.int64) * stride_qh,
            shape=[q_len, GROUP, head_dim], strides=[stride_qt, stride_qh, 1],
            block_shape=[BLOCK_M // GROUP, GROUP, D_PAD])
        q = q_desc.load([row_first, 0, 0]).reshape([BLOCK_M, D_PAD])
    else:
        q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if HAS_QV:
        qv = tl.load(QV + tok[:, None] * stride_qvt + head[:, None] * stride_qvh + offs_dv[None, :],
                     mask=mask_m[:, None] & mask_dv[None, :], other=0.0)
    compute_dtype = q.dtype
    if UPCAST:  # Triton's CPU interpreter multiplies bf16 as raw bits: compute in fp32 there
        compute_dtype = tl.float32
        q = q.to(compute_dtype)
    elif q.dtype.is_fp8():
        compute_dtype = tl.bfloat16
        q = q.to(compute_dtype)
    qk_scale = softmax_scale
    if HAS_Q_DESCALE:
        qk_scale = qk_scale * tl.load(Q_DESCALE + req * stride_qd_b + kv_head * stride_qd_h)
    v_descale = 1.0
    k_scale = qk_scale
    if HAS_K_DESCALE:
        k_scale = qk_scale * tl.load(K_DESCALE + req * stride_kd_b + kv_head * stride_kd_h)
    if HAS_V_DESCALE:
        v_descale = tl.load(V_DESCALE + req * stride_vd_b + kv_head * stride_vd_h)
    if not USE_SOFTCAP:
        k_scale = k_scale * LOG2E_C  # scores go straight to the exp2 domain

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_W], tl.float32)
    pt_row = PAGE_TABLE + req.to(tl.int64) * stride_pt_b
    k_head = K + kv_head.to(tl.int64) * stride_kh
    v_head = V + kv_head.to(tl.int64) * stride_vh
    if HAS_QV:
        qv = qv.to(compute_dtype)
    else:
        qv = q
    qv_scale = qk_scale * v_descale * (1.0 if USE_SOFTCAP else LOG2E_C)
    if HAS_BLOCK_IDS:
        blocks = q_block
    else:
        blocks = q_row

    if not PHASES:  # one loop, each tile masked when it needs it
        for start_n in range(blk_lo, blk_hi, BLOCK_N):
            k, v, v_rows, offs_n, mask_n, pages_ok = _gather_kv(
                k_head, v_head, pt_row, start_n, blk_hi, k_start, kv_start, offs_d, offs_dv,
                mask_d, mask_dv, num_pages, stride_pt_p, stride_kp, stride_ks, stride_vp,
                stride_vs, BLOCK_N, PAGE_SIZE, PAGED, PAGE_TILES, EVEN_D, True)
            s = _scores(q, qv, k.to(compute_dtype), v.to(compute_dtype), k_scale, qv_scale,
                        softcap, HAS_QV, USE_SOFTCAP, PRECISION)
            if (start_n < full_lo) | (start_n + BLOCK_N > full_hi) | (pages_ok == 0):
                s = _mask_scores(s, offs_n, mask_n, lo_row, hi_row, blocks, BLOCK_IDS, q_start,
                                 kv_len, q_len, stride_block_ids, HAS_BLOCK_IDS)
            if DV_SPLIT > 1:  # this program's columns of the tile (cache lines just loaded)
                v = _load_tile(v_head + v_rows[:, None] + offs_dc[None, :], mask_n, mask_dc,
                               True, EVEN_D)
            acc, m_i, l_i = _online_softmax(s, v.to(compute_dtype), acc, m_i, l_i, PRECISION)
    else:  # masked edge tiles | unmasked interior tiles | masked edge tiles
        mid_lo, mid_hi = _interior_tiles(blk_lo, blk_hi, full_lo, full_hi, BLOCK_N)
        if PAGED:
            if _invalid_pages(pt_row, mid_lo, mid_hi, num_pages, stride_pt_p, PAGE_SIZE) > 0:
                mid_hi = mid_lo
        for start_n in range(blk_lo, mid_lo, BLOCK_N):
            acc, m_i, l_i = _masked_step(
                acc, m_i, l_i, q, qv, start_n, blk_hi, k_start, kv_start, k_head, v_head,
                pt_row, offs_d, offs_dv, mask_d, mask_dv, lo_row, hi_row, blocks, BLOCK_IDS,
                q_start, kv_len, q_len, k_scale, qv_scale, softcap, num_pages, stride_pt_p,
                stride_kp, stride_ks, stride_vp, stride_vs, stride_block_ids, BLOCK_N,
                PAGE_SIZE, PAGED, PAGE_TILES, EVEN_D, HAS_QV, HAS_BLOCK_IDS, USE_SOFTCAP,
                PRECISION)
        if TMA:
            k_desc, v_desc = _kv_descriptors(K, V, num_pages, total_k, num_heads_kv, head_dim,
                                             head_dim_v, stride_kp, stride_ks, stride_kh,
                                             stride_vp, stride_vs, stride_vh, BLOCK_N, D_PAD,
                                             DV_PAD, PAGE_SIZE, PAGED)
            if WS:
                for start_n in tl.range(mid_lo, mid_hi, BLOCK_N, warp_specialize=True):
                    k, v = _descriptor_kv(k_desc, v_desc, pt_row, start_n, kv_start, kv_head,
                                          stride_pt_p, BLOCK_N, D_PAD, DV_PAD, PAGE_SIZE, PAGED)
                    s = _scores(q, qv, k.to(compute_dtype), v.to(compute_dtype), k_scale,
                                qv_scale, softcap, HAS_QV, USE_SOFTCAP, PRECISION)
                    acc, m_i, l_i = _online_softmax(s, v.to(compute_dtype), acc, m_i, l_i,
                                                    PRECISION)
            else:
                for start_n in range(mid_lo, mid_hi, BLOCK_N):
                    k, v = _descriptor_kv(k_desc, v_desc, pt_row, start_n, kv_start, kv_head,
                                          stride_pt_p, BLOCK_N, D_PAD, DV_PAD, PAGE_SIZE, PAGED)
                    s = _scores(q, qv, k.to(compute_dtype), v.to(compute_dtype), k_scale,
                                qv_scale, softcap, HAS_QV, USE_SOFTCAP, PRECISION)
                    acc, m_i, l_i = _online_softmax(s, v.to(compute_dtype), acc, m_i, l_i,
                                                    PRECISION)
        else:
            for start_n in range(mid_lo, mid_hi, BLOCK_N):
                k, v, v_rows, offs_n, mask_n, pages_ok = _gather_kv(
                    k_head, v_head, pt_row, start_n, blk_hi, k_start, kv_start, offs_d, offs_dv,
                    mask_d, mask_dv, num_pages, stride_pt_p, stride_kp, stride_ks, stride_vp,
                    stride_vs, BLOCK_N, PAGE_SIZE, PAGED, PAGE_TILES, EVEN_D, False)
                s = _scores(q, qv, k.to(compute_dtype), v.to(compute_dtype), k_scale, qv_scale,
                            softcap, HAS_QV, USE_SOFTCAP, PRECISION)
                acc, m_i, l_i = _online_softmax(s, v.to(compute_dtype), acc, m_i, l_i,
                                                PRECISION)
        for start_n in range(mid_hi, blk_hi, BLOCK_N):
            acc, m_i, l_i = _masked_step(
                acc, m_i, l_i, q, qv, start_n, blk_hi, k_start, kv_start, k_head, v_head,
                pt_row, offs_d, offs_dv, mask_d, mask_dv, lo_row, hi_row, blocks, BLOCK_IDS,
                q_start, kv_len, q_len, k_scale, qv_scale, softcap, num_pages, stride_pt_p,
                stride_kp, stride_ks, stride_vp, stride_vs, stride_block_ids, BLOCK_N,
                PAGE_SIZE, PAGED, PAGE_TILES, EVEN_D, HAS_QV, HAS_BLOCK_IDS, USE_SOFTCAP,
                PRECISION)

    # ---- epilogue: normalise, write out (or this split's partial) and the LSE ----
    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = tl.load(SINKS + head * stride_sinks, mask=mask_m, other=0.0) * LOG2E_C
            m_fin = tl.maximum(m_i, sink)
            m_fin_safe = tl.where(m_fin == float("-inf"), 0.0, m_fin)  # no key, sink -inf
            scale = tl.exp2(m_i - m_fin_safe)
            l_i = l_i * scale + tl.exp2(sink - m_fin_safe)
            acc = acc * scale[:, None]
            m_i = m_fin
        has_keys = l_i > 0
        out = acc * (v_descale / tl.where(has_keys, l_i, 1.0))[:, None]
        lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2_C,
                       float("-inf"))
        if TMA:  # rows past the request's q_len fall outside the box: not written
            o_desc = tl.make_tensor_descriptor(
                O + q_start.to(tl.int64) * stride_ot + (kv_head * GROUP).to(tl.int64) * stride_oh,
                shape=[q_len, GROUP, head_dim_v], strides=[stride_ot, stride_oh, 1],
                block_shape=[BLOCK_M // GROUP, GROUP, DV_PAD])
            o_desc.store([row_first, 0, 0],
                         out.to(O.dtype.element_ty).reshape([BLOCK_M // GROUP, GROUP, DV_PAD]))
        else:
            tl.store(O + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_dc[None, :],
                     out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_dc[None, :])
        tl.store(LSE + head.to(tl.int64) * stride_lse_h + tok, lse, mask=mask_m)
    else:
        has_keys = l_i > 0
        out = acc * (v_descale / tl.where(has_keys, l_i, 1.0))[:, None]
        lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2_C,
                       float("-inf"))
        part = O_PART + split.to(tl.int64) * stride_part_s
        tl.store(part + tok[:, None] * stride_part_t + head[:, None] * stride_part_h
                 + offs_dc[None, :], out, mask=mask_m[:, None] & mask_dc[None, :])
        tl.store(LSE_PART + split.to(tl.int64) * stride_lsep_s + tok * stride_lsep_t + head,
                 lse, mask=mask_m)
        # ---- split-KV reduction: the tile's last split program to arrive merges them all ----
        # The barrier orders every thread's partial stores before the counter update; acq_rel at
        # gpu scope releases them to, and acquires the other splits' for, the last arrival.
        tl.debug_barrier()
        counter = COUNTERS + pid_bh * tl.num_programs(0) + pid_m * DV_SPLIT + chunk
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:
            _merge_splits_tile(O_PART, LSE_PART, O, LSE, SINKS, tok, head, mask_m, head_dim_v,
                               chunk * DV_W, stride_sinks,
                               stride_part_s, stride_part_t, stride_part_h,
                               stride_lsep_s, stride_lsep_t, stride_ot, stride_oh, stride_lse_h,
                               BLOCK_M, DV_W, NUM_SPLITS, HAS_SINKS)
            tl.store(counter, 0)  # zero again for the next launch (and graph replay)


@triton.jit
def _masked_step(acc, m_i, l_i, q, qv, start_n, blk_hi, k_start, kv_start, k_head, v_head, pt_row,
                 offs_d, offs_dv, mask_d, mask_dv, lo_row, hi_row, blocks, BLOCK_IDS, q_start,
                 kv_len, q_len, k_scale, qv_scale, softcap, num_pages, stride_pt_p, stride_kp,
                 stride_ks, stride_vp, stride_vs, stride_block_ids, BLOCK_N: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, PAGE_TILES: tl.constexpr,
                 EVEN_D: tl.constexpr, HAS_QV: tl.constexpr, HAS_BLOCK_IDS: tl.constexpr,
                 USE_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    # One edge tile of the three-phase schedule: predicated gather, every mask applied.
    k, v, v_rows, offs_n, mask_n, pages_ok = _gather_kv(
        k_head, v_head, pt_row, start_n, blk_hi, k_start, kv_start, offs_d, offs_dv, mask_d,
        mask_dv, num_pages, stride_pt_p, stride_kp, stride_ks, stride_vp, stride_vs, BLOCK_N,
        PAGE_SIZE, PAGED, PAGE_TILES, EVEN_D, True)
    k, v = k.to(q.dtype), v.to(q.dtype)
    s = _scores(q, qv, k, v, k_scale, qv_scale, softcap, HAS_QV, USE_SOFTCAP, PRECISION)
    s = _mask_scores(s, offs_n, mask_n, lo_row, hi_row, blocks, BLOCK_IDS, q_start, kv_len, q_len,
                     stride_block_ids, HAS_BLOCK_IDS)
    return _online_softmax(s, v, acc, m_i, l_i, PRECISION)


@triton.jit
def _kv_descriptors(K, V, num_pages, total_k, num_heads_kv, head_dim, head_dim_v, stride_kp,
                    stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, BLOCK_N: tl.constexpr,
                    D_PAD: tl.constexpr, DV_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    PAGED: tl.constexpr):
    # K/V tensor descriptors: a [1, BLOCK_N, 1, D] box of [num_pages, page_size, Hkv, D]
    # (paged; BLOCK_N <= page_size), or a [BLOCK_N, 1, D] box of ragged [total_k, Hkv, D].
    if PAGED:
        k_desc = tl.make_tensor_descriptor(
            K, shape=[num_pages, PAGE_SIZE, num_heads_kv, head_dim],
            strides=[stride_kp, stride_ks, stride_kh, 1], block_shape=[1, BLOCK_N, 1, D_PAD])
        v_desc = tl.make_tensor_descriptor(
            V, shape=[num_pages, PAGE_SIZE, num_heads_kv, head_dim_v],
            strides=[stride_vp, stride_vs, stride_vh, 1], block_shape=[1, BLOCK_N, 1, DV_PAD])
    else:
        k_desc = tl.make_tensor_descriptor(
            K, shape=[total_k, num_heads_kv, head_dim], strides=[stride_ks, stride_kh, 1],
            block_shape=[BLOCK_N, 1, D_PAD])
        v_desc = tl.make_tensor_descriptor(
            V, shape=[total_k, num_heads_kv, head_dim_v], strides=[stride_vs, stride_vh, 1],
            block_shape=[BLOCK_N, 1, DV_PAD])
    return k_desc, v_desc


@triton.jit
def _merge_splits_tile(
    O_PART, LSE_PART, O, LSE, SINKS, tok, head, mask_m, head_dim_v, col0, stride_sinks,
    stride_part_s, stride_part_t, stride_part_h, stride_lsep_s, stride_lsep_t,
    stride_ot, stride_oh, stride_lse_h,
    BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # BLOCK_M rows, output columns [col0, col0 + WIDTH): out = sum_s e^{lse_s - m} o_s /
    # (sum_s e^{lse_s - m} [+ e^{sink - m}]), the splits summed in order 0..NUM_SPLITS-1
    # whichever program merges (deterministic). Loads bypass L1 (.cg): other multiprocessors
    # wrote the partials during this launch.
    LOG2E_C: tl.constexpr = 1.4426950408889634
    LN2_C: tl.constexpr = 0.6931471805599453
    DV_CHUNK: tl.constexpr = 64 if WIDTH > 64 else WIDTH  # bounds registers for MLA's Dv 512
    # Pointers advance by one split per iteration (no int32 split x stride products).
    lse_rows = LSE_PART + tok * stride_lsep_t + head
    lse_s = lse_rows
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for _ in range(0, NUM_SPLITS):
        m = tl.maximum(m, tl.load(lse_s, mask=mask_m, other=float("-inf"),
                                  cache_modifier=".cg") * LOG2E_C)
        lse_s += stride_lsep_s
    if HAS_SINKS:
        sink = tl.load(SINKS + head * stride_sinks, mask=mask_m, other=0.0) * LOG2E_C
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_M], tl.float32)
    lse_s = lse_rows
    for _ in range(0, NUM_SPLITS):  # empty splits (lse -inf) weigh 0
        den += tl.exp2(tl.load(lse_s, mask=mask_m, other=float("-inf"), cache_modifier=".cg")
                       * LOG2E_C - m_safe)
        lse_s += stride_lsep_s
    if HAS_SINKS:
        den += tl.exp2(sink - m_safe)
    has_keys = den > 0
    inv_den = 1.0 / tl.where(has_keys, den, 1.0)
    lse = tl.where(has_keys, (m_safe + tl.log2(tl.where(has_keys, den, 1.0))) * LN2_C,
                   float("-inf"))
    tl.store(LSE + head.to(tl.int64) * stride_lse_h + tok, lse, mask=mask_m)
    o_rows = O_PART + tok[:, None] * stride_part_t + head[:, None] * stride_part_h
    out_rows = O + tok[:, None] * stride_ot + head[:, None] * stride_oh
    for dv_start in tl.static_range(0, WIDTH, DV_CHUNK):
        offs_dv = col0 + dv_start + tl.arange(0, DV_CHUNK)
        mask_dv = offs_dv < head_dim_v
        acc = tl.zeros([BLOCK_M, DV_CHUNK], tl.float32)
        lse_s = lse_rows
        o_s = o_rows + offs_dv[None, :]
        for _ in range(0, NUM_SPLITS):
            w = tl.exp2(tl.load(lse_s, mask=mask_m, other=float("-inf"), cache_modifier=".cg")
                        * LOG2E_C - m_safe)
            o = tl.load(o_s, mask=(mask_m & (w > 0))[:, None] & mask_dv[None, :], other=0.0,
                        cache_modifier=".cg")
            acc += o * w[:, None]
            lse_s += stride_lsep_s
            o_s += stride_part_s
        tl.store(out_rows + offs_dv[None, :], (acc * inv_den[:, None]).to(O.dtype.element_ty),
                 mask=mask_m[:, None] & mask_dv[None, :])


@dataclasses.dataclass(frozen=True)
class _Config:
    """Tile shape and kernel paths of one launch (``_common.OPTIONAL_PATHS``; each applies
    where the launch allows it, else the launch runs without it).

    ``page_tiles``: key tiles addressed per page (power-of-two page sizes, at most two pages
    per tile). ``phases``: the
    three-phase key loop (``attention_tiles``). ``tma``: tensor descriptors for Q, O and the
    interior K/V tiles (CUDA capability >= 9.0 with descriptor support, 16-byte aligned rows,
    a power-of-two GQA group; paged: BLOCK_N capped at the page size, 3 stages or more);
    implies both others.
    ``ws``: the interior loop warp-specialised (``tl.range(warp_specialize=True)``) on top of
    ``tma``. ``dv_split``: programs per row tile, each accumulating ``Dv_pad / dv_split`` output
    columns (FlashMLA's split of the 512 latent columns, here across programs, which all compute
    the scores); only with ``qv`` (absorbed MLA), the one-loop schedule and
    ``BLOCK_M >= 16 * dv_split``.
    """
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    page_tiles: bool = False
    phases: bool = False
    tma: bool = False
    ws: bool = False
    dv_split: int = 1


def _pick_config(device: torch.device, rows_per_request: int, d_pad: int, dv_pad: int,
                 elem_bytes: int, paths: frozenset = ENABLED_PATHS,
                 page_size: Optional[int] = None) -> _Config:
    """Tile shape from shapes only (``rows_per_request = max_seqlen_q * G`` packed M rows), with
    the optional ``paths`` (``_common.OPTIONAL_PATHS``) that are on.

    With ``page_tiles``, a decode tile holds one whole page where pages have 16 or more keys
    (BLOCK_N = page_size when smaller than the default), so its K/V addresses come from one
    page id and the compiler can stage the loads through shared memory; the pipeline deepens
    to keep as many bytes in flight (at most 8 stages)."""
    tiles = _pick_tiles(device, rows_per_request, d_pad, dv_pad, elem_bytes)
    if ("page_tiles" in paths and rows_per_request <= 64 and page_size is not None
            and 16 <= page_size < tiles.block_n and page_size == next_pow2(page_size)):
        stages = min(8, tiles.num_stages * tiles.block_n // page_size)
        tiles = dataclasses.replace(tiles, block_n=page_size, num_stages=stages)
    return with_paths(tiles, paths)


def with_paths(config: _Config, paths: frozenset) -> _Config:
    """``config`` with exactly the optional kernel ``paths`` on (and the ones they imply)."""
    ws = "tma_ws" in paths
    tma = ws or "tma" in paths
    return dataclasses.replace(config, page_tiles=tma or "page_tiles" in paths,
                               phases=tma or "phases" in paths, tma=tma, ws=ws,
                               dv_split=2 if "mla_split" in paths else 1)


def default_config(q: Tensor, v: Tensor, max_seqlen_q: int, num_heads_kv: int,
                   paths: frozenset = ENABLED_PATHS,
                   page_size: Optional[int] = None) -> _Config:
    """The config a launch on these tensors picks, with ``paths`` on (benchmarks A/B paths with
    ``paged_attention(..., config=default_config(..., paths))``). ``page_size``: of a paged
    cache (None: ragged K/V)."""
    group = q.shape[1] // num_heads_kv
    d_pad, dv_pad = max(16, next_pow2(q.shape[-1])), max(16, next_pow2(v.shape[-1]))
    return _pick_config(q.device, max_seqlen_q * group, d_pad, dv_pad, q.element_size(), paths,
                        page_size)


def _pick_tiles(device: torch.device, rows_per_request: int, d_pad: int, dv_pad: int,
                elem_bytes: int) -> _Config:
    """Tile shape from shapes only. ``rows_per_request = max_seqlen_q * G`` packed M rows."""
    if device.type == "cpu":  # interpreter: small tiles exercise the multi-tile paths
        return _Config(max(16, min(32, next_pow2(rows_per_request))), 16, 1, 1)
    wide = max(d_pad, dv_pad)
    if rows_per_request <= 64:  # decode / short verify: M = packed heads
        block_m = max(16, next_pow2(rows_per_request))
        if wide >= 512:
            return _Config(min(block_m, 64), 64, 8, 2)
        if wide >= 256:
            return _Config(block_m, 32, 4, 3)
        if elem_bytes > 2:
            return _Config(block_m, 64, 4, 2)
        return _Config(block_m, 64, 2 if block_m <= 16 else 4, 4)
    if wide >= 512:
        return _Config(64, 64, 8, 2)   # MLA: H200 sweep best (0.39 ms vs 0.49 with BLOCK_N 32)
    if wide >= 256 or elem_bytes > 2:
        return _Config(64, 32, 4, 2)
    return _Config(128, 128, 8, 2)     # H200 sweep: 3.59 ms vs 4.21 for (128, 64, 8, 3)


def plan_num_splits(device: torch.device, programs: int, max_kv_len: int, block_n: int,
                    decode: bool) -> int:
    """KV splits from shapes only (never tensor values).

    Enough programs to give every multiprocessor ~4 (few long requests), each split at least
    4 key tiles, at most 64. Decode-like launches also cut contexts into chunks of >= 512 keys,
    up to 8 (H200 sweep: 8 splits is within noise of the best for 64 x 4096 and 8 x 32768, and
    0.80 -> 0.89 of copy bandwidth for 64 requests of uniform [100, 8000] lengths, because a
    fixed chunk balances long and short requests).
    """
    fill = round(4 * num_sms(device) / max(programs, 1))
    chunks = min(8, cdiv(max_kv_len, 512)) if decode else 1
    return max(1, min(max(fill, chunks), cdiv(max_kv_len, 4 * block_n), 64))


@dataclasses.dataclass(frozen=True)
class _LaunchParams:
    """What one ``paged_attention`` call shape launches: everything but the tensors."""
    grid: tuple[int, int, int]
    scalars: tuple  # the kernel's arguments after its 17 tensors (strides, sizes, scalars)
    meta: dict      # constexprs and launch options
    num_splits: int
    dv_pad: int
    num_tiles: int  # (m-block, request x KV head) tiles: split-KV counters needed


@functools.lru_cache(maxsize=512)
def _launch_params(device: torch.device, q_shape, q_strides, q_dtype, k_shape, k_strides,
                   v_shape, v_strides, out_strides, qv_strides, pt_strides, paged: bool,
                   batch: int, max_seqlen_q: int, max_kv_len: int, flags: tuple,
                   softmax_scale: float, softcap: float, window_left: int, window_right: int,
                   num_splits: Optional[int], config: Optional[_Config], part_strides,
                   lse_stride: int, meta_strides: tuple, layout: tuple) -> _LaunchParams:
    """Grid, tile config, split count and every scalar argument of one call shape (cached: a
    decode step repeats the same shape in every layer, so this runs once per shape).
    ``meta_strides``: ``_metadata_strides`` of the small tensors (their layouts are honoured).
    ``layout``: ``(q, K/V, out)`` element sizes and whether q, K, V, out start 16-byte aligned."""
    total_q, num_heads_q, head_dim = q_shape
    head_dim_v = v_shape[-1]
    num_heads_kv = k_shape[2] if paged else k_shape[1]
    group = num_heads_q // num_heads_kv
    has_qv, has_qd, has_kd, has_vd, has_sinks, has_k_start, has_block_ids, has_q_used = flags
    d_pad, dv_pad = max(16, next_pow2(head_dim)), max(16, next_pow2(head_dim_v))
    elem = torch.empty((), dtype=q_dtype).element_size()
    page_size = k_shape[1] if paged else 1
    cfg = config or _pick_config(device, max_seqlen_q * group, d_pad, dv_pad, elem,
                                 page_size=page_size if paged else None)
    cfg, paths = _kernel_paths(cfg, device, paged, page_size, group, (head_dim, head_dim_v),
                               (d_pad, dv_pad), layout, (q_strides, k_strides, v_strides,
                                                         out_strides), has_qv)
    m_blocks = cdiv(max(max_seqlen_q, 1) * group, cfg.block_m)
    grid_m = m_blocks * paths["DV_SPLIT"]
    if num_splits is None:
        num_splits = plan_num_splits(device, grid_m * batch * num_heads_kv, max_kv_len,
                                     cfg.block_n, decode=m_blocks <= 2)
    if paged:
        kp, ks, kh = k_strides[:3]
        vp, vs, vh = v_strides[:3]
        pt_stride = pt_strides[0]
    else:
        kp, ks, kh, vp, vs, vh = 0, k_strides[0], k_strides[1], 0, v_strides[0], v_strides[1]
        pt_stride = 0
    if num_splits > 1:
        if part_strides is None:  # fresh contiguous scratch
            part_strides = ((total_q * num_heads_q * dv_pad, num_heads_q * dv_pad, dv_pad),
                            (total_q * num_heads_q, num_heads_q))
        (ps, pt_, ph), (ls, lt) = part_strides[0][:3], part_strides[1][:2]
    else:
        ps = pt_ = ph = ls = lt = 0
    upcast = device.type == "cpu" and q_dtype != torch.float32
    precision = "ieee" if q_dtype == torch.float32 or upcast else None
    qv_s = qv_strides if has_qv else q_strides
    scalars = (
        q_strides[0], q_strides[1], kp, ks, kh, vp, vs, vh, qv_s[0], qv_s[1],
        out_strides[0], out_strides[1], lse_stride, pt_stride, ps, pt_, ph, ls, lt,
        *meta_strides, float(softmax_scale), float(softcap), int(window_left),
        int(window_right), group, num_heads_kv, head_dim, head_dim_v,
        cdiv(cdiv(max(max_kv_len, 1), cfg.block_n), num_splits), total_q, k_shape[0],
        k_shape[0], max_seqlen_q, max_kv_len)
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D_PAD=d_pad, DV_PAD=dv_pad,
                PAGE_SIZE=page_size, PAGED=paged, HAS_QV=has_qv, HAS_Q_DESCALE=has_qd,
                HAS_K_DESCALE=has_kd, HAS_V_DESCALE=has_vd, HAS_SINKS=has_sinks,
                HAS_K_START=has_k_start, HAS_BLOCK_IDS=has_block_ids, HAS_Q_USED=has_q_used,
                USE_SOFTCAP=softcap > 0, NUM_SPLITS=num_splits, PRECISION=precision,
                UPCAST=upcast, **paths, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _LaunchParams((grid_m, batch * num_heads_kv, num_splits), scalars, meta, num_splits,
                         dv_pad, grid_m * batch * num_heads_kv)


def _kernel_paths(cfg: _Config, device: torch.device, paged: bool, page_size: int, group: int,
                  dims: tuple, pads: tuple, layout: tuple, strides: tuple,
                  has_qv: bool) -> tuple[_Config, dict]:
    """The kernel-path constexprs the launch can honour, and the config (BLOCK_N capped at the
    page size for paged descriptors, at 32 keys for split latent columns). ``strides``: q, K,
    V, out strides.

    Absorbed MLA's Dv >= 512 keeps the one-loop, per-key schedule: compiled for sm_90,
    ``page_tiles`` and ``phases`` spill registers there (``benchmarks/compile_kernels.py``)."""
    wide = pads[1] >= 512
    if wide:
        cfg = dataclasses.replace(cfg, page_tiles=False, phases=False, tma=False, ws=False)
    dv_split = cfg.dv_split
    if not (has_qv and not cfg.phases and cfg.block_m >= 16 * dv_split
            and pads[1] % dv_split == 0 and pads[1] // dv_split >= 16):
        dv_split = 1
    if dv_split > 1 and wide and cfg.block_n > 32:  # the chunk's V tiles need shared memory
        cfg = dataclasses.replace(cfg, block_n=32)
    elem, kv_elem, out_elem, aligned = layout
    pow2_pages = page_size == next_pow2(page_size)
    even_d = tuple(dims) == tuple(pads)
    tma = (cfg.tma and aligned and descriptors_supported(device.type, device.index)
           and group == next_pow2(group) and cfg.block_m % group == 0
           and (not paged or (pow2_pages and page_size >= 16))
           and _rows_aligned(strides, (elem, kv_elem, kv_elem, out_elem), paged))
    if tma and paged and cfg.block_n > page_size:  # one page per box, one stage deeper
        cfg = dataclasses.replace(cfg, block_n=page_size, num_stages=max(cfg.num_stages, 3))
    # at most two pages per tile: with more (page sizes 1-8 under 64-key tiles) the per-page
    # offsets, reshaped to keys, spill (Triton 3.6, sm_90: 640 bytes at page 1)
    few_pages = cfg.block_n <= 2 * page_size
    return cfg, dict(PAGE_TILES=cfg.page_tiles and paged and pow2_pages and few_pages,
                     EVEN_D=cfg.page_tiles and even_d, PHASES=cfg.phases, TMA=tma,
                     WS=tma and cfg.ws and warp_specialize_supported(),
                     GROUP=group if tma else 1, DV_SPLIT=dv_split)


def _rows_aligned(strides: tuple, elems: tuple, paged: bool) -> bool:
    """Every non-unit stride of q, K, V and out is a multiple of 16 bytes (descriptor rows)."""
    dims = (2, 3 if paged else 2, 3 if paged else 2, 2)
    return all(st * e % 16 == 0 for t, e, n in zip(strides, elems, dims) for st in t[:n])


def paged_attention(q: Tensor, k: Tensor, v: Tensor, out: Tensor, cache_seqlens: Tensor,
                    cu_seqlens_q: Tensor, *, page_table: Optional[Tensor],
                    cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_kv_len: int,
                    qv: Optional[Tensor], q_descale: Optional[Tensor],
                    k_descale: Optional[Tensor], v_descale: Optional[Tensor],
                    sinks: Optional[Tensor], softmax_scale: float, window_left: int,
                    window_right: int, softcap: float, num_splits: Optional[int] = None,
                    scratch: Optional[tuple[Tensor, Tensor]] = None,
                    counters: Optional[Tensor] = None, config: Optional[_Config] = None,
                    lse: Optional[Tensor] = None, k_start: Optional[Tensor] = None,
                    block_ids: Optional[Tensor] = None,
                    q_used: Optional[Tensor] = None) -> Tensor:
    """Launch the attention kernel (splits merged inside it); write ``out``, return the LSE.

    Args:
        q: [total_q, Hq, D]. out: [total_q, Hq, Dv] (written). qv: [total_q, Hq, Dv] or None.
        k, v: paged [num_pages, page_size, Hkv, D|Dv] with ``page_table [b, max_pages]``, or
            ragged [total_k, Hkv, D|Dv] with ``cu_seqlens_k [b + 1]`` (``page_table=None``).
            Only the last dimension needs unit stride.
        cache_seqlens: [b] int32 keys per request (tokens).
        cu_seqlens_q: [b + 1] int32. max_seqlen_q: bound on new tokens per request.
        max_kv_len: bound on keys per request from shapes (tokens), used to choose splits.
        window_left/window_right: inclusive window, -1 unbounded (causal is right = 0).
        num_splits: force the KV split count (tests, benchmarks); default chosen from shapes.
        scratch: preallocated ``(o_part [>= splits, total_q, Hq, Dv_pad], lse_part [>= splits,
            total_q, Hq])`` float32 (e.g. MLA's workspace); allocated from shapes when None.
        counters: split-KV arrival counters, int32 contiguous, all zero, at least
            ``b * Hkv * cdiv(max_seqlen_q * Hq // Hkv, 16)`` entries (one per program tile;
            BLOCK_M >= 16); left all zero. Reusable by launches that run one after another on
            one stream, never by concurrent ones. ``torch.zeros`` per call when None; unused
            with one split.
        config: force the tile shape (benchmarks). lse: preallocated [Hq, total_q] output.
        k_start: [b] int32 first visible key per request (``cache_leftpad``).
        block_ids: [total_q] int32 bidirectional block id per query token (< 0: none): key j
            has the id of query row ``j - (Lk - Lq)``; same-id keys pass the right bound.
        q_used: [b] int32 used query rows (``seqused_q``): alignment ``Lk - q_used + i``, rows
            past it see no key (output 0, LSE -inf).
    Returns:
        softmax_lse [Hq, total_q] float32 (natural log; -inf for rows with no visible key).
    Raises:
        ValueError: ``counters`` is not int32, not contiguous or has fewer entries than tiles.

    The grid, tile config, split count and scalar arguments depend only on shapes, strides and
    scalars, so they are computed once per call shape (``_launch_params``, cached); the launch
    itself is ``kernel[grid](...)``.
    """
    total_q, num_heads_q = q.shape[0], q.shape[1]
    if lse is None:
        lse = torch.empty((num_heads_q, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0 or cache_seqlens.shape[0] == 0:
        return lse
    extras = (k_start, block_ids, q_used)
    paged = page_table is not None
    params = _launch_params(
        q.device, q.shape, q.stride(), q.dtype, k.shape, k.stride(), v.shape, v.stride(),
        out.stride(), None if qv is None else qv.stride(),
        page_table.stride() if paged else None, paged, cache_seqlens.shape[0], max_seqlen_q,
        max_kv_len, (qv is not None, q_descale is not None, k_descale is not None,
                     v_descale is not None, sinks is not None, *(t is not None for t in extras)),
        softmax_scale, softcap,
        window_left, window_right, num_splits, config,
        None if scratch is None else (scratch[0].stride(), scratch[1].stride()), lse.stride(0),
        _metadata_strides(cache_seqlens, cu_seqlens_q, cu_seqlens_k, page_table, sinks,
                          q_descale, k_descale, v_descale, *extras),
        (q.element_size(), k.element_size(), out.element_size(),
         all(t.data_ptr() % 16 == 0 for t in (q, k, v, out))))
    o_part, lse_part, counters = _split_buffers(params, q, scratch, counters, lse)
    if params.meta["TMA"] and q.device.type == "cuda":
        set_descriptor_allocator()
    launch(_paged_attention_kernel, params.grid, q.device,
           q, k, v, q if qv is None else qv, out, lse, o_part, lse_part, counters,
           cache_seqlens, cache_seqlens if page_table is None else page_table,
           cu_seqlens_q, cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k,
           *(lse if t is None else t for t in (q_descale, k_descale, v_descale, sinks, *extras)),
           *params.scalars, **params.meta)
    return lse


def _metadata_strides(cache_seqlens, cu_seqlens_q, cu_seqlens_k, page_table, sinks, q_descale,
                      k_descale, v_descale, k_start, block_ids, q_used) -> tuple[int, ...]:
    """Strides of the small tensors, in the kernel's order: any view works (a column slice of
    the page table, strided lengths, expanded per-tensor descales and sinks), no copy."""
    def stride(t, dim):
        return 0 if t is None else t.stride(dim)
    return (stride(cache_seqlens, 0), stride(cu_seqlens_q, 0), stride(cu_seqlens_k, 0),
            stride(page_table, 1), stride(sinks, 0), stride(q_descale, 0), stride(q_descale, 1),
            stride(k_descale, 0), stride(k_descale, 1), stride(v_descale, 0),
            stride(v_descale, 1), stride(k_start, 0), stride(block_ids, 0), stride(q_used, 0))


def _split_buffers(params: _LaunchParams, q: Tensor, scratch, counters,
                   dummy: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(o_part, lse_part, counters)`` for the launch's splits: the given buffers, new ones
    (partials uninitialised, counters zero), or ``dummy`` (one split: unused)."""
    splits = params.num_splits
    if splits == 1:
        return dummy, dummy, dummy
    total_q, num_heads_q = q.shape[0], q.shape[1]
    if scratch is None:
        scratch = (torch.empty((splits, total_q, num_heads_q, params.dv_pad),
                               dtype=torch.float32, device=q.device),
                   torch.empty((splits, total_q, num_heads_q), dtype=torch.float32,
                               device=q.device))
    if counters is None:
        counters = torch.zeros(params.num_tiles, dtype=torch.int32, device=q.device)
    elif (counters.dtype != torch.int32 or not counters.is_contiguous()
          or counters.numel() < params.num_tiles):
        raise ValueError(f"paged_attention: counters is {counters.dtype}, "
                         f"{'' if counters.is_contiguous() else 'non-'}contiguous, with "
                         f"{counters.numel()} entries; expected contiguous torch.int32 with at "
                         f"least {params.num_tiles} (one per program tile). Allocate "
                         f"torch.zeros(n, dtype=torch.int32) once and reuse it.")
    return scratch[0], scratch[1], counters


def requested_splits(num_splits: int) -> Optional[int]:
    """The op's ``num_splits`` (0: automatic) as ``paged_attention``'s (None: planned)."""
    return None if num_splits == 0 else num_splits


def supports_attention(q, k, v, out, qv) -> Optional[str]:
    """Why the kernel cannot serve these tensors (shapes/strides only), or ``None``."""
    if q.shape[-1] > 256 or v.shape[-1] > 512:
        return (f"head dims D={q.shape[-1]}, Dv={v.shape[-1]} exceed the kernel's D <= 256, "
                f"Dv <= 512")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("qv", qv)):
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} has a non-unit stride in its last dimension"
    return None


@providers.register("flash_attn_with_kvcache", "triton", available=available,
                    supports=lambda q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q,
                    out, qv, *a, **kw: supports_attention(q, k_cache, v_cache, out, qv))
def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out,
                            qv, q_descale, k_descale, v_descale, sinks, cache_leftpad,
                            bidirectional_block_ids, *, max_seqlen_q, softmax_scale, causal,
                            window_size_left, window_size_right, softcap, num_splits):
    """Triton ``flash_attn_with_kvcache`` (contract: ``xpu_ops/ops/paged_attention.py``).

    ``paged_attention`` in ``PAGED`` mode: FlashAttention-2 online softmax with GQA packing and
    split-KV; ``max_kv_len`` is the page-table capacity in tokens. Writes ``out``, returns the LSE.
    """
    return paged_attention(
        q, k_cache, v_cache, out, cache_seqlens, cu_seqlens_q, page_table=page_table,
        cu_seqlens_k=None, max_seqlen_q=max_seqlen_q,
        max_kv_len=page_table.shape[1] * k_cache.shape[1], qv=qv, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, sinks=sinks, softmax_scale=softmax_scale,
        window_left=window_size_left, window_right=window_size_right, softcap=softcap,
        num_splits=requested_splits(num_splits), k_start=cache_leftpad,
        block_ids=bidirectional_block_ids)
