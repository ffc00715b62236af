"""Float64 oracle of the linear-attention ops, written from the math (Gated DeltaNet, Mamba's
causal conv1d), token by token.

Independent of ``xpu_ops.reference``: it imports nothing from ``xpu_ops``, loops per request and
per token, and reads a state slot only where the contract says the op reads it. Each function
takes the op's arguments (clones are made inside) and returns the expected outputs and the
expected state pool after the call. Slow on purpose; small shapes only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

F64 = torch.float64


def _spans(cu: Tensor, total: int) -> list[tuple[int, int]]:
    cu = [min(max(int(c), 0), total) for c in cu.tolist()]
    return [(s, max(s, e)) for s, e in zip(cu[:-1], cu[1:])]


def _slot(slot: int, num_slots: int) -> int:
    return slot if 0 <= slot < num_slots else -1


def _silu(x: Tensor) -> Tensor:
    return x / (1.0 + torch.exp(-x))


def conv_tokens(prev: Tensor, tokens: Tensor, weight: Tensor, bias: Optional[Tensor],
                activation) -> tuple[Tensor, Tensor]:
    """One request: ``prev [dim, width - 1]`` then ``tokens [L, dim]`` (float64); returns
    ``(out [L, dim], new state [dim, width - 1])``: ``out[t] = act(bias + sum_w weight[:, w] *
    e[t + w])`` over ``e = prev ++ tokens``, written as a loop over taps."""
    width = weight.shape[1]
    ext = torch.cat([prev.to(F64), tokens.to(F64).T], dim=1)             # [dim, width - 1 + L]
    out = torch.zeros(tokens.shape[0], tokens.shape[1], dtype=F64)
    for t in range(tokens.shape[0]):
        acc = torch.zeros(tokens.shape[1], dtype=F64) if bias is None else bias.to(F64).clone()
        for w in range(width):
            acc = acc + weight[:, w].to(F64) * ext[:, t + w]
        out[t] = _silu(acc) if activation is not None else acc
    return out, ext[:, ext.shape[1] - (width - 1):]


def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices,
                     has_initial_state, activation) -> tuple[Tensor, Tensor]:
    """Expected ``(out [T, dim] float64, conv_states after the call, float64)``."""
    states = conv_states.detach().to(F64).clone()
    out = torch.zeros(x.shape, dtype=F64)
    width, num_slots = weight.shape[1], conv_states.shape[0]
    for r, (s, e) in enumerate(_spans(query_start_loc, x.shape[0])):
        slot = _slot(int(cache_indices[r]), num_slots)
        read = slot >= 0 and bool(has_initial_state[r])
        prev = conv_states[slot].to(F64) if read else torch.zeros(x.shape[1], width - 1, dtype=F64)
        out[s:e], new = conv_tokens(prev, x[s:e], weight, bias, activation)
        if slot >= 0:
            states[slot] = new
    return out, states


def causal_conv1d_update(x, conv_state, weight, bias, activation, conv_state_indices):
    """Expected ``(out like x, float64; conv_state after the call, float64)``."""
    xs = x if x.dim() == 3 else x[:, None]
    states = conv_state.detach().to(F64).clone()
    out = torch.zeros(xs.shape, dtype=F64)
    width, num_slots = weight.shape[1], conv_state.shape[0]
    for r in range(xs.shape[0]):
        slot = r if conv_state_indices is None else _slot(int(conv_state_indices[r]), num_slots)
        prev = (conv_state[slot].to(F64) if slot >= 0
                else torch.zeros(xs.shape[2], width - 1, dtype=F64))
        out[r], new = conv_tokens(prev, xs[r], weight, bias, activation)
        if slot >= 0:
            states[slot] = new
    return out.reshape(x.shape), states


def gdn_gating(A_log, a, dt_bias, b) -> tuple[Tensor, Tensor]:
    """Expected ``(g, beta)`` float64: ``g = -e^{A_log} softplus(a + dt_bias)`` (softplus is
    ``x`` above 20), ``beta = sigmoid(b)`` rounded to b's dtype (as ``b.sigmoid()``)."""
    x = a.to(F64) + dt_bias.to(F64)
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(torch.clamp(x, max=20))))
    g = -torch.exp(A_log.to(F64)) * softplus
    beta = (1.0 / (1.0 + torch.exp(-b.to(F64)))).to(b.dtype).to(F64)
    return g, beta


def _unit(x: Tensor) -> Tensor:
    return x / torch.sqrt((x * x).sum() + 1e-6)


def gated_delta_rule(q, k, v, g, beta, scale, ssm_states, cache_indices, cu_seqlens, l2norm,
                     *, has_initial_state=None, intermediate_states=None,
                     disable_state_update=False) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """Expected ``(o [T, Hv, V], ssm_states after, intermediate_states after)`` in float64: the
    recurrence ``S = e^{g} S; S = S + k (beta (v - S^T k))^T; o = S^T (scale q)`` per value
    head, token by token (head h reads key head ``h // (Hv // Hk)``)."""
    total, hk, _ = q.shape
    hv = v.shape[1]
    group = hv // hk
    states = ssm_states.detach().to(F64).clone()
    inter = None if intermediate_states is None else intermediate_states.detach().to(F64).clone()
    out = torch.zeros(v.shape, dtype=F64)
    num_slots = ssm_states.shape[0]
    for r, (s, e) in enumerate(_spans(cu_seqlens, total)):
        slot = _slot(int(cache_indices[r]), num_slots)
        read = slot >= 0 and (has_initial_state is None or bool(has_initial_state[r]))
        for h in range(hv):
            S = (ssm_states[slot, h].to(F64) if read
                 else torch.zeros(ssm_states.shape[2:], dtype=F64))
            for i, t in enumerate(range(s, e)):
                qt, kt = q[t, h // group].to(F64), k[t, h // group].to(F64)
                if l2norm:
                    qt, kt = _unit(qt), _unit(kt)
                S = S * math.exp(float(g[t, h]))
                u = float(beta[t, h]) * (v[t, h].to(F64) - S.T @ kt)
                S = S + torch.outer(kt, u)
                out[t, h] = S.T @ (scale * qt)
                if inter is not None and i < inter.shape[1]:
                    inter[r, i, h] = S
            if slot >= 0 and not disable_state_update:
                states[slot, h] = S
    return out, states, inter
