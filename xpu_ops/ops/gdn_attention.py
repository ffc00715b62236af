"""``gdn_attention``: one gated-delta-net layer's core over packed requests and a state pool,
the conv, the gating and the delta rule in one op (sgl-kernel-xpu's fused ``gdn_attention``
role, over this package's state layout).

For ``mixed_qkv [T, 2 Hk K + Hv V]`` (q, k and v side by side, each head-major, before the
conv) and the gates' inputs ``a, b [T, Hv]``, the op computes exactly what these three calls do
(and is checked against them)::

    x = causal_conv1d_fn(mixed_qkv, conv_weights, conv_bias, conv_states, query_start_loc,
                         cache_indices, has_initial_state, activation)
    q, k, v = x split into [T, Hk, K], [T, Hk, K], [T, Hv, V]
    g, beta = fused_gdn_gating(A_log, a, dt_bias, b)
    o = chunk_gated_delta_rule(q, k, v, g, beta, K ** -0.5, ssm_states, cache_indices,
                               has_initial_state, query_start_loc, True)   # L2-normed q, k

so both state pools are read where the request's ``has_initial_state`` is True and its slot
in range, and written for every request with a slot in range (-1 or outside: zeros, nothing
written). ``decode=True`` promises one token per request continuing from its state (``T ==
b``; ``has_initial_state`` all True, a debug check): providers may then run their decode
kernels (conv update, token recurrence); the results are the same up to rounding.

Source: Gated Delta Networks (arXiv 2412.06464); transformers' ``Qwen3NextGatedDeltaNet``;
sglang 0.5.23's ``XpuGDNAttnBackend.forward_fused_gdn`` (what the fused native op is called
with).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _value_checks
from .._checks import (FLOAT_DTYPES, check_size, check_tensor,
                       check_tensor_args, check_writable, fail, int_scalar)
from .._registration import define_op
from .causal_conv1d import check_activation, check_conv_weights, debug_check_slots
from .common import check_cu_seqlens, check_flag, check_index
from .kv_cache import snapshot_aliased

FN = "gdn_attention"


def value_dim(fn: str, mixed_qkv: Tensor, num_k_heads: int, head_k_dim: int,
              num_v_heads: int) -> int:
    """V, from ``mixed_qkv.shape[1] = 2 Hk K + Hv V``; a width that leaves no whole V fails."""
    rest = mixed_qkv.shape[1] - 2 * num_k_heads * head_k_dim
    if num_v_heads < 1 or rest < num_v_heads or rest % num_v_heads:
        fail(fn, "mixed_qkv", "has a width that does not split into q, k and v",
             f"2 * num_k_heads * head_k_dim + Hv * V with V >= 1 (num_k_heads={num_k_heads}, "
             f"head_k_dim={head_k_dim}, Hv = a.shape[1] = {num_v_heads})",
             f"shape {tuple(mixed_qkv.shape)}")
    return rest // num_v_heads


def _check_gdn_attention(mixed_qkv, a, b, conv_weights, conv_bias, A_log, dt_bias, conv_states,
                         ssm_states, query_start_loc, cache_indices, has_initial_state,
                         num_k_heads, head_k_dim, activation, decode) -> int:
    """Validate shapes/dtypes/devices and scalars (runs in the fake too); returns V."""
    check_tensor(FN, "mixed_qkv", mixed_qkv, ndim=2, dtypes=FLOAT_DTYPES)
    device, tokens = mixed_qkv.device, mixed_qkv.shape[0]
    hk = int_scalar(FN, "num_k_heads", num_k_heads, "an int >= 1")
    k_dim = int_scalar(FN, "head_k_dim", head_k_dim, "an int >= 1")
    if hk < 1 or k_dim < 1:
        fail(FN, "num_k_heads/head_k_dim", "are not positive", "ints >= 1", (hk, k_dim))
    for arg, t in (("a", a), ("b", b)):
        check_tensor(FN, arg, t, ndim=2, dtypes=FLOAT_DTYPES, device=device)
        check_size(FN, arg, t, 0, tokens, "mixed_qkv.shape[0] (T)")
    hv = a.shape[1]
    check_size(FN, "b", b, 1, hv, "a.shape[1] (Hv)")
    if hv % hk:
        fail(FN, "a", "has a head count that is not a multiple of num_k_heads",
             f"Hv = a.shape[1] a multiple of num_k_heads={hk}", f"Hv={hv}")
    v_dim = value_dim(FN, mixed_qkv, hk, k_dim, hv)
    check_conv_weights(FN, mixed_qkv, conv_weights, conv_bias, "conv_states", conv_states,
                       ("mixed_qkv", "conv_weights", "conv_bias"))
    for arg, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_tensor(FN, arg, t, ndim=1, dtypes=FLOAT_DTYPES, device=device)
        check_size(FN, arg, t, 0, hv, "a.shape[1] (Hv)")
    check_tensor(FN, "ssm_states", ssm_states, ndim=4, dtypes=(torch.float32,), device=device)
    for dim, size, rule in ((1, hv, "a.shape[1] (Hv)"), (2, k_dim, "head_k_dim (K)"),
                            (3, v_dim, "V (from mixed_qkv's width)")):
        check_size(FN, "ssm_states", ssm_states, dim, size, rule)
    check_index(FN, "cache_indices", cache_indices, 1, device)
    batch = cache_indices.shape[0]
    check_cu_seqlens(FN, "query_start_loc", query_start_loc, batch, device)
    check_tensor(FN, "has_initial_state", has_initial_state, ndim=1, dtypes=(torch.bool,),
                 device=device)
    check_size(FN, "has_initial_state", has_initial_state, 0, batch, "cache_indices.shape[0] (b)")
    check_activation(FN, activation)
    for arg, pool in (("conv_states", conv_states), ("ssm_states", ssm_states)):
        check_writable(FN, arg, pool, "each slot its own state; the op writes the pools")
    if check_flag(FN, "decode", decode) and tokens != batch:
        fail(FN, "decode", "is True for a batch that is not one token per request",
             "mixed_qkv.shape[0] (T) == cache_indices.shape[0] (b) when decode=True",
             f"T={tokens}, b={batch}", "Pass decode=False for extend steps.")
    return v_dim


def _debug_check(mixed_qkv, ssm_states, query_start_loc, cache_indices, has_initial_state,
                 decode) -> None:
    """Under ``xpu_ops.debug_checks()``: prefix sums, slots, and a decode that continues every
    request."""
    debug_check_slots(FN, "query_start_loc", query_start_loc, mixed_qkv, "cache_indices",
                      cache_indices, ssm_states)
    if decode:
        _value_checks.check_all_true(FN, "has_initial_state", has_initial_state,
                                     "all True when decode=True (every request continues from "
                                     "its state)", "Pass decode=False for requests that start "
                                     "fresh.")


@define_op("xpu_ops::gdn_attention", mutates_args=("conv_states", "ssm_states"), by_device=True)
def gdn_attention_op(mixed_qkv: Tensor, a: Tensor, b: Tensor, conv_weights: Tensor,
                     conv_bias: Optional[Tensor], A_log: Tensor, dt_bias: Tensor,
                     conv_states: Tensor, ssm_states: Tensor, query_start_loc: Tensor,
                     cache_indices: Tensor, has_initial_state: Tensor, num_k_heads: int,
                     head_k_dim: int, activation: Optional[str], decode: bool) -> Tensor:
    """Op form of ``gdn_attention``: returns ``o``, writes both state pools; inputs that share
    memory with a pool are read as they were before the call."""
    _check_gdn_attention(mixed_qkv, a, b, conv_weights, conv_bias, A_log, dt_bias, conv_states,
                         ssm_states, query_start_loc, cache_indices, has_initial_state,
                         num_k_heads, head_k_dim, activation, decode)
    _debug_check(mixed_qkv, ssm_states, query_start_loc, cache_indices, has_initial_state,
                 decode)
    src = snapshot_aliased((conv_states, ssm_states),
                           (mixed_qkv, a, b, conv_weights, conv_bias, A_log, dt_bias))
    return None if src is None else (*src, conv_states, ssm_states, query_start_loc,
                                     cache_indices, has_initial_state, num_k_heads,
                                     head_k_dim, activation, decode)


@gdn_attention_op.register_fake
def _(mixed_qkv, a, b, conv_weights, conv_bias, A_log, dt_bias, conv_states, ssm_states,
      query_start_loc, cache_indices, has_initial_state, num_k_heads, head_k_dim, activation,
      decode):
    v_dim = _check_gdn_attention(mixed_qkv, a, b, conv_weights, conv_bias, A_log, dt_bias,
                                 conv_states, ssm_states, query_start_loc, cache_indices,
                                 has_initial_state, num_k_heads, head_k_dim, activation, decode)
    return mixed_qkv.new_empty((mixed_qkv.shape[0], a.shape[1], v_dim))


def gdn_attention(mixed_qkv, a, b, conv_weights, conv_bias, A_log, dt_bias, conv_states,
                  ssm_states, query_start_loc, cache_indices, has_initial_state, num_k_heads,
                  head_k_dim, activation="silu", decode=False):
    """One gated-delta-net layer's core for this step's tokens: conv, gating, delta rule.

    Equals ``causal_conv1d_fn`` -> split -> ``fused_gdn_gating`` -> ``chunk_gated_delta_rule``
    (scale ``K ** -0.5``, q and k L2-normalised), see the module docstring.

    Args:
        mixed_qkv: [T, 2 Hk K + Hv V] fp16|bf16|fp32, q | k | v before the conv.
        a, b: [T, Hv], the decay's and the write strength's inputs (any float dtype).
        conv_weights: [2 Hk K + Hv V, width]. conv_bias: [2 Hk K + Hv V] or None.
        A_log, dt_bias: [Hv] float.
        conv_states: [num_slots, 2 Hk K + Hv V, width - 1] (mutated).
        ssm_states: [num_slots, Hv, K, V] float32 (mutated).
        query_start_loc: [b + 1] int32 prefix sums of the requests' token counts.
        cache_indices: [b] int32 state slots (-1 or outside the pool: no state).
        has_initial_state: [b] bool (False: the request starts from zeros).
        num_k_heads: Hk. head_k_dim: K (Hv is ``a.shape[1]``, V follows from the width).
        activation: of the conv, ``"silu"`` (``"swish"``) or None.
        decode: True promises one token per request, each continuing from its state (decode
            kernels may run; same results).
    Returns:
        ``o [T, Hv, V]`` in mixed_qkv's dtype, contiguous.
    Raises:
        TypeError/ValueError: wrong kind, shape, dtype or device, naming the argument;
        ``decode=True`` with ``T != b``; an expanded state pool (slots sharing memory). Under
        ``xpu_ops.debug_checks()`` also slots out of range or repeated, prefix sums that do not
        end at T, a decode with a fresh request.

    >>> import torch, xpu_ops
    >>> T, hk, hv, k, v, w = 3, 1, 2, 4, 4, 4
    >>> dim = 2 * hk * k + hv * v
    >>> o = xpu_ops.gdn_attention(
    ...     torch.randn(T, dim), torch.randn(T, hv), torch.randn(T, hv), torch.randn(dim, w),
    ...     None, torch.zeros(hv), torch.zeros(hv), torch.zeros(2, dim, w - 1),
    ...     torch.zeros(2, hv, k, v), torch.tensor([0, T], dtype=torch.int32),
    ...     torch.tensor([1], dtype=torch.int32), torch.tensor([False]), hk, k)
    >>> tuple(o.shape)
    (3, 2, 4)
    """
    check_tensor_args(FN, optional=("conv_bias",), mixed_qkv=mixed_qkv, a=a, b=b,
                      conv_weights=conv_weights, conv_bias=conv_bias, A_log=A_log,
                      dt_bias=dt_bias, conv_states=conv_states, ssm_states=ssm_states,
                      query_start_loc=query_start_loc, cache_indices=cache_indices,
                      has_initial_state=has_initial_state)
    check_activation(FN, activation)  # before the dispatcher's own, unnamed type error
    return torch.ops.xpu_ops.gdn_attention(
        mixed_qkv, a, b, conv_weights, conv_bias, A_log, dt_bias, conv_states, ssm_states,
        query_start_loc, cache_indices, has_initial_state,
        int_scalar(FN, "num_k_heads", num_k_heads, "an int >= 1"),
        int_scalar(FN, "head_k_dim", head_k_dim, "an int >= 1"), activation,
        check_flag(FN, "decode", decode))


__all__ = ["gdn_attention", "value_dim"]
