"""``chunk_gated_delta_rule`` in Triton: the chunked (UT) form, one program per
(request, value head, value block) walking the request's chunks in order.

Per chunk of ``BLOCK_T`` tokens with in-chunk cumulative log decay ``G`` and the state ``S``
at its start (``[K, BLOCK_V]`` float32 in registers)::

    A   = strictly-lower(beta_i e^{G_i - G_j} k_i.k_j)        (I + A) U = beta (V - e^G K S)
    O   = e^G (Q S) + ((Q K^T) * e^{G_i - G_j}, j <= i) U
    S   = e^{G_last} S + (e^{G_last - G} K)^T U

``U`` comes from forward substitution over the chunk's rows; every product is a ``tl.dot``
in IEEE float32. Padded rows of the last chunk load as zeros (``beta = 0``, ``g = 0``), so they
add nothing to ``S``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import provider_table
from ._common import available, cdiv, launch, next_pow2
from .causal_conv1d import _both


@triton.jit
def _rows_unit(PTR, mask, USE_L2: tl.constexpr):
    """Rows of q or k in float32, each L2-normalised when ``USE_L2``."""
    x = tl.load(PTR, mask=mask, other=0.0).to(tl.float32)
    if USE_L2:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _solve_unit_lower(A, rhs, BLOCK_T: tl.constexpr):
    """``U`` with ``(I + A) U = rhs``, ``A [BLOCK_T, BLOCK_T]`` strictly lower: row ``i`` is
    ``rhs_i - sum_{j<i} A_ij U_j`` (rows past ``i`` of ``U`` are not read: ``A_ij = 0``)."""
    rows = tl.arange(0, BLOCK_T)
    U = rhs
    for i in range(1, BLOCK_T):
        a_i = tl.sum(tl.where(rows[:, None] == i, A, 0.0), axis=0)          # [BLOCK_T]
        u_i = tl.sum(tl.where(rows[:, None] == i, rhs, 0.0), axis=0) - tl.sum(
            a_i[:, None] * U, axis=0)
        U = tl.where(rows[:, None] == i, u_i[None, :], U)
    return U


@triton.jit
def _gdn_chunk_kernel(
    Q, K, V, G, BETA, O, STATES, SLOTS, CU, INIT,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_gt, stride_gh, stride_bt, stride_bh,
    stride_ss, stride_sh, stride_sk, stride_sv, stride_slot, stride_cu, stride_init,
    total, num_slots, num_v_heads, k_dim, v_dim, group, scale,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, USE_L2: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // group
    offs_t = tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < k_dim, offs_v < v_dim
    mask_kv = mask_k[:, None] & mask_v[None, :]
    start = tl.minimum(tl.maximum(tl.load(CU + r * stride_cu), 0), total)
    end = tl.maximum(tl.minimum(tl.maximum(tl.load(CU + (r + 1) * stride_cu), 0), total), start)
    slot = tl.load(SLOTS + r * stride_slot)
    valid = (slot >= 0) & (slot < num_slots)
    read = valid & (tl.load(INIT + r * stride_init) != 0)
    state_ptrs = (STATES + tl.where(valid, slot, 0).to(tl.int64) * stride_ss + h * stride_sh
                  + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv)
    S = tl.load(state_ptrs, mask=_both(mask_kv, read), other=0.0).to(tl.float32)
    causal = offs_t[:, None] >= offs_t[None, :]
    for c in range(0, tl.cdiv(end - start, BLOCK_T)):
        # ---- load one chunk (rows past the request's end are zeros) ----
        rows = start.to(tl.int64) + c * BLOCK_T + offs_t
        mask_t = rows < end
        q = _rows_unit(Q + rows[:, None] * stride_qt + kh * stride_qh + offs_k[None, :] * stride_qd,
                       mask_t[:, None] & mask_k[None, :], USE_L2) * scale
        k = _rows_unit(K + rows[:, None] * stride_kt + kh * stride_kh + offs_k[None, :] * stride_kd,
                       mask_t[:, None] & mask_k[None, :], USE_L2)
        v = tl.load(V + rows[:, None] * stride_vt + h * stride_vh + offs_v[None, :] * stride_vd,
                    mask=mask_t[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        g = tl.load(G + rows * stride_gt + h * stride_gh, mask=mask_t, other=0.0)
        beta = tl.load(BETA + rows * stride_bt + h * stride_bh, mask=mask_t,
                       other=0.0).to(tl.float32)
        # ---- in-chunk decays and the UT system ----
        G_cum = tl.cumsum(g, axis=0)
        decay = tl.where(causal, tl.exp(G_cum[:, None] - G_cum[None, :]), 0.0)
        kk = tl.dot(k, tl.trans(k), input_precision="ieee")
        A = tl.where(offs_t[:, None] > offs_t[None, :], beta[:, None] * kk * decay, 0.0)
        ks = tl.dot(k, S, input_precision="ieee")
        U = _solve_unit_lower(A, beta[:, None] * (v - tl.exp(G_cum)[:, None] * ks), BLOCK_T)
        # ---- outputs, then the state at the chunk's end ----
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
        o = (tl.exp(G_cum)[:, None] * tl.dot(q, S, input_precision="ieee")
             + tl.dot(qk, U, input_precision="ieee"))
        tl.store(O + (rows[:, None] * num_v_heads + h) * v_dim + offs_v[None, :],
                 o.to(O.dtype.element_ty), mask=mask_t[:, None] & mask_v[None, :])
        G_last = tl.sum(tl.where(offs_t == BLOCK_T - 1, G_cum, 0.0), axis=0)
        k_decayed = k * tl.exp(G_last - G_cum)[:, None]
        S = tl.exp(G_last) * S + tl.dot(tl.trans(k_decayed), U, input_precision="ieee")
    tl.store(state_ptrs, S, mask=_both(mask_kv, valid))


@provider_table.register("chunk_gated_delta_rule", "triton", available=available)
def chunk_gated_delta_rule(q, k, v, g, beta, scale, ssm_states, cache_indices, has_initial_state,
                           cu_seqlens, use_qk_l2norm_in_kernel, chunk_size):
    """Triton ``chunk_gated_delta_rule`` (contract: ``xpu_ops/ops/gated_delta_rule.py``).

    Chunks of ``chunk_size`` rounded to a power of two in [16, 64] (32 for K > 64; ``tl.dot``
    needs 16 rows; results do not depend on it beyond rounding). Grid (b, Hv, value blocks)."""
    total, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1], v.shape[2]
    batch = cache_indices.shape[0]
    out = torch.zeros((total, num_v_heads, v_dim), dtype=v.dtype, device=v.device)
    if batch == 0 or num_v_heads == 0 or v_dim == 0:
        return out
    block_k = max(16, next_pow2(k_dim))
    block_t = min(64 if block_k <= 64 else 32, max(16, next_pow2(chunk_size)))   # registers
    block_v = max(16, min(next_pow2(v_dim), 32 if block_k > 64 else 64))
    launch(_gdn_chunk_kernel, (batch, num_v_heads, cdiv(v_dim, block_v)), q.device,
           q, k, v, g, beta, out, ssm_states, cache_indices, cu_seqlens, has_initial_state,
           *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(),
           *ssm_states.stride(), cache_indices.stride(0), cu_seqlens.stride(0),
           has_initial_state.stride(0), total, ssm_states.shape[0], num_v_heads, k_dim, v_dim,
           num_v_heads // num_k_heads, float(scale), BLOCK_T=block_t, BLOCK_K=block_k,
           BLOCK_V=block_v, USE_L2=bool(use_qk_l2norm_in_kernel),
           num_warps=8 if block_k * block_t >= 4096 else 4)
    return out
