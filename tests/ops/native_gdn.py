"""Test-only stand-in for sgl-kernel-xpu's fused ``gdn_attention`` (``native_sgl_kernel``
registers it): the native schema, the native layouts (``projected_states_qkvz`` per key-head
group or, with ``reorder_input``, part by part; ``conv_state`` read as ``[cache, width - 1,
dim]`` through its strides; ``ssm_state`` as ``[cache, Hv, V, K]``) and its input contract
(contiguity, ``A_log`` float32, ``dt_bias`` in the output dtype, int32 metadata), computed on
the CPU with xpu-ops' reference conv, gating and chunked rule. Non-speculative calls only."""

from __future__ import annotations

import torch

from xpu_ops.compat_gdn import split_projections
from xpu_ops.reference import causal_conv1d as ref_conv
from xpu_ops.reference import gated_delta_rule as ref_rule

SCHEMA = (
    "gdn_attention(Tensor! core_attn_out, Tensor! z, Tensor projected_states_qkvz, "
    "Tensor projected_states_ba, int num_k_heads, int num_v_heads, int head_k_dim, "
    "int head_v_dim, Tensor! conv_state, Tensor! ssm_state, Tensor conv_weights, "
    "Tensor? conv_bias, str activation, Tensor A_log, Tensor dt_bias, int num_prefills, "
    "int num_decodes, int num_spec_decodes, Tensor? has_initial_state, "
    "Tensor? non_spec_query_start_loc, Tensor? non_spec_token_indx, "
    "Tensor? non_spec_state_indices_tensor, Tensor? spec_query_start_loc, "
    "Tensor? spec_token_indx, Tensor? spec_state_indices_tensor, Tensor? num_accepted_tokens, "
    "int num_actual_tokens, int tp_size, bool reorder_input, Tensor? workspace=None) -> ()")

#: every call's (num_prefills, num_decodes, reorder_input), for the tests to inspect
CALLS: list[tuple[int, int, bool]] = []


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"native gdn_attention (test stand-in): {message}")


def gdn_attention(core, z_out, qkvz, ba, hk, hv, k_dim, v_dim, conv_state, ssm_state, conv_w,
                  conv_b, activation, A_log, dt_bias, num_prefills, num_decodes, num_spec,
                  has_initial_state, qsl, token_indx, state_indices, spec_qsl, spec_token_indx,
                  spec_state_indices, num_accepted, num_actual_tokens, tp_size, reorder,
                  workspace=None):
    for name, t in (("core_attn_out", core), ("z", z_out), ("projected_states_qkvz", qkvz),
                    ("projected_states_ba", ba), ("conv_weights", conv_w), ("A_log", A_log),
                    ("dt_bias", dt_bias)):
        _require(t.is_contiguous(), f"{name} must be contiguous")
    _require(ssm_state.shape[0] > 0, "index 0 is out of bounds for dimension 0 with size 0 "
             "(the native op checks ssm_state[0].is_contiguous())")
    _require(ssm_state[0].is_contiguous(), "ssm_state of each batch must be contiguous")
    _require(A_log.dtype == torch.float32, "A_log must be float32")
    _require(dt_bias.dtype == core.dtype, "dt_bias dtype must match core_attn_out")
    _require(activation in ("silu", "swish"), f"unsupported activation {activation!r}")
    _require(num_spec == 0 and token_indx is None and tp_size == 1,
             "the stand-in serves non-speculative calls without token_indx at tp_size 1")
    batch = num_prefills + num_decodes
    _require(qsl is not None and qsl.dtype == torch.int32 and qsl.shape == (batch + 1,),
             "non_spec_query_start_loc must be int32 [num_prefills + num_decodes + 1]")
    _require(state_indices is not None and state_indices.dtype == torch.int32
             and state_indices.shape == (batch,) and bool((state_indices >= 0).all()),
             "non_spec_state_indices_tensor must be int32 [b] (the stand-in has no pad slots)")
    _require(qkvz.shape[1] == hk * (2 * k_dim + 2 * v_dim * hv // hk), "qkvz width")
    _require(ba.shape[1] == 2 * hv, "ba width")
    _require(core.shape[1:] == (hv, v_dim) and z_out.shape == core.shape, "output shapes")
    CALLS.append((num_prefills, num_decodes, reorder))
    t = num_actual_tokens
    q, k, v, z, b, a = split_projections(qkvz[:t], ba[:t], hk, hv, k_dim, v_dim, reorder)
    mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    initial = (torch.ones(batch, dtype=torch.bool) if has_initial_state is None
               else has_initial_state)
    x = ref_conv.causal_conv1d_fn(mixed, conv_w, conv_b, conv_state.transpose(1, 2), qsl,
                                  state_indices, initial, activation)
    qk = hk * k_dim
    g, beta = ref_rule.fused_gdn_gating(A_log, a, dt_bias, b)
    o = ref_rule.chunk_gated_delta_rule(
        x[:, :qk].reshape(t, hk, k_dim), x[:, qk:2 * qk].reshape(t, hk, k_dim),
        x[:, 2 * qk:].reshape(t, hv, v_dim), g, beta, k_dim ** -0.5,
        ssm_state.transpose(-1, -2), state_indices, initial, qsl, True, 64)
    core[:t] = o.to(core.dtype)
    z_out[:t] = z
