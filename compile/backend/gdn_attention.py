"""The gated-delta-net paths of ``HybridLinearAttnBackend``: one function per forward mode.

Each takes the layer (``LinearAttention``), this step's ``mixed_qkv [T, q_dim + k_dim +
v_dim]``, ``a``/``b [T, Hv]``, the layer's state buffers and the step's ``LinearMetadata``, and
returns the core output ``[T, Hv, V]``:

- decode (one token per request): ``causal_conv1d_update`` on the conv windows, then
  ``fused_recurrent_gated_delta_rule`` on the recurrent states (both in place, per slot);
- extend and mixed (``extend_seq_lens`` tokens per request, with or without a cached prefix,
  whose state the request's slot holds): ``causal_conv1d_fn`` and ``chunk_gated_delta_rule``
  over the packed requests (``has_initial_state`` False starts a request from zeros);
- target verify (D draft tokens per request, topk 1): the conv over the D drafts and the
  recurrent rule with the state after each draft kept in the pool's verify buffers
  (``LinearSpecBuffers``) and the recurrent state itself left as it was, so a rejected draft
  rolls back (``LinearStatePool.commit_verified``).

Decode and extend run ``xpu_ops.gdn_attention``: those steps in one op (``decode=True`` for
decode steps), whose ``sgl_kernel`` provider is sgl-kernel-xpu's fused native kernel; verify
runs the ops one by one. Gating is ``fused_gdn_gating``: ``g = -exp(A_log) *
softplus(a + dt_bias)``, ``beta = sigmoid(b)``. Source: Gated Delta Networks (arXiv 2412.06464); sglang 0.5.23
``layers/attention/linear/gdn_backend.py`` (the same ops per mode).
"""

from __future__ import annotations

import torch
from torch import Tensor

import xpu_ops


def split_qkv(layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``x [T, q_dim + k_dim + v_dim]`` -> ``q, k [T, Hk, K]``, ``v [T, Hv, V]`` (views)."""
    q, k, v = x.split([layer.q_dim, layer.k_dim, layer.v_dim], dim=-1)
    t = x.shape[0]
    return (q.view(t, layer.num_k_heads, layer.head_k_dim),
            k.view(t, layer.num_k_heads, layer.head_k_dim),
            v.view(t, layer.num_v_heads, layer.head_v_dim))


def _fused(layer, mixed_qkv: Tensor, a: Tensor, b: Tensor, conv: Tensor, ssm: Tensor, meta,
           decode: bool) -> Tensor:
    """``xpu_ops.gdn_attention``: conv, gating and rule in one op (on Intel GPUs with
    sgl-kernel-xpu, its fused native kernel; elsewhere the provider's own kernels)."""
    return xpu_ops.gdn_attention(
        mixed_qkv, a, b, layer.conv_weights, layer.bias, layer.A_log, layer.dt_bias, conv, ssm,
        meta.query_start_loc, meta.cache_indices, meta.has_initial_state, layer.num_k_heads,
        layer.head_k_dim, layer.activation, decode)


def decode(layer, mixed_qkv: Tensor, a: Tensor, b: Tensor, conv: Tensor, ssm: Tensor,
           meta) -> Tensor:
    """One token per request: conv update and recurrent step, states updated in place."""
    return _fused(layer, mixed_qkv, a, b, conv, ssm, meta, decode=True)


def extend(layer, mixed_qkv: Tensor, a: Tensor, b: Tensor, conv: Tensor, ssm: Tensor,
           meta) -> Tensor:
    """Packed requests of any lengths (extend, mixed), each from its slot's state or zeros."""
    return _fused(layer, mixed_qkv, a, b, conv, ssm, meta, decode=False)


def verify(layer, mixed_qkv: Tensor, a: Tensor, b: Tensor, conv: Tensor, ssm: Tensor,
           meta, conv_inputs: Tensor, intermediate: Tensor) -> Tensor:
    """D draft tokens per request (topk 1): the states after every draft go to the verify
    buffers, by request row (``conv_inputs [rows, conv_dim, width - 1 + D]``, ``intermediate
    [rows, D, Hv, K, V]``); the recurrent state itself is left unchanged."""
    d, idx = meta.draft_token_num, meta.cache_indices
    x = mixed_qkv.view(-1, d, mixed_qkv.shape[-1])                       # [b, D, conv_dim]
    conv_inputs[:x.shape[0]].copy_(torch.cat([conv[idx.long()],
                                              x.transpose(1, 2).to(conv.dtype)], dim=-1))
    x = xpu_ops.causal_conv1d_update(x, conv, layer.conv_weights, layer.bias,
                                     activation=layer.activation, conv_state_indices=idx)
    q, k, v = split_qkv(layer, x.reshape(mixed_qkv.shape))
    g, beta = xpu_ops.fused_gdn_gating(layer.A_log, a, layer.dt_bias, b)
    return xpu_ops.fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, layer.scaling, ssm, idx, meta.query_start_loc,
        use_qk_l2norm_in_kernel=True, intermediate_states=intermediate,
        disable_state_update=True)


def idle(layer, mixed_qkv: Tensor) -> Tensor:
    """No tokens: an empty ``[0, Hv, V]``."""
    return mixed_qkv.new_empty((0, layer.num_v_heads, layer.head_v_dim))


__all__ = ["split_qkv", "decode", "extend", "verify", "idle"]
