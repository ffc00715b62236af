"""Triton ``gdn_attention``: this package's Triton conv, gating and delta-rule kernels in a row
(``reference.gdn_attention.compose``); a decode call runs the conv update and the token
recurrence, an extend call the varlen conv and the chunked rule."""

from __future__ import annotations

from .. import provider_table
from ..reference.gdn_attention import Kernels, compose
from ._common import available
from .causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from .gated_delta_rule import fused_gdn_gating, fused_recurrent_gated_delta_rule
from .gated_delta_rule_chunk import chunk_gated_delta_rule

KERNELS = Kernels(causal_conv1d_fn, causal_conv1d_update, fused_gdn_gating,
                  chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)


@provider_table.register("gdn_attention", "triton", available=available)
def gdn_attention(mixed_qkv, a, b, conv_weights, conv_bias, A_log, dt_bias, conv_states,
                  ssm_states, query_start_loc, cache_indices, has_initial_state, num_k_heads,
                  head_k_dim, activation, decode):
    """Triton ``gdn_attention`` (contract: ``xpu_ops/ops/gdn_attention.py``)."""
    return compose(KERNELS, mixed_qkv, a, b, conv_weights, conv_bias, A_log, dt_bias,
                   conv_states, ssm_states, query_start_loc, cache_indices, has_initial_state,
                   num_k_heads, head_k_dim, activation, decode, use_decode_kernels=True)
