"""Gated delta rule in Triton: ``fused_gdn_gating`` and the token recurrence of
``fused_recurrent_gated_delta_rule`` (decode, target verify); the chunked form of extend is in
``gated_delta_rule_chunk.py``.

The recurrence keeps one ``[K, BLOCK_V]`` tile of a value head's state in registers per program
(grid: request x value head x value block) and walks the request's tokens in order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import provider_table
from ._common import available, cdiv, launch, next_pow2
from .causal_conv1d import _both



@triton.jit
def _gdn_gating_kernel(
    A_LOG, A, DT_BIAS, B, G, BETA,
    stride_at, stride_ah, stride_bt, stride_bh, stride_alog, stride_dt, num_heads,
    BLOCK_H: tl.constexpr,
):
    # Grid (T, head blocks): g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) rounded
    # to b's dtype; softplus is x itself above 20 (torch's threshold).
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    a = tl.load(A + t * stride_at + offs_h * stride_ah, mask=mask_h, other=0.0).to(tl.float32)
    bias = tl.load(DT_BIAS + offs_h * stride_dt, mask=mask_h, other=0.0).to(tl.float32)
    a_log = tl.load(A_LOG + offs_h * stride_alog, mask=mask_h, other=0.0).to(tl.float32)
    x = a + bias
    softplus = tl.where(x <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))), x)
    tl.store(G + t * num_heads + offs_h, -tl.exp(a_log) * softplus, mask=mask_h)
    b = tl.load(B + t * stride_bt + offs_h * stride_bh, mask=mask_h, other=0.0)
    beta = tl.sigmoid(b.to(tl.float32)).to(B.dtype.element_ty).to(tl.float32)
    tl.store(BETA + t * num_heads + offs_h, beta, mask=mask_h)


@provider_table.register("fused_gdn_gating", "triton", available=available)
def fused_gdn_gating(A_log, a, dt_bias, b):
    """Triton ``fused_gdn_gating`` (contract: ``xpu_ops/ops/gated_delta_rule.py``)."""
    tokens, heads = a.shape
    g = torch.empty((tokens, heads), dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if tokens == 0 or heads == 0:
        return g, beta
    block_h = min(64, next_pow2(heads))
    launch(_gdn_gating_kernel, (tokens, cdiv(heads, block_h)), a.device, A_log, a, dt_bias, b,
           g, beta, a.stride(0), a.stride(1), b.stride(0), b.stride(1), A_log.stride(0),
           dt_bias.stride(0), heads, BLOCK_H=block_h, num_warps=1)
    return g, beta


@triton.jit
def _load_unit(PTR, mask, USE_L2: tl.constexpr):
    """A q or k row in float32, L2-normalised when ``USE_L2`` (``x / sqrt(sum x^2 + eps)``)."""
    x = tl.load(PTR, mask=mask, other=0.0).to(tl.float32)
    if USE_L2:
        x = x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)
    return x


@triton.jit
def _gdn_recurrent_kernel(
    Q, K, V, G, BETA, O, STATES, SLOTS, CU, INTER,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_gt, stride_gh, stride_bt, stride_bh,
    stride_ss, stride_sh, stride_sk, stride_sv, stride_slot, stride_cu,
    stride_ir, stride_is, stride_ih, stride_ik, stride_iv,
    total, num_slots, num_v_heads, k_dim, v_dim, group, scale, max_steps,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, USE_L2: tl.constexpr,
    STORE_INTER: tl.constexpr, UPDATE_STATE: tl.constexpr,
):
    # Grid (b, Hv, value blocks). S [BLOCK_K, BLOCK_V] float32 in registers; per token:
    # S = e^g S; u = beta (v - S^T k); S += k u^T; o = S^T (scale q).
    r = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < k_dim, offs_v < v_dim
    mask_kv = mask_k[:, None] & mask_v[None, :]
    start = tl.minimum(tl.maximum(tl.load(CU + r * stride_cu), 0), total)
    end = tl.maximum(tl.minimum(tl.maximum(tl.load(CU + (r + 1) * stride_cu), 0), total), start)
    slot = tl.load(SLOTS + r * stride_slot)
    valid = (slot >= 0) & (slot < num_slots)
    state_ptrs = (STATES + tl.where(valid, slot, 0).to(tl.int64) * stride_ss + h * stride_sh
                  + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv)
    S = tl.load(state_ptrs, mask=_both(mask_kv, valid), other=0.0).to(tl.float32)
    kh = h // group
    inter_ptrs = (INTER + r.to(tl.int64) * stride_ir + h * stride_ih
                  + offs_k[:, None] * stride_ik + offs_v[None, :] * stride_iv)
    start64 = start.to(tl.int64)
    for i in range(0, end - start):
        t64 = start64 + i
        q = _load_unit(Q + t64 * stride_qt + kh * stride_qh + offs_k * stride_qd, mask_k, USE_L2)
        k = _load_unit(K + t64 * stride_kt + kh * stride_kh + offs_k * stride_kd, mask_k, USE_L2)
        v = tl.load(V + t64 * stride_vt + h * stride_vh + offs_v * stride_vd, mask=mask_v,
                    other=0.0).to(tl.float32)
        g = tl.load(G + t64 * stride_gt + h * stride_gh)
        beta = tl.load(BETA + t64 * stride_bt + h * stride_bh).to(tl.float32)
        S = S * tl.exp(g)
        u = beta * (v - tl.sum(S * k[:, None], axis=0))
        S = S + k[:, None] * u[None, :]
        o = tl.sum(S * (scale * q)[:, None], axis=0)
        tl.store(O + (t64 * num_v_heads + h) * v_dim + offs_v, o.to(O.dtype.element_ty),
                 mask=mask_v)
        if STORE_INTER:
            step = t64 - start64
            tl.store(inter_ptrs + step * stride_is, S,
                     mask=_both(mask_kv, step < max_steps))
    if UPDATE_STATE:
        tl.store(state_ptrs, S, mask=_both(mask_kv, valid))


def _recurrence(q, k, v, g, beta, scale, ssm_states, cache_indices, cu_seqlens,
                use_qk_l2norm_in_kernel, *, intermediate_states=None, update_state=True):
    """Launch ``_gdn_recurrent_kernel``; returns ``o [T, Hv, V]`` (rows no request covers 0)."""
    total, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1], v.shape[2]
    batch = cache_indices.shape[0]
    out = torch.zeros((total, num_v_heads, v_dim), dtype=v.dtype, device=v.device)
    if batch == 0 or num_v_heads == 0 or v_dim == 0:
        return out
    block_k = max(16, next_pow2(k_dim))
    block_v = max(16, min(next_pow2(v_dim), 8192 // block_k))
    inter = intermediate_states if intermediate_states is not None else ssm_states
    istr = intermediate_states.stride() if intermediate_states is not None else (0,) * 5
    launch(_gdn_recurrent_kernel, (batch, num_v_heads, cdiv(v_dim, block_v)), q.device,
           q, k, v, g, beta, out, ssm_states, cache_indices, cu_seqlens, inter,
           *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(),
           *ssm_states.stride(), cache_indices.stride(0), cu_seqlens.stride(0), *istr, total,
           ssm_states.shape[0], num_v_heads, k_dim, v_dim,
           num_v_heads // num_k_heads, float(scale),
           intermediate_states.shape[1] if intermediate_states is not None else 0,
           BLOCK_K=block_k, BLOCK_V=block_v, USE_L2=bool(use_qk_l2norm_in_kernel),
           STORE_INTER=intermediate_states is not None, UPDATE_STATE=bool(update_state),
           num_warps=4 if block_k * block_v >= 4096 else 1)
    return out


@provider_table.register("fused_recurrent_gated_delta_rule", "triton", available=available)
def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, ssm_states, cache_indices,
                                     cu_seqlens, use_qk_l2norm_in_kernel, intermediate_states,
                                     disable_state_update):
    """Triton ``fused_recurrent_gated_delta_rule`` (contract:
    ``xpu_ops/ops/gated_delta_rule.py``): one launch."""
    return _recurrence(q, k, v, g, beta, scale, ssm_states, cache_indices, cu_seqlens,
                       use_qk_l2norm_in_kernel, intermediate_states=intermediate_states,
                       update_state=not disable_state_update)
