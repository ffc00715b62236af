"""Tile-level pieces of the paged-attention kernel: K/V tile loads, scores, masks, softmax.

``paged_attention._paged_attention_kernel`` is built from these ``@triton.jit`` functions, so its
key loops (one loop with a per-tile mask decision, or the three-phase schedule below) and its load
mechanisms (per-key gathers, per-page gathers, tensor descriptors) share one implementation of
the math: ``_scores`` (log2-domain scores, softcap), ``_mask_scores`` (length, leftpad, causal,
window, bidirectional blocks, hidden pages) and ``_online_softmax`` (FlashAttention-2's running
max and sum, arXiv 2307.08691).

Three-phase schedule (``PHASES``): the key tiles of a program are cut into masked edge tiles
before and after an interior run that every row sees in full (``_interior_tiles``); interior
tiles load K/V without predicates (or through tensor descriptors, ``TMA``) and skip the mask, so
the steady-state loop has no branch. Interior tiles require valid page ids: a program whose
interior holds an id outside ``[0, num_pages)`` masks every tile instead (``_invalid_pages``).

XPU: Intel's Triton has no TMA; its backend lowers tensor descriptors and block pointers to the
Xe 2-D block loads instead, and its own attention benchmarks use descriptors. So the configuration
to start from there is the descriptor path (``tma``, which the capability check selects only on
CUDA today) with ``page_tiles``, prefill tiles of BLOCK_M 64 x BLOCK_N 64 (a 64-key page per K/V
tile), 8 warps, 2 stages and the 256-register GRF mode (``grf_mode="256"``, a launch option of
Intel's backend), and decode tiles of BLOCK_M 16 x BLOCK_N 64 with 4 warps. None of it is
measured here.
"""

from __future__ import annotations

from ._common import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl


