"""The paged-attention kernels: one Triton program for prefill, extend and decode, two entries.

``_paged_attention_kernel`` computes FlashAttention-2 style online-softmax attention of packed
queries over keys that live either in a paged cache (``PAGED``: key ``j`` of request ``r`` sits in
page ``page_table[r, j // PAGE_SIZE]``, slot ``j % PAGE_SIZE``) or in ragged rows
(``cu_seqlens_k``).

Layout of one program: one request ``r``, one KV head, one tile of ``BLOCK_M`` rows of the packed
M dimension ``m = query_row * G + head_in_group`` (GQA packing: the ``G = Hq / Hkv`` query heads
sharing a KV head share every K/V tile, so a decode step with ``G = 4`` still gives the matrix units
a 16-row tile), and one KV split. The key loop runs only over tiles that some row of the program can
see (causal and sliding window skip whole tiles); partial tiles are masked with ``tl.where``, and
K/V loads past the request's length use ``other=0`` so NaN garbage never enters a product.

Key-tile addressing: in the portable path each key of a tile loads its page id and forms an int64
``page x stride + slot x stride`` offset (any page size). With ``_Config.page_tiles`` (the kernel
path ``page_tiles``, decode's default) and a power-of-two page size, a tile that starts on a
``BLOCK_N`` boundary covers ``BLOCK_N / page_size`` whole pages or lies inside one page, so the
kernel loads one page id per page, multiplies in int64 once per page and adds int32 in-page slot
offsets (``_page_tile_rows``); with power-of-two head dims the K/V loads carry no column mask.

Entries: ``_paged_attention_kernel`` takes every argument (67 runtime, 26 constexprs: any
metadata layout, every feature and kernel path); ``_paged_attention_plain_kernel`` takes the
plain form of a call (a paged cache whose K and V share strides, unit-stride metadata, none of
descales, sinks, qv, leftpad, bidirectional blocks, seqused_q; 15 runtime arguments, 29
constexprs: what is fixed for a layer, the head counts and dims, the q/K/V/out strides, scale,
softcap, window and split floor, is a constexpr) and passes constants for the rest. Triton's
binder costs host time per runtime argument on every launch, so the common call binds less
than a quarter as many. The plain entry's ``LSE`` is None when the caller wants no LSE, and its
scratch and counters are None with one split (constexpr Nones: never read). Both call ``_attend`` at their top level, which Triton inlines.

Kernel paths (``_common.OPTIONAL_PATHS``) are constexprs (``PAGE_TILES``, ``PHASES``, ``TMA``,
``WS``, ``DV_SPLIT``, ``FOLD_SCALE``) that the launcher (``paged_attention.py``) sets where a
launch allows them; the tile math they share lives in ``attention_tiles.py``.

Split-KV: with few (request, KV head) pairs for the machine, the visible key range is cut into
``num_splits`` pieces (each an even share of the program's own visible tiles, at least
``min_split_tiles``: the split count is planned from shapes, the cut from the request's length);
each split program writes an fp32 partial output and its log-sum-exp, and
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

from ._common import HAS_TRITON
from .attention_tiles import (_descriptor_kv, _descriptor_kv_pair, _gather_kv, _interior_tiles,
                              _invalid_pages, _load_tile, _mask_scores, _online_softmax,
                              _online_softmax_pair, _scores)

if HAS_TRITON:
    import triton
    import triton.language as tl

# Tensor descriptors are spelled ``triton.language.make_tensor_descriptor``, not through ``tl``:
# Triton resolves every ``tl.<name>`` a kernel mentions when it hashes the kernel, also in a
# branch a constexpr removes, and Intel's Triton 3.3 (``triton-xpu``) has no such name, so the
# kernel would not compile there at all; names under the ``triton`` package are not resolved by
# that scan. The descriptor branches (``TMA``) are taken only where ``descriptors_supported``.
# For the same compiler, conditions join at most two operands per ``and``/``or`` (Triton 3.3's
# front end rejects ``A and B and C``; parentheses pair them), and ``tl.range``'s
# ``warp_specialize`` keyword appears only in the branch that ``WS`` selects. benchmarks/compile_kernels_xe.py
# compiles every launch for Intel targets to keep both rules.


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


# Sizes that only bound indices (and the LSE head stride, equal to total_q) are not specialised
# on (Triton otherwise compiles one variant per "== 1" and "% 16 == 0" of each); results never
# depend on specialisation, and a new batch size, page count or page-table capacity reuses the
# compiled kernel instead of compiling another (sgl-kernel-xpu's test_flash_mla_decode.py: 356
# compile keys without this, 162 with; a 1/48 sample of its test_flash_attention.py: 87, 52).
_SIZES = ["stride_lse_h", "total_q", "total_k", "num_pages", "max_seqlen_q", "max_kv_len"]


@triton.jit(do_not_specialize=_SIZES)
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
    head_dim_v, min_split_tiles, total_q, total_k, num_pages, max_seqlen_q, max_kv_len,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, HAS_QV: tl.constexpr,
    HAS_Q_DESCALE: tl.constexpr, HAS_K_DESCALE: tl.constexpr, HAS_V_DESCALE: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_K_START: tl.constexpr, HAS_BLOCK_IDS: tl.constexpr,
    HAS_Q_USED: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, PAGE_TILES: tl.constexpr, EVEN_D: tl.constexpr,
    PHASES: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr, GROUP: tl.constexpr,
    DV_SPLIT: tl.constexpr, FOLD_SCALE: tl.constexpr,
):
    # Every feature: any metadata layout, descales, sinks, qv (absorbed MLA), leftpad,
    # bidirectional blocks, seqused_q, ragged K/V, caller scratch, every kernel path.
    _attend(Q, K, V, QV, O, LSE, O_PART, LSE_PART, COUNTERS, CACHE_SEQLENS, PAGE_TABLE, CU_Q,
            CU_K, Q_DESCALE, K_DESCALE, V_DESCALE, SINKS, K_START, BLOCK_IDS, Q_USED, stride_qt,
            stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            stride_qvt, stride_qvh, stride_ot, stride_oh, stride_lse_h, stride_pt_b,
            stride_part_s, stride_part_t, stride_part_h, stride_lsep_s, stride_lsep_t,
            stride_seqlens, stride_cu_q, stride_cu_k, stride_pt_p, stride_sinks, stride_qd_b,
            stride_qd_h, stride_kd_b, stride_kd_h, stride_vd_b, stride_vd_h, stride_k_start,
            stride_block_ids, stride_q_used, softmax_scale, softcap, window_left, window_right,
            group, num_heads_kv, head_dim, head_dim_v, min_split_tiles, total_q, total_k,
            num_pages, max_seqlen_q, max_kv_len, BLOCK_M, BLOCK_N, D_PAD, DV_PAD, PAGE_SIZE,
            PAGED, HAS_QV, HAS_Q_DESCALE, HAS_K_DESCALE, HAS_V_DESCALE, HAS_SINKS, HAS_K_START,
            HAS_BLOCK_IDS, HAS_Q_USED, USE_SOFTCAP, NUM_SPLITS, PRECISION, UPCAST, PAGE_TILES,
            EVEN_D, PHASES, TMA, WS, GROUP, DV_SPLIT, FOLD_SCALE)


@triton.jit(do_not_specialize=["total_q", "num_pages", "max_seqlen_q", "max_kv_len"])
def _paged_attention_plain_kernel(
    Q, K, V, O, LSE, SCRATCH, COUNTERS, CACHE_SEQLENS, PAGE_TABLE, CU_Q,
    stride_pt_b, total_q, num_pages, max_seqlen_q, max_kv_len,
    STRIDE_QT: tl.constexpr, STRIDE_QH: tl.constexpr, STRIDE_KP: tl.constexpr,
    STRIDE_KS: tl.constexpr, STRIDE_KH: tl.constexpr, STRIDE_OT: tl.constexpr,
    STRIDE_OH: tl.constexpr, SOFTMAX_SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, GROUP_SIZE: tl.constexpr, NUM_HEADS_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PAGE_TILES: tl.constexpr, EVEN_D: tl.constexpr, PHASES: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
):
    # The plain form (most decode and prefill calls): a paged cache whose K and V share strides,
    # unit-stride metadata, none of the rare features, the launcher's scratch: one fp32 buffer,
    # partial outputs [splits, total_q, Hq, DV_PAD] then partial LSEs [splits, total_q, Hq].
    # What is fixed for a layer is a constexpr (model constants, q/K/V/out strides, scale,
    # softcap, window, the split floor) and derivable strides are not passed, so a launch binds
    # 15 runtime arguments (5 of them scalars that change per step) instead of 67. LSE is None
    # when the caller does not want it, SCRATCH and COUNTERS with one split (never read).
    HQ: tl.constexpr = GROUP_SIZE * NUM_HEADS_KV
    part_s = tl.cast(total_q, tl.int64) * (HQ * DV_PAD)  # int64: splits * part_s may pass 2**31
    LSE_PART = SCRATCH
    if NUM_SPLITS > 1:
        LSE_PART = SCRATCH + NUM_SPLITS * part_s
    _attend(Q, K, V, Q, O, LSE, SCRATCH, LSE_PART, COUNTERS,
            CACHE_SEQLENS, PAGE_TABLE, CU_Q, CU_Q, None, None, None, None, None, None, None,
            STRIDE_QT, STRIDE_QH, STRIDE_KP, STRIDE_KS, STRIDE_KH, STRIDE_KP, STRIDE_KS,
            STRIDE_KH, STRIDE_QT, STRIDE_QH, STRIDE_OT, STRIDE_OH, total_q, stride_pt_b, part_s,
            HQ * DV_PAD, DV_PAD, total_q * HQ, HQ, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            SOFTMAX_SCALE, SOFTCAP, WINDOW_LEFT, WINDOW_RIGHT, GROUP_SIZE, NUM_HEADS_KV,
            HEAD_DIM, HEAD_DIM_V, MIN_SPLIT_TILES, total_q, num_pages, num_pages, max_seqlen_q,
            max_kv_len, BLOCK_M, BLOCK_N, D_PAD, DV_PAD, PAGE_SIZE, True, False, False, False,
            False, False, False, False, False, USE_SOFTCAP, NUM_SPLITS, PRECISION, UPCAST,
            PAGE_TILES, EVEN_D, PHASES, False, False, 1, 1, FOLD_SCALE)


@triton.jit
def _attend(
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
    head_dim_v, min_split_tiles, total_q, total_k, num_pages, max_seqlen_q, max_kv_len,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, HAS_QV: tl.constexpr,
    HAS_Q_DESCALE: tl.constexpr, HAS_K_DESCALE: tl.constexpr, HAS_V_DESCALE: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_K_START: tl.constexpr, HAS_BLOCK_IDS: tl.constexpr,
    HAS_Q_USED: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, PAGE_TILES: tl.constexpr, EVEN_D: tl.constexpr,
    PHASES: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr, GROUP: tl.constexpr,
    DV_SPLIT: tl.constexpr, FOLD_SCALE: tl.constexpr,
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
        # a negative leftpad reads as 0 (never a key before position 0), API.md
        k_start = tl.maximum(tl.load(K_START + req * stride_k_start), 0)
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
    n_work = 1
    if NUM_SPLITS > 1:
        blk_lo, blk_hi, n_work = _split_range(blk_lo, blk_hi, split, min_split_tiles, BLOCK_N,
                                              NUM_SPLITS)
        if split >= n_work:  # no share of this program's keys: the others cover them
            return
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
        q_desc = triton.language.make_tensor_descriptor(
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
    # fold_scale: plain scores stay raw q.k and the softmax applies k_scale inside its exp2
    # argument (one FMA per score), which needs k_scale > 0: a negative scale flips q's sign
    # instead, a zero one zeroes q (both exact, as the product by the scale was).
    FOLD: tl.constexpr = (FOLD_SCALE and not HAS_QV) and not USE_SOFTCAP
    if FOLD:
        q = (q * tl.where(k_scale > 0, 1.0, tl.where(k_scale < 0, -1.0, 0.0))).to(q.dtype)
        k_scale = tl.where(k_scale == 0, 1.0, tl.abs(k_scale))

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
                        softcap, HAS_QV, USE_SOFTCAP, PRECISION, FOLD)
            if (start_n < full_lo) | (start_n + BLOCK_N > full_hi) | (pages_ok == 0):
                s = _mask_scores(s, offs_n, mask_n, lo_row, hi_row, blocks, BLOCK_IDS, q_start,
                                 kv_len, q_len, stride_block_ids, HAS_BLOCK_IDS)
            if DV_SPLIT > 1:  # this program's columns of the tile (cache lines just loaded)
                v = _load_tile(v_head + v_rows[:, None] + offs_dc[None, :], mask_n, mask_dc,
                               True, EVEN_D)
            acc, m_i, l_i = _online_softmax(s, v.to(compute_dtype), acc, m_i, l_i, k_scale,
                                            PRECISION, FOLD, True)
    else:  # unmasked interior tiles, then the masked edge tiles before and after them
        mid_lo, mid_hi = _interior_tiles(blk_lo, blk_hi, full_lo, full_hi, BLOCK_N)
        if PAGED:
            if _invalid_pages(pt_row, mid_lo, mid_hi, num_pages, stride_pt_p, PAGE_SIZE) > 0:
                mid_hi = mid_lo
        k_desc, v_desc = K, V  # unused without TMA
        if TMA:
            k_desc, v_desc = _kv_descriptors(K, V, num_pages, total_k, num_heads_kv, head_dim,
                                             head_dim_v, stride_kp, stride_ks, stride_kh,
                                             stride_vp, stride_vs, stride_vh, BLOCK_N, D_PAD,
                                             DV_PAD, PAGE_SIZE, PAGED)
        # warp_specialize only where WS: Intel's Triton 3.3 has no such keyword of tl.range
        if WS:
            for start_n in tl.range(mid_lo, mid_hi, BLOCK_N, warp_specialize=True):
                acc, m_i, l_i = _tile_step(
                    acc, m_i, l_i, q, qv, start_n, blk_hi, k_start, kv_start, kv_head, k_desc,
                    v_desc, k_head, v_head, pt_row, offs_d, offs_dv, mask_d, mask_dv, lo_row,
                    hi_row, blocks, BLOCK_IDS, q_start, kv_len, q_len, k_scale, qv_scale, softcap,
                    num_pages, stride_pt_p, stride_kp, stride_ks, stride_vp, stride_vs,
                    stride_block_ids, BLOCK_N, D_PAD, DV_PAD, PAGE_SIZE, PAGED, PAGE_TILES, EVEN_D,
                    TMA, False, HAS_QV, HAS_BLOCK_IDS, USE_SOFTCAP, PRECISION, FOLD)
        else:
            for start_n in tl.range(mid_lo, mid_hi, BLOCK_N):
                acc, m_i, l_i = _tile_step(
                    acc, m_i, l_i, q, qv, start_n, blk_hi, k_start, kv_start, kv_head, k_desc,
                    v_desc, k_head, v_head, pt_row, offs_d, offs_dv, mask_d, mask_dv, lo_row,
                    hi_row, blocks, BLOCK_IDS, q_start, kv_len, q_len, k_scale, qv_scale, softcap,
                    num_pages, stride_pt_p, stride_kp, stride_ks, stride_vp, stride_vs,
                    stride_block_ids, BLOCK_N, D_PAD, DV_PAD, PAGE_SIZE, PAGED, PAGE_TILES, EVEN_D,
                    TMA, False, HAS_QV, HAS_BLOCK_IDS, USE_SOFTCAP, PRECISION, FOLD)
        # Descriptor tiles of two pages: the masked edge tiles take one page each (per-page
        # gathers of two pages lose the rows' contiguity: scalar loads and spills on sm_90),
        # so every score tile has one shape.
        EDGE_N: tl.constexpr = PAGE_SIZE if (TMA and PAGED) and BLOCK_N > PAGE_SIZE else BLOCK_N
        for edge in tl.static_range(2):
            if edge == 0:
                lo = blk_lo
                hi = mid_lo
            else:
                lo = mid_hi
                hi = blk_hi
            for start_n in range(lo, hi, EDGE_N):
                acc, m_i, l_i = _tile_step(
                    acc, m_i, l_i, q, qv, start_n, blk_hi, k_start, kv_start, kv_head, k_desc,
                    v_desc, k_head, v_head, pt_row, offs_d, offs_dv, mask_d, mask_dv, lo_row,
                    hi_row, blocks, BLOCK_IDS, q_start, kv_len, q_len, k_scale, qv_scale,
                    softcap, num_pages, stride_pt_p, stride_kp, stride_ks, stride_vp, stride_vs,
                    stride_block_ids, EDGE_N, D_PAD, DV_PAD, PAGE_SIZE, PAGED, PAGE_TILES,
                    EVEN_D, TMA, True, HAS_QV, HAS_BLOCK_IDS, USE_SOFTCAP, PRECISION, FOLD)

    # ---- epilogue: normalise, write out (or this split's partial) and the LSE ----
    # The only split with keys for these rows writes the result itself. With one split that is
    # decided at compile time, so the split branch (scratch, counters: None then) is not built.
    if NUM_SPLITS == 1:
        _store_output(O, LSE, SINKS, acc, m_i, l_i, v_descale, tok, head, mask_m, offs_dc,
                      mask_dc, q_start, q_len, kv_head, row_first, head_dim_v, stride_sinks,
                      stride_ot, stride_oh, stride_lse_h, BLOCK_M, DV_PAD, GROUP, HAS_SINKS, TMA)
    elif n_work == 1:
        _store_output(O, LSE, SINKS, acc, m_i, l_i, v_descale, tok, head, mask_m, offs_dc,
                      mask_dc, q_start, q_len, kv_head, row_first, head_dim_v, stride_sinks,
                      stride_ot, stride_oh, stride_lse_h, BLOCK_M, DV_PAD, GROUP, HAS_SINKS, TMA)
    else:
        has_keys = l_i > 0
        out = acc * (v_descale / tl.where(has_keys, l_i, 1.0))[:, None]
        lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2_C,
                       float("-inf"))
        part = O_PART + split.to(tl.int64) * stride_part_s
        # rows without a key here weigh 0 in the merge, which never reads their partial output
        tl.store(part + tok[:, None] * stride_part_t + head[:, None] * stride_part_h
                 + offs_dc[None, :], out, mask=(mask_m & has_keys)[:, None] & mask_dc[None, :])
        tl.store(LSE_PART + split.to(tl.int64) * stride_lsep_s + tok * stride_lsep_t + head,
                 lse, mask=mask_m)
        # ---- split-KV reduction: the tile's last working split to arrive merges them all ----
        # The barrier orders every thread's partial stores before the counter update; acq_rel at
        # gpu scope releases them to, and acquires the other splits' for, the last arrival.
        tl.debug_barrier()
        counter = COUNTERS + pid_bh * tl.num_programs(0) + pid_m * DV_SPLIT + chunk
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == n_work - 1:
            _merge_splits_tile(O_PART, LSE_PART, O, LSE, SINKS, tok, head, mask_m, head_dim_v,
                               chunk * DV_W, n_work, stride_sinks,
                               stride_part_s, stride_part_t, stride_part_h,
                               stride_lsep_s, stride_lsep_t, stride_ot, stride_oh, stride_lse_h,
                               BLOCK_M, DV_W, NUM_SPLITS, HAS_SINKS)
            tl.store(counter, 0)  # zero again for the next launch (and graph replay)


@triton.jit
def _split_range(blk_lo, blk_hi, split, min_split_tiles, BLOCK_N: tl.constexpr,
                 NUM_SPLITS: tl.constexpr):
    # Split `split`'s keys of a program's tile range [blk_lo, blk_hi) (blk_lo on a tile
    # boundary): an even share of the range's tiles, at least min_split_tiles (from shapes),
    # and how many splits get keys (>= 1: with none, split 0 writes the empty result). A short
    # range uses only its first splits, a long one spreads over all of them.
    tiles = tl.cdiv(blk_hi - blk_lo, BLOCK_N)
    share = tl.maximum(min_split_tiles, tl.cdiv(tiles, NUM_SPLITS))
    n_work = tl.maximum(tl.minimum(tl.cdiv(tiles, share), NUM_SPLITS), 1)
    lo = blk_lo + split * share * BLOCK_N
    return lo, tl.minimum(blk_hi, lo + share * BLOCK_N), n_work


@triton.jit
def _store_output(O, LSE, SINKS, acc, m_i, l_i, v_descale, tok, head, mask_m, offs_dc, mask_dc,
                  q_start, q_len, kv_head, row_first, head_dim_v, stride_sinks, stride_ot,
                  stride_oh, stride_lse_h, BLOCK_M: tl.constexpr, DV_PAD: tl.constexpr,
                  GROUP: tl.constexpr, HAS_SINKS: tl.constexpr, TMA: tl.constexpr):
    # Normalise the accumulator (the sinks join the softmax sum here) and write out and the LSE
    # (natural log; -inf for rows without a key or sink).
    LOG2E_C: tl.constexpr = 1.4426950408889634
    LN2_C: tl.constexpr = 0.6931471805599453
    if HAS_SINKS:
        sink = tl.load(SINKS + head * stride_sinks, mask=mask_m, other=0.0) * LOG2E_C
        # a +inf sink takes the whole softmax (out 0, LSE +inf; set below), as -inf takes none
        sink_inf = sink == float("inf")
        sink = tl.where(sink_inf, float("-inf"), sink)
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
    if HAS_SINKS:
        out = tl.where(sink_inf[:, None], 0.0, out)
        lse = tl.where(sink_inf, float("inf"), lse)
    if TMA:  # rows past the request's q_len fall outside the box: not written
        o_desc = triton.language.make_tensor_descriptor(
            O + q_start.to(tl.int64) * stride_ot + (kv_head * GROUP).to(tl.int64) * stride_oh,
            shape=[q_len, GROUP, head_dim_v], strides=[stride_ot, stride_oh, 1],
            block_shape=[BLOCK_M // GROUP, GROUP, DV_PAD])
        o_desc.store([row_first, 0, 0],
                     out.to(O.dtype.element_ty).reshape([BLOCK_M // GROUP, GROUP, DV_PAD]))
    else:
        tl.store(O + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_dc[None, :],
                 out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_dc[None, :])
    if LSE is not None:  # None: the caller does not want it
        tl.store(LSE + head.to(tl.int64) * stride_lse_h + tok, lse, mask=mask_m)


@triton.jit
def _tile_step(acc, m_i, l_i, q, qv, start_n, blk_hi, k_start, kv_start, kv_head, k_desc, v_desc,
               k_head, v_head, pt_row, offs_d, offs_dv, mask_d, mask_dv, lo_row, hi_row, blocks,
               BLOCK_IDS, q_start, kv_len, q_len, k_scale, qv_scale, softcap, num_pages,
               stride_pt_p, stride_kp, stride_ks, stride_vp, stride_vs, stride_block_ids,
               BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
               PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, PAGE_TILES: tl.constexpr,
               EVEN_D: tl.constexpr, TMA: tl.constexpr, MASKED: tl.constexpr,
               HAS_QV: tl.constexpr, HAS_BLOCK_IDS: tl.constexpr, USE_SOFTCAP: tl.constexpr,
               PRECISION: tl.constexpr, FOLD: tl.constexpr):
    # One key tile of the three-phase schedule into (acc, max, sum). Edge tiles (MASKED):
    # predicated gather and every mask. Interior tiles: every row sees every key, so no mask;
    # K/V through tensor descriptors (TMA: one box, or with BLOCK_N = 2 x PAGE_SIZE one box
    # per page of the tile, softmax-updated together) or unpredicated gathers.
    if (TMA and not MASKED) and (PAGED and BLOCK_N > PAGE_SIZE):
        k0, k1, v0, v1 = _descriptor_kv_pair(k_desc, v_desc, pt_row, start_n, kv_head,
                                             stride_pt_p, D_PAD, DV_PAD, PAGE_SIZE)
        k0, k1, v0, v1 = k0.to(q.dtype), k1.to(q.dtype), v0.to(q.dtype), v1.to(q.dtype)
        s0 = _scores(q, qv, k0, v0, k_scale, qv_scale, softcap, HAS_QV, USE_SOFTCAP, PRECISION,
                     FOLD)
        s1 = _scores(q, qv, k1, v1, k_scale, qv_scale, softcap, HAS_QV, USE_SOFTCAP, PRECISION,
                     FOLD)
        acc, m_i, l_i = _online_softmax_pair(s0, s1, v0, v1, acc, m_i, l_i, k_scale, PRECISION,
                                             FOLD)
    else:
        if TMA and not MASKED:
            k, v = _descriptor_kv(k_desc, v_desc, pt_row, start_n, kv_start, kv_head,
                                  stride_pt_p, BLOCK_N, D_PAD, DV_PAD, PAGE_SIZE, PAGED)
        else:
            k, v, v_rows, offs_n, mask_n, pages_ok = _gather_kv(
                k_head, v_head, pt_row, start_n, blk_hi, k_start, kv_start, offs_d, offs_dv,
                mask_d, mask_dv, num_pages, stride_pt_p, stride_kp, stride_ks, stride_vp,
                stride_vs, BLOCK_N, PAGE_SIZE, PAGED, PAGE_TILES, EVEN_D, MASKED)
        k, v = k.to(q.dtype), v.to(q.dtype)
        s = _scores(q, qv, k, v, k_scale, qv_scale, softcap, HAS_QV, USE_SOFTCAP, PRECISION,
                    FOLD)
        if MASKED:
            s = _mask_scores(s, offs_n, mask_n, lo_row, hi_row, blocks, BLOCK_IDS, q_start,
                             kv_len, q_len, stride_block_ids, HAS_BLOCK_IDS)
        acc, m_i, l_i = _online_softmax(s, v, acc, m_i, l_i, k_scale, PRECISION, FOLD, MASKED)
    return acc, m_i, l_i


@triton.jit
def _kv_descriptors(K, V, num_pages, total_k, num_heads_kv, head_dim, head_dim_v, stride_kp,
                    stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, BLOCK_N: tl.constexpr,
                    D_PAD: tl.constexpr, DV_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    PAGED: tl.constexpr):
    # K/V tensor descriptors: a [1, min(BLOCK_N, page_size), 1, D] box of [num_pages,
    # page_size, Hkv, D] (paged; BLOCK_N <= 2 x page_size: a tile of two pages takes two
    # boxes), or a [BLOCK_N, 1, D] box of ragged [total_k, Hkv, D].
    if PAGED:
        BOX_N: tl.constexpr = BLOCK_N if BLOCK_N <= PAGE_SIZE else PAGE_SIZE
        k_desc = triton.language.make_tensor_descriptor(
            K, shape=[num_pages, PAGE_SIZE, num_heads_kv, head_dim],
            strides=[stride_kp, stride_ks, stride_kh, 1], block_shape=[1, BOX_N, 1, D_PAD])
        v_desc = triton.language.make_tensor_descriptor(
            V, shape=[num_pages, PAGE_SIZE, num_heads_kv, head_dim_v],
            strides=[stride_vp, stride_vs, stride_vh, 1], block_shape=[1, BOX_N, 1, DV_PAD])
    else:
        k_desc = triton.language.make_tensor_descriptor(
            K, shape=[total_k, num_heads_kv, head_dim], strides=[stride_ks, stride_kh, 1],
            block_shape=[BLOCK_N, 1, D_PAD])
        v_desc = triton.language.make_tensor_descriptor(
            V, shape=[total_k, num_heads_kv, head_dim_v], strides=[stride_vs, stride_vh, 1],
            block_shape=[BLOCK_N, 1, DV_PAD])
    return k_desc, v_desc


@triton.jit
def _merge_splits_tile(
    O_PART, LSE_PART, O, LSE, SINKS, tok, head, mask_m, head_dim_v, col0, n_work, stride_sinks,
    stride_part_s, stride_part_t, stride_part_h, stride_lsep_s, stride_lsep_t,
    stride_ot, stride_oh, stride_lse_h,
    BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # BLOCK_M rows, output columns [col0, col0 + WIDTH): out = sum_s e^{lse_s - m} o_s /
    # (sum_s e^{lse_s - m} [+ e^{sink - m}]) over the n_work splits that got keys, summed in
    # order 0..n_work-1 whichever program merges (deterministic). Loads bypass L1 (.cg): other multiprocessors
    # wrote the partials during this launch. The split loops are unrolled, so the loads of all
    # splits are in flight together instead of one L2 round trip per split and pass.
    LOG2E_C: tl.constexpr = 1.4426950408889634
    LN2_C: tl.constexpr = 0.6931471805599453
    DV_CHUNK: tl.constexpr = 64 if WIDTH > 64 else WIDTH  # bounds registers for MLA's Dv 512
    # Pointers advance by one split per iteration (no int32 split x stride products). One pass
    # gives the running max and the sum rescaled to it (empty splits, lse -inf, weigh 0).
    lse_rows = LSE_PART + tok * stride_lsep_t + head
    lse_s = lse_rows
    # compared after the broadcast (the interpreter stores a scalar's bool as int32)
    n_work_m = tl.broadcast_to(n_work, [BLOCK_M])
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    sink_inf = m == float("inf")
    if HAS_SINKS:
        m = tl.load(SINKS + head * stride_sinks, mask=mask_m, other=0.0) * LOG2E_C
        sink_inf = m == float("inf")  # takes the whole softmax: out 0, LSE +inf (below)
        m = tl.where(sink_inf, float("-inf"), m)
    den = tl.where(m == float("-inf"), 0.0, 1.0)  # the sink's own term, e^(sink - m)
    for s in tl.static_range(NUM_SPLITS):
        lse2 = tl.load(lse_s, mask=mask_m & (n_work_m > s), other=float("-inf"),
                       cache_modifier=".cg") * LOG2E_C
        m_new = tl.maximum(m, lse2)
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        den = den * tl.exp2(m - m_new_safe) + tl.exp2(lse2 - m_new_safe)
        m = m_new
        lse_s += stride_lsep_s
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    has_keys = den > 0
    inv_den = tl.where(sink_inf, 0.0, 1.0 / tl.where(has_keys, den, 1.0))
    lse = tl.where(has_keys, (m_safe + tl.log2(tl.where(has_keys, den, 1.0))) * LN2_C,
                   float("-inf"))
    lse = tl.where(sink_inf, float("inf"), lse)
    if LSE is not None:
        tl.store(LSE + head.to(tl.int64) * stride_lse_h + tok, lse, mask=mask_m)
    o_rows = O_PART + tok[:, None] * stride_part_t + head[:, None] * stride_part_h
    out_rows = O + tok[:, None] * stride_ot + head[:, None] * stride_oh
    for dv_start in tl.static_range(0, WIDTH, DV_CHUNK):
        offs_dv = col0 + dv_start + tl.arange(0, DV_CHUNK)
        mask_dv = offs_dv < head_dim_v
        acc = tl.zeros([BLOCK_M, DV_CHUNK], tl.float32)
        lse_s = lse_rows
        o_s = o_rows + offs_dv[None, :]
        for s in tl.static_range(NUM_SPLITS):
            w = tl.exp2(tl.load(lse_s, mask=mask_m & (n_work_m > s), other=float("-inf"),
                                cache_modifier=".cg") * LOG2E_C - m_safe)
            o = tl.load(o_s, mask=(mask_m & (w > 0))[:, None] & mask_dv[None, :], other=0.0,
                        cache_modifier=".cg")
            acc += o * w[:, None]
            lse_s += stride_lsep_s
            o_s += stride_part_s
        tl.store(out_rows + offs_dv[None, :], (acc * inv_den[:, None]).to(O.dtype.element_ty),
                 mask=mask_m[:, None] & mask_dv[None, :])
