"""``apply_rotary_emb``: one program per (token, head), the rotary pairs rotated in float32.

NeoX layout reads the two halves of the rotary features as two vectors; the interleaved layout
reads the even and odd features. Features past ``rotary_dim`` are copied by the same program
(disjoint stores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import provider_table
from ._common import available, launch, next_pow2


@triton.jit
def _apply_rotary_emb_kernel(
    X, COS, SIN, POSITIONS, OUT,
    stride_xt, stride_xh, stride_xd, stride_ct, stride_st, stride_p, stride_ot, stride_oh,
    head_dim, half, seqlen_ro,
    HALF_PAD: tl.constexpr, D_PAD: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    x_row = X + tok * stride_xt + head * stride_xh
    o_row = OUT + tok * stride_ot + head * stride_oh
    pos = tl.minimum(tl.maximum(tl.load(POSITIONS + tok * stride_p), 0), seqlen_ro - 1)
    pos = pos.to(tl.int64)

    # ---- features past rotary_dim pass through; the rotary pairs are rotated ----
    offs_d = tl.arange(0, D_PAD)
    mask_d = (offs_d >= 2 * half) & (offs_d < head_dim)
    tl.store(o_row + offs_d, tl.load(x_row + offs_d * stride_xd, mask=mask_d), mask=mask_d)
    offs_i = tl.arange(0, HALF_PAD)
    mask_i = offs_i < half
    c = tl.load(COS + pos * stride_ct + offs_i, mask=mask_i, other=1.0).to(tl.float32)
    s = tl.load(SIN + pos * stride_st + offs_i, mask=mask_i, other=0.0).to(tl.float32)
    if INTERLEAVED:
        first, second = 2 * offs_i, 2 * offs_i + 1
    else:
        first, second = offs_i, offs_i + half
    x1 = tl.load(x_row + first * stride_xd, mask=mask_i, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second * stride_xd, mask=mask_i, other=0.0).to(tl.float32)
    tl.store(o_row + first, (x1 * c - x2 * s).to(OUT.dtype.element_ty), mask=mask_i)
    tl.store(o_row + second, (x1 * s + x2 * c).to(OUT.dtype.element_ty), mask=mask_i)


@provider_table.register("apply_rotary_emb", "triton", available=available)
def apply_rotary_emb(x, cos, sin, positions, *, interleaved):
    """Triton ``apply_rotary_emb`` (contract: ``xpu_ops/ops/rotary.py``).

    Grid (N, H); x and positions are read through their strides, cos/sin rows need unit
    stride in their last dimension (made contiguous otherwise). Returns a new contiguous tensor.
    """
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    num_tokens, num_heads, head_dim = x.shape
    half = cos.shape[1]
    if num_tokens == 0 or num_heads == 0:
        return out
    if half == 0 or cos.shape[0] == 0:
        return out.copy_(x)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    launch(_apply_rotary_emb_kernel, (num_tokens, num_heads), x.device, x, cos, sin, positions,
           out, x.stride(0), x.stride(1), x.stride(2), cos.stride(0), sin.stride(0),
           positions.stride(0), out.stride(0), out.stride(1), head_dim, half, cos.shape[0],
           HALF_PAD=max(2, next_pow2(half)), D_PAD=max(2, next_pow2(head_dim)),
           INTERLEAVED=bool(interleaved), num_warps=1)
    return out