@triton.jit
def _tanh(x):
    # tanh from exp2 (portable: no libdevice), accurate for every |x|: (1 - e) / (1 + e) with
    # e = exp(-2|x|) cancels for small |x|, where the odd Taylor series to x^9 is exact in
    # float32 (|x| < 1/4: next term < 1e-8 relative), so a huge softcap tends to no cap.
    LOG2E_C: tl.constexpr = 1.4426950408889634
    a = tl.abs(x)
    e = tl.exp2(-2.0 * LOG2E_C * a)
    t_far = (1.0 - e) / (1.0 + e)
    a2 = a * a
    t_near = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0
                                                                  + a2 * (62.0 / 2835.0)))))
    t = tl.where(a < 0.25, t_near, t_far)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _key_rows(pt_row, offs_n, mask_n, num_pages, stride_pt_p, stride_kp, stride_ks, stride_vp,
              stride_vs, PAGE_SIZE: tl.constexpr):
    # K/V row offsets of keys offs_n, one page-table load and int64 page x stride per key (any
    # page size). A page id outside [0, num_pages) (inconsistent metadata) hides its keys.
    page = tl.load(pt_row + (offs_n // PAGE_SIZE) * stride_pt_p, mask=mask_n, other=0)
    key_ok = (page >= 0) & (page < num_pages)
    page = tl.where(key_ok, page, 0).to(tl.int64)
    slot = (offs_n % PAGE_SIZE).to(tl.int64)
    return page * stride_kp + slot * stride_ks, page * stride_vp + slot * stride_vs, key_ok


@triton.jit
def _page_tile_rows(pt_row, start_n, blk_hi, num_pages, stride_pt_p, stride_kp, stride_ks,
                    stride_vp, stride_vs, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    # The same offsets for a tile that starts on a BLOCK_N boundary, both powers of two: one
    # page-table load per page (the tile covers PAGES whole pages, or lies inside one page),
    # int64 only per page, in-page slot offsets in int32. Pages past blk_hi are not loaded.
    PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE if BLOCK_N > PAGE_SIZE else 1
    SLOTS: tl.constexpr = BLOCK_N // PAGES
    slot = start_n % PAGE_SIZE + tl.arange(0, SLOTS)
    if PAGES == 1:  # start_n < blk_hi <= the table's capacity: its entry exists
        page = tl.load(pt_row + (start_n // PAGE_SIZE) * stride_pt_p)
        # Compared after the broadcast (the interpreter stores a scalar's bool as int32).
        page_v = tl.broadcast_to(page, [BLOCK_N])
        key_ok = (page_v >= 0) & (page_v < num_pages)
        page = tl.where((page >= 0) & (page < num_pages), page, 0).to(tl.int64)
        k_rows = page * stride_kp + slot * stride_ks
        v_rows = page * stride_vp + slot * stride_vs
    else:
        page_idx = start_n // PAGE_SIZE + tl.arange(0, PAGES)
        page = tl.load(pt_row + page_idx * stride_pt_p, mask=page_idx * PAGE_SIZE < blk_hi,
                       other=0)
        page_ok = (page >= 0) & (page < num_pages)
        page = tl.where(page_ok, page, 0).to(tl.int64)
        k_rows = tl.reshape(page[:, None] * stride_kp + (slot * stride_ks)[None, :], [BLOCK_N])
        v_rows = tl.reshape(page[:, None] * stride_vp + (slot * stride_vs)[None, :], [BLOCK_N])
        key_ok = tl.reshape(page_ok[:, None] | (slot < 0)[None, :], [BLOCK_N])
    return k_rows, v_rows, key_ok


@triton.jit
def _load_tile(ptrs, mask_rows, mask_cols, MASK_ROWS: tl.constexpr, EVEN_COLS: tl.constexpr):
    # [rows, cols] tile, 0 where masked. Rows are masked unless MASK_ROWS is off (interior
    # tiles); columns only when the head dim is not the padded one (EVEN_COLS off).
    if MASK_ROWS:
        if EVEN_COLS:
            return tl.load(ptrs, mask=mask_rows[:, None], other=0.0)
        return tl.load(ptrs, mask=mask_rows[:, None] & mask_cols[None, :], other=0.0)
    if EVEN_COLS:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask_cols[None, :], other=0.0)


@triton.jit
def _gather_kv(k_head, v_head, pt_row, start_n, blk_hi, k_start, kv_start, offs_d, offs_dv,
               mask_d, mask_dv, num_pages, stride_pt_p, stride_kp, stride_ks, stride_vp,
               stride_vs, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
               PAGE_TILES: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr):
    # One K and one V tile [BLOCK_N, D|Dv] through pointer gathers, V's row offsets, the key
    # mask (length, leftpad, hidden pages) and whether every page id of the tile was valid.
    # MASKED off (interior tiles: every key valid) drops the row predicates.
    offs_n = start_n + tl.arange(0, BLOCK_N)
    mask_n = (offs_n < blk_hi) & (offs_n >= k_start)  # never load slots before leftpad
    pages_ok = 1
    if PAGED:
        if PAGE_TILES:
            k_rows, v_rows, key_ok = _page_tile_rows(
                pt_row, start_n, blk_hi, num_pages, stride_pt_p, stride_kp, stride_ks,
                stride_vp, stride_vs, BLOCK_N, PAGE_SIZE)
        else:
            k_rows, v_rows, key_ok = _key_rows(
                pt_row, offs_n, mask_n, num_pages, stride_pt_p, stride_kp, stride_ks,
                stride_vp, stride_vs, PAGE_SIZE)
        if MASKED:
            pages_ok = tl.min(key_ok.to(tl.int32), 0)
            mask_n = mask_n & key_ok
    else:
        k_rows = (kv_start + offs_n).to(tl.int64) * stride_ks
        v_rows = (kv_start + offs_n).to(tl.int64) * stride_vs
    k = _load_tile(k_head + k_rows[:, None] + offs_d[None, :], mask_n, mask_d, MASKED, EVEN_D)
    v = _load_tile(v_head + v_rows[:, None] + offs_dv[None, :], mask_n, mask_dv, MASKED, EVEN_D)
    return k, v, v_rows, offs_n, mask_n, pages_ok


@triton.jit
def _descriptor_kv(k_desc, v_desc, pt_row, start_n, kv_start, kv_head, stride_pt_p,
                   BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr):
    # One interior K and V tile through tensor descriptors (TMA on Hopper): paged, the tile
    # lies inside one page (BLOCK_N <= PAGE_SIZE) whose id _invalid_pages checked; ragged, rows
    # kv_start + start_n onwards of [total_k, Hkv, D].
    if PAGED:
        page = tl.load(pt_row + (start_n // PAGE_SIZE) * stride_pt_p)
        slot = start_n % PAGE_SIZE
        k = k_desc.load([page, slot, kv_head, 0]).reshape([BLOCK_N, D_PAD])
        v = v_desc.load([page, slot, kv_head, 0]).reshape([BLOCK_N, DV_PAD])
    else:
        k = k_desc.load([kv_start + start_n, kv_head, 0]).reshape([BLOCK_N, D_PAD])
        v = v_desc.load([kv_start + start_n, kv_head, 0]).reshape([BLOCK_N, DV_PAD])
    return k, v


@triton.jit
def _descriptor_kv_pair(k_desc, v_desc, pt_row, start_n, kv_head, stride_pt_p,
                        D_PAD: tl.constexpr, DV_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr):
    # An interior tile of two whole pages (BLOCK_N = 2 x PAGE_SIZE, start_n on a tile
    # boundary): one descriptor box per page, K and V of each.
    pages = pt_row + (start_n // PAGE_SIZE) * stride_pt_p
    page0 = tl.load(pages)
    page1 = tl.load(pages + stride_pt_p)
    k0 = k_desc.load([page0, 0, kv_head, 0]).reshape([PAGE_SIZE, D_PAD])
    k1 = k_desc.load([page1, 0, kv_head, 0]).reshape([PAGE_SIZE, D_PAD])
    v0 = v_desc.load([page0, 0, kv_head, 0]).reshape([PAGE_SIZE, DV_PAD])
    v1 = v_desc.load([page1, 0, kv_head, 0]).reshape([PAGE_SIZE, DV_PAD])
    return k0, k1, v0, v1


@triton.jit
def _scores(q, qv, k, v, k_scale, qv_scale, softcap, HAS_QV: tl.constexpr,
            USE_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, FOLD: tl.constexpr):
    # [BLOCK_M, BLOCK_N] scores. FOLD (fold_scale, plain scores: no qv, no softcap): raw q.k,
    # _online_softmax multiplies by k_scale inside its exp2 argument (one FMA per score).
    # Otherwise log2-domain scores (k_scale and qv_scale fold softmax_scale, descales and
    # log2(e) unless softcap, which is applied here).
    LOG2E_C: tl.constexpr = 1.4426950408889634
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if HAS_QV:
        s = s * k_scale + tl.dot(qv, tl.trans(v), input_precision=PRECISION) * qv_scale
    elif not FOLD:
        s = s * k_scale
    if USE_SOFTCAP:
        s = softcap * _tanh(s / softcap) * LOG2E_C
    return s


@triton.jit
def _mask_scores(s, offs_n, mask_n, lo_row, hi_row, q_block, BLOCK_IDS, q_start, kv_len, q_len,
                 stride_block_ids, HAS_BLOCK_IDS: tl.constexpr):
    # -inf where row i may not see key j: outside [lo_row[i], hi_row[i]] (unless both carry the
    # same bidirectional block id >= 0; key j has the id of query row j - (kv_len - q_len)),
    # or where the key mask is off (length, leftpad, hidden page).
    right_ok = offs_n[None, :] <= hi_row[:, None]
    if HAS_BLOCK_IDS:
        key_row = offs_n - (kv_len - q_len)
        k_block = tl.load(BLOCK_IDS + (q_start + key_row) * stride_block_ids,
                          mask=mask_n & (key_row >= 0) & (key_row < q_len), other=-1)
        right_ok = right_ok | ((q_block[:, None] >= 0) & (q_block[:, None] == k_block[None, :]))
    visible = (offs_n[None, :] >= lo_row[:, None]) & right_ok & mask_n[None, :]
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _online_softmax(s, v, acc, m_i, l_i, scale, PRECISION: tl.constexpr, FOLD: tl.constexpr,
                    MASKED: tl.constexpr):
    # One key tile into the running (acc, max, sum). FOLD: the log2-domain scores are
    # s * scale with scale >= 0 (the max commutes with it), so s * scale - max is one FMA.
    # MASKED: a row with no visible key so far keeps m = -inf and contributes p = 0; unmasked
    # tiles (every row sees every key: the max is finite) skip that guard.
    if FOLD:
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = m_new
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    if FOLD:
        p = tl.exp2(s * scale - m_safe[:, None])
    else:
        p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _online_softmax_pair(s0, s1, v0, v1, acc, m_i, l_i, scale, PRECISION: tl.constexpr,
                         FOLD: tl.constexpr):
    # Two unmasked key tiles (two pages, each loaded through its own descriptor box) as one:
    # one running-max update and one rescale of the accumulator for both, two P.V products.
    if FOLD:
        m_new = tl.maximum(m_i, tl.maximum(tl.max(s0, 1), tl.max(s1, 1)) * scale)
    else:
        m_new = tl.maximum(m_i, tl.maximum(tl.max(s0, 1), tl.max(s1, 1)))
    alpha = tl.exp2(m_i - m_new)
    if FOLD:
        p0 = tl.exp2(s0 * scale - m_new[:, None])
        p1 = tl.exp2(s1 * scale - m_new[:, None])
    else:
        p0 = tl.exp2(s0 - m_new[:, None])
        p1 = tl.exp2(s1 - m_new[:, None])
    l_i = l_i * alpha + (tl.sum(p0, 1) + tl.sum(p1, 1))
    acc = acc * alpha[:, None]
    acc = tl.dot(p0.to(v0.dtype), v0, acc, input_precision=PRECISION)
    acc = tl.dot(p1.to(v1.dtype), v1, acc, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _interior_tiles(blk_lo, blk_hi, full_lo, full_hi, BLOCK_N: tl.constexpr):
    # [lo, hi): the BLOCK_N-aligned tiles inside [full_lo, full_hi) (every row sees every key),
    # clamped into [blk_lo, blk_hi]; empty (lo == hi) when there is none.
    lo = tl.minimum(tl.maximum((full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N, blk_lo), blk_hi)
    hi = tl.maximum(tl.minimum(full_hi // BLOCK_N * BLOCK_N, blk_hi), lo)
    return lo, hi


@triton.jit
def _invalid_pages(pt_row, lo, hi, num_pages, stride_pt_p, PAGE_SIZE: tl.constexpr):
    # How many page-table entries covering keys [lo, hi) lie outside [0, num_pages).
    CHUNK: tl.constexpr = 64
    bad = 0
    for first in range(lo // PAGE_SIZE, (hi + PAGE_SIZE - 1) // PAGE_SIZE, CHUNK):
        idx = first + tl.arange(0, CHUNK)
        ids = tl.load(pt_row + idx * stride_pt_p, mask=idx * PAGE_SIZE < hi, other=0)
        bad += tl.sum(((ids < 0) | (ids >= num_pages)).to(tl.int32), 0)
    return bad
