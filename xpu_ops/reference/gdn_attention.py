"""Reference ``gdn_attention``: the reference conv, gating and chunked delta rule in a row (the
op's definition), with ``compose`` shared by the Triton provider (its own kernels in the same
row)."""

from __future__ import annotations

from typing import Callable, NamedTuple

from .. import provider_table
from . import causal_conv1d as conv
from . import gated_delta_rule as rule


class Kernels(NamedTuple):
    """One provider's implementations of the four steps (their op signatures)."""

    conv_fn: Callable
    conv_update: Callable
    gating: Callable
    chunk: Callable
    recurrent: Callable


def compose(kernels: Kernels, mixed_qkv, a, b, conv_weights, conv_bias, A_log, dt_bias,
            conv_states, ssm_states, query_start_loc, cache_indices, has_initial_state,
            num_k_heads, head_k_dim, activation, decode, *, use_decode_kernels: bool):
    """``o [T, Hv, V]``: conv, split, gating, rule. ``use_decode_kernels`` with ``decode``: the
    conv update and the token recurrence (every request continues from its slot)."""
    tokens, hv, v_dim = mixed_qkv.shape[0], a.shape[1], ssm_states.shape[3]
    qk = num_k_heads * head_k_dim
    if decode and use_decode_kernels:
        x = kernels.conv_update(mixed_qkv, conv_states, conv_weights, conv_bias, activation,
                                cache_indices)
    else:
        x = kernels.conv_fn(mixed_qkv, conv_weights, conv_bias, conv_states, query_start_loc,
                            cache_indices, has_initial_state, activation)
    q = x[:, :qk].reshape(tokens, num_k_heads, head_k_dim)
    k = x[:, qk:2 * qk].reshape(tokens, num_k_heads, head_k_dim)
    v = x[:, 2 * qk:].reshape(tokens, hv, v_dim)
    g, beta = kernels.gating(A_log, a, dt_bias, b)
    scale = head_k_dim ** -0.5
    if decode and use_decode_kernels:
        return kernels.recurrent(q, k, v, g, beta, scale, ssm_states, cache_indices,
                                 query_start_loc, True, None, False)
    return kernels.chunk(q, k, v, g, beta, scale, ssm_states, cache_indices, has_initial_state,
                         query_start_loc, True, 64)


KERNELS = Kernels(conv.causal_conv1d_fn, conv.causal_conv1d_update, rule.fused_gdn_gating,
                  rule.chunk_gated_delta_rule, rule.fused_recurrent_gated_delta_rule)


@provider_table.register("gdn_attention", "reference")
def gdn_attention(mixed_qkv, a, b, conv_weights, conv_bias, A_log, dt_bias, conv_states,
                  ssm_states, query_start_loc, cache_indices, has_initial_state, num_k_heads,
                  head_k_dim, activation, decode):
    """Reference ``gdn_attention`` (contract: ``xpu_ops/ops/gdn_attention.py``): always the
    varlen conv and the chunked rule (the definition; ``decode`` changes nothing)."""
    return compose(KERNELS, mixed_qkv, a, b, conv_weights, conv_bias, A_log, dt_bias,
                  conv_states, ssm_states, query_start_loc, cache_indices, has_initial_state,
                  num_k_heads, head_k_dim, activation, decode, use_decode_kernels=False)
