"""``merge_state_v2`` and ``merge_state``: combine two partial attention results by their
log-sum-exp (natural log for v2, base 2 for v1: one kernel, ``BASE2`` picks the exponential)."""

from __future__ import annotations

import triton
import triton.language as tl

from .. import provider_table
from ._common import available, launch, next_pow2


@triton.jit
def _merge_state_kernel(
    V_A, S_A, V_B, S_B, V_OUT, S_OUT,
    stride_va_t, stride_va_h, stride_vb_t, stride_vb_h, stride_vo_t, stride_vo_h,
    stride_sa_t, stride_sa_h, stride_sb_t, stride_sb_h, stride_so_t, stride_so_h, head_dim,
    BLOCK_D: tl.constexpr, BASE2: tl.constexpr,
):
    # One program per (token, head): m = max(s_a, s_b), w = e^{s - m}; an empty side (LSE -inf,
    # or +inf as FlashAttention reports empty rows) gets weight 0 and its values are never read
    # (they may be NaN).
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)  # an [H, N] LSE's head * N may pass 2**31 too
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    s_a = tl.load(S_A + tok * stride_sa_t + head * stride_sa_h)
    s_b = tl.load(S_B + tok * stride_sb_t + head * stride_sb_h)
    s_a = tl.where(s_a == float("inf"), float("-inf"), s_a)
    s_b = tl.where(s_b == float("inf"), float("-inf"), s_b)
    m = tl.maximum(s_a, s_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    if BASE2:   # merge_state (v1): LSEs in log2 units
        w_a = tl.exp2(s_a - m_safe)
        w_b = tl.exp2(s_b - m_safe)
    else:
        w_a = tl.exp(s_a - m_safe)
        w_b = tl.exp(s_b - m_safe)
    zeros = tl.zeros([BLOCK_D], tl.float32)
    v_a = tl.load(V_A + tok * stride_va_t + head * stride_va_h + offs_d,
                  mask=mask_d & (zeros + w_a > 0), other=0.0).to(tl.float32)
    v_b = tl.load(V_B + tok * stride_vb_t + head * stride_vb_h + offs_d,
                  mask=mask_d & (zeros + w_b > 0), other=0.0).to(tl.float32)
    total = w_a + w_b
    merged = (w_a * v_a + w_b * v_b) / tl.where(total > 0, total, 1.0)
    tl.store(V_OUT + tok * stride_vo_t + head * stride_vo_h + offs_d,
             merged.to(V_OUT.dtype.element_ty), mask=mask_d)
    if BASE2:
        s_out = m_safe + tl.log2(total)
    else:
        s_out = m_safe + tl.log(total)
    tl.store(S_OUT + tok * stride_so_t + head * stride_so_h, s_out)


def merge_state(v_a, s_a, v_b, s_b, v_merged, s_merged, base2: bool = False) -> None:
    """Launch ``_merge_state_kernel`` over ``[N, H]``; ``v_* [N, H, D]`` with unit stride in
    ``D``, ``s_* [N, H]`` float32 with any strides (e.g. a transposed ``[H, N]`` LSE); ``base2``:
    the LSEs are in log2 units (``merge_state`` v1)."""
    num_tokens, num_heads, head_dim = v_a.shape
    if num_tokens == 0 or num_heads == 0:
        return
    launch(_merge_state_kernel, (num_tokens, num_heads), v_a.device,
           v_a, s_a, v_b, s_b, v_merged, s_merged,
           v_a.stride(0), v_a.stride(1), v_b.stride(0), v_b.stride(1), v_merged.stride(0),
           v_merged.stride(1), s_a.stride(0), s_a.stride(1), s_b.stride(0), s_b.stride(1),
           s_merged.stride(0), s_merged.stride(1), head_dim,
           BLOCK_D=next_pow2(head_dim), BASE2=base2, num_warps=1 if head_dim <= 128 else 2)


def _supports(v_a, s_a, v_b, s_b, v_merged, s_merged):
    for name, t in (("v_a", v_a), ("v_b", v_b), ("v_merged", v_merged)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} has a non-unit stride in its last dimension"
    return None


provider_table.register("merge_state_v2", "triton", available=available, supports=_supports)(
    merge_state)


@provider_table.register("merge_state", "triton", available=available, supports=_supports)
def merge_state_base2(v_a, s_a, v_b, s_b, v_merged, s_merged) -> None:
    """``merge_state`` (v1, base-2 LSEs): the same kernel with ``BASE2``."""
    merge_state(v_a, s_a, v_b, s_b, v_merged, s_merged, base2=True)
