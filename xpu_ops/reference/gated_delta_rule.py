"""Reference gated delta rule: ``fused_gdn_gating``, the chunked form (UT transform, one
triangular solve per chunk) and the token recurrence, float32, one request at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import provider_table
from .causal_conv1d import request_spans, state_slot

L2NORM_EPS = 1e-6


@provider_table.register("fused_gdn_gating", "reference")
def fused_gdn_gating(A_log, a, dt_bias, b):
    """Reference ``fused_gdn_gating`` (contract: ``xpu_ops/ops/gated_delta_rule.py``)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float()).to(b.dtype).float()
    return g.contiguous(), beta.contiguous()


def _prepared(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """float32 ``q`` (scaled), ``k`` per value head ``[T, Hv, K]``, ``v``, ``g``, ``beta``."""
    qf, kf = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + L2NORM_EPS)
        kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + L2NORM_EPS)
    groups = v.shape[1] // q.shape[1]
    qf = qf.repeat_interleave(groups, dim=1) * scale
    kf = kf.repeat_interleave(groups, dim=1)
    return qf, kf, v.float(), g.float(), beta.float()


def _initial(ssm_states, slot: int, use_state: bool) -> torch.Tensor:
    if slot >= 0 and use_state:
        return ssm_states[slot].clone()
    return ssm_states.new_zeros(ssm_states.shape[1:])


def _chunk(S, q, k, v, g, beta):
    """One chunk of ``n`` tokens from state ``S [Hv, K, V]``; ``q, k [n, Hv, K]``,
    ``v [n, Hv, V]``, ``g, beta [n, Hv]``. Returns ``(o [n, Hv, V], S after the chunk)``.

    With ``G`` the in-chunk cumulative log decay, ``u_i = beta_i (v_i - e^{G_i} S^T k_i -
    sum_{j<i} e^{G_i - G_j} (k_i.k_j) u_j)`` is a unit lower-triangular system;
    ``o_i = e^{G_i} S^T q_i + sum_{j<=i} e^{G_i - G_j} (q_i.k_j) u_j``."""
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)   # [Hv, n, *]
    G, beta = g.T.cumsum(-1), beta.T                                     # [Hv, n]
    n = G.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=G.device).tril()
    decay = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, float("-inf")).exp()
    system = (beta[:, :, None] * (k @ k.transpose(1, 2)) * decay).tril(-1)
    rhs = beta[:, :, None] * (v - G.exp()[:, :, None] * (k @ S))
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    o = G.exp()[:, :, None] * (q @ S) + ((q @ k.transpose(1, 2)) * decay) @ u
    last = G[:, -1:]
    S = last.exp()[:, :, None] * S + ((last - G).exp()[:, :, None] * k).transpose(1, 2) @ u
    return o.transpose(0, 1), S


@provider_table.register("chunk_gated_delta_rule", "reference")
def chunk_gated_delta_rule(q, k, v, g, beta, scale, ssm_states, cache_indices, has_initial_state,
                           cu_seqlens, use_qk_l2norm_in_kernel, chunk_size):
    """Reference ``chunk_gated_delta_rule`` (contract: ``xpu_ops/ops/gated_delta_rule.py``).

    Requests one at a time, chunks of ``chunk_size`` tokens through ``_chunk``; all final
    states are written after every request has read its initial one."""
    qf, kf, vf, gf, bf = _prepared(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    out = vf.new_zeros(vf.shape)
    slots = [state_slot(s, ssm_states.shape[0]) for s in cache_indices.tolist()]
    initial = has_initial_state.tolist()
    finals = []
    for r, (start, end) in enumerate(request_spans(cu_seqlens, q.shape[0])):
        S = _initial(ssm_states, slots[r], initial[r])
        for c in range(start, end, chunk_size):
            e = min(c + chunk_size, end)
            out[c:e], S = _chunk(S, qf[c:e], kf[c:e], vf[c:e], gf[c:e], bf[c:e])
        if slots[r] >= 0:
            finals.append((slots[r], S))
    for slot, S in finals:
        ssm_states[slot] = S
    return out.to(v.dtype)


@provider_table.register("fused_recurrent_gated_delta_rule", "reference")
def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, ssm_states, cache_indices,
                                     cu_seqlens, use_qk_l2norm_in_kernel, intermediate_states,
                                     disable_state_update):
    """Reference ``fused_recurrent_gated_delta_rule`` (contract:
    ``xpu_ops/ops/gated_delta_rule.py``): the recurrence token by token, per request."""
    qf, kf, vf, gf, bf = _prepared(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    out = vf.new_zeros(vf.shape)
    slots = [state_slot(s, ssm_states.shape[0]) for s in cache_indices.tolist()]
    steps = 0 if intermediate_states is None else intermediate_states.shape[1]
    finals = []
    for r, (start, end) in enumerate(request_spans(cu_seqlens, q.shape[0])):
        S = _initial(ssm_states, slots[r], True)
        for i, t in enumerate(range(start, end)):
            S = S * gf[t].exp()[:, None, None]
            u = bf[t][:, None] * (vf[t] - torch.einsum("hkv,hk->hv", S, kf[t]))
            S = S + kf[t][:, :, None] * u[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", S, qf[t])
            if i < steps:
                intermediate_states[r, i] = S
        if slots[r] >= 0 and not disable_state_update:
            finals.append((slots[r], S))
    for slot, S in finals:
        ssm_states[slot] = S
    return out.to(v.dtype)
