"""DSA indexer logits: ``fp8_mqa_logits`` (ragged keys) and ``fp8_paged_mqa_logits`` (the
fused paged index-key cache, ``xpu_ops.index_k_layout``).

Both kernels score one tile of ``BLOCK_N`` keys against several query rows: the tile is loaded
once (fp8 -> fp16, exact) and each row's ``[H, D] x [D, BLOCK_N]`` product runs on the tensor
cores with float32 accumulation; then ``scale_j``, ReLU and the weighted sum over heads. The
ragged kernel walks ``BLOCK_M`` consecutive queries per program (a prefill's neighbours share
their key ranges); the paged kernel walks the ``next_n`` queries of one request (they share its
block table). Out-of-range positions are written ``-inf``; tiles wholly outside every row's
range skip the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import provider_table
from ..index_k_layout import is_dense_blocks
from ._common import available, cdiv, launch, next_pow2

_BLOCK_N = 64
_BLOCK_M = 4
PAGED_WARPS = 8     # the key tile stays in registers across the next_n queries (no spills)


@triton.jit
def _weighted_relu(q_ptrs, mask_q, k, scale, w):
    # sum_h w[h] * relu(scale_j * (q[h] . k_j)): [BLOCK_H, BLOCK_D] x [BLOCK_N, BLOCK_D]^T
    q = tl.load(q_ptrs, mask=mask_q, other=0.0).to(tl.float16)
    dots = tl.dot(q, tl.trans(k), out_dtype=tl.float32)                 # [BLOCK_H, BLOCK_N]
    relu = tl.maximum(dots * scale[None, :], 0.0)
    return tl.sum(relu * w[:, None], axis=0)                            # [BLOCK_N]


@triton.jit
def _mqa_logits_kernel(
    Q, K, K_SCALE, W, KS, KE, OUT,
    stride_qs, stride_qh, stride_ks, stride_kscale, stride_ws, stride_wh, stride_kss, stride_kes,
    stride_os, seq_len, seq_len_kv, num_heads, head_dim, width,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    COMPRESSED: tl.constexpr,
):
    first = tl.program_id(0) * BLOCK_M
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    mask_q = (offs_h[:, None] < num_heads) & mask_d[None, :]
    for m in range(BLOCK_M):
        row = first + m
        if row < seq_len:
            ks = tl.load(KS + row * stride_kss)
            ke = tl.load(KE + row * stride_kes)
            lo = tl.minimum(tl.maximum(ks, 0), seq_len_kv)
            hi = tl.minimum(tl.maximum(ke, 0), seq_len_kv)
            if COMPRESSED:
                key = ks.to(tl.int64) + cols
            else:
                key = cols.to(tl.int64)
            inside = (key >= lo) & (key < hi) & (cols < width)
            logits = tl.full([BLOCK_N], float("-inf"), tl.float32)
            if tl.sum(inside.to(tl.int32)) > 0:
                safe = tl.where(inside, key, 0)
                k = tl.load(K + safe[:, None] * stride_ks + offs_d[None, :],
                            mask=inside[:, None] & mask_d[None, :], other=0.0).to(tl.float16)
                scale = tl.load(K_SCALE + safe * stride_kscale, mask=inside, other=0.0)
                w = tl.load(W + row * stride_ws + offs_h * stride_wh, mask=offs_h < num_heads,
                            other=0.0)
                q_ptrs = Q + row.to(tl.int64) * stride_qs + offs_h[:, None] * stride_qh \
                    + offs_d[None, :]
                logits = tl.where(inside, _weighted_relu(q_ptrs, mask_q, k, scale, w), logits)
            tl.store(OUT + row.to(tl.int64) * stride_os + cols, logits, mask=cols < width)


def _block_h(num_heads: int) -> int:
    return max(16, next_pow2(num_heads))


def fp8_mqa_logits(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits,
                   max_seqlen_k):
    """Launch ``_mqa_logits_kernel`` over ``[seq_len / BLOCK_M, width / BLOCK_N]`` programs;
    q and k need unit stride in D (``_supports_mqa``)."""
    seq_len, num_heads, head_dim = q.shape
    seq_len_kv = k.shape[0]
    width = max_seqlen_k if max_seqlen_k > 0 else seq_len_kv
    out = torch.empty((seq_len, width), dtype=torch.float32, device=q.device)
    if seq_len == 0 or width == 0:
        return out
    launch(_mqa_logits_kernel, (cdiv(seq_len, _BLOCK_M), cdiv(width, _BLOCK_N)), q.device,
           q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out,
           q.stride(0), q.stride(1), k.stride(0), k_scale.stride(0), weights.stride(0),
           weights.stride(1), cu_seqlen_ks.stride(0), cu_seqlen_ke.stride(0), out.stride(0),
           seq_len, seq_len_kv, num_heads, head_dim, width,
           BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_H=_block_h(num_heads),
           BLOCK_D=max(16, next_pow2(head_dim)), COMPRESSED=max_seqlen_k > 0, num_warps=4)
    return out


@triton.jit
def _paged_mqa_logits_kernel(
    Q, VALUES, SCALES, W, CTX, TABLE, OUT,
    stride_qb, stride_qn, stride_qh, stride_blk, stride_ws, stride_wh, stride_cb, stride_cn,
    stride_tb, stride_tc, stride_or,
    next_n, num_heads, head_dim, num_blocks, table_width, width,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, CTX_2D: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    mask_q = (offs_h[:, None] < num_heads) & mask_d[None, :]
    capacity = tl.minimum(table_width * BLOCK_SIZE, width)
    # The request's longest row of keys: nothing past it is read (it may be garbage).
    if CTX_2D:
        longest = tl.load(CTX + req * stride_cb)
        for n in range(1, next_n):
            longest = tl.maximum(longest, tl.load(CTX + req * stride_cb + n * stride_cn))
    else:
        longest = tl.load(CTX + req * stride_cb)
    longest = tl.minimum(tl.maximum(longest, 0), capacity)
    # Keys of this tile: position -> block table entry -> block id (int64 byte offsets).
    col = pos // BLOCK_SIZE
    in_table = (col < table_width) & (pos < longest)
    blk = tl.load(TABLE + req * stride_tb + col * stride_tc, mask=in_table, other=-1)
    ok = in_table & (blk >= 0) & (blk < num_blocks)
    base = tl.where(ok, blk, 0).to(tl.int64) * stride_blk
    row_in_block = pos % BLOCK_SIZE
    k = tl.load(VALUES + base[:, None] + row_in_block[:, None] * head_dim + offs_d[None, :],
                mask=ok[:, None] & mask_d[None, :], other=0.0).to(tl.float16)
    scale = tl.load(SCALES + (base + BLOCK_SIZE * head_dim + row_in_block * 4) // 4, mask=ok,
                    other=0.0)
    for n in range(next_n):
        if CTX_2D:
            visible = tl.load(CTX + req * stride_cb + n * stride_cn)
        else:
            visible = tl.load(CTX + req * stride_cb) - next_n + n + 1
        visible = tl.minimum(tl.maximum(visible, 0), capacity)
        keep = ok & (pos < visible)
        row = req * next_n + n
        logits = tl.full([BLOCK_N], float("-inf"), tl.float32)
        if tl.sum(keep.to(tl.int32)) > 0:
            w = tl.load(W + row * stride_ws + offs_h * stride_wh, mask=offs_h < num_heads,
                        other=0.0)
            q_ptrs = Q + req * stride_qb + n * stride_qn + offs_h[:, None] * stride_qh \
                + offs_d[None, :]
            logits = tl.where(keep, _weighted_relu(q_ptrs, mask_q, k, scale, w), logits)
        tl.store(OUT + row * stride_or + pos, logits, mask=pos < width)


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len,
                         clean_logits):
    """Launch ``_paged_mqa_logits_kernel`` over ``[b, max_context_len / BLOCK_N]`` programs. A
    cache whose blocks are not dense bytes (a strided view) is copied first."""
    batch, next_n, num_heads, head_dim = q.shape
    out = torch.empty((batch * next_n, max_context_len), dtype=torch.float32, device=q.device)
    if batch * next_n == 0 or max_context_len == 0:
        return out
    if not is_dense_blocks(kv_cache):
        kv_cache = kv_cache.contiguous()
    ctx = context_lens if context_lens.dim() == 2 else context_lens[:, None]
    launch(_paged_mqa_logits_kernel, (batch, cdiv(max_context_len, _BLOCK_N)), q.device,
           q, kv_cache.view(torch.float8_e4m3fn), kv_cache.view(torch.float32), weights, ctx,
           block_table, out,
           q.stride(0), q.stride(1), q.stride(2), kv_cache.stride(0), weights.stride(0),
           weights.stride(1), ctx.stride(0), ctx.stride(1), block_table.stride(0),
           block_table.stride(1), out.stride(0),
           next_n, num_heads, head_dim, kv_cache.shape[0], block_table.shape[1],
           max_context_len,
           BLOCK_SIZE=kv_cache.shape[1], BLOCK_N=_BLOCK_N, BLOCK_H=_block_h(num_heads),
           BLOCK_D=max(16, next_pow2(head_dim)), CTX_2D=context_lens.dim() == 2,
           num_warps=PAGED_WARPS)
    return out


def declines_strided_rows(**tensors) -> str | None:
    """The reason to decline a call whose named tensors lack unit stride in their last
    dimension (the kernels index it densely), else None."""
    for name, t in tensors.items():
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} has a non-unit stride in its last dimension"
    return None


def _supports_mqa(q, k, *args):
    return declines_strided_rows(q=q, k=k)


def _supports_paged(q, *args):
    return declines_strided_rows(q=q)


provider_table.register("fp8_mqa_logits", "triton", available=available,
                        supports=_supports_mqa)(fp8_mqa_logits)
provider_table.register("fp8_paged_mqa_logits", "triton", available=available,
                        supports=_supports_paged)(fp8_paged_mqa_logits)
