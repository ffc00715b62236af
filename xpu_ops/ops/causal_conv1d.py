"""``causal_conv1d_fn`` / ``causal_conv1d_update``: the short depthwise causal convolution of a
gated-delta-net (or Mamba) layer, with a per-request conv state kept in a slot pool.

The state of a request is the last ``width - 1`` inputs it has seen, ``[dim, width - 1]``
(oldest first), stored in ``conv_states[slot]`` (sglang's mamba pool layout). The ops write
each addressed request's final state into its slot and return the convolved tokens.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _value_checks
from .._checks import (FLOAT_DTYPES, check_optional, check_size, check_tensor, check_tensor_args,
                       check_writable, fail)
from .._registration import define_op
from .common import check_cu_seqlens, check_index
from .kv_cache import snapshot_aliased

ACTIVATIONS = (None, "silu", "swish")


def check_activation(fn: str, activation) -> None:
    """``activation`` is None (identity) or ``"silu"`` (``"swish"`` is its other name).

    Raises:
        TypeError: not a str or None. ValueError: another name.
    """
    if activation is None or activation in ("silu", "swish"):
        return
    if not isinstance(activation, str):
        fail(fn, "activation", "is not a str", "None, 'silu' or 'swish'",
             type(activation).__name__, exc=TypeError)
    fail(fn, "activation", "is not supported", "None, 'silu' or 'swish'", repr(activation))


def debug_check_slots(fn: str, cu_arg: str, cu, tokens, slots_arg: str, slots, pool,
                      max_steps=None) -> None:
    """Under ``xpu_ops.debug_checks()``: ``cu`` prefix sums of ``tokens.shape[0]`` tokens, state
    slots -1 or inside ``pool`` and distinct (``_value_checks.check_linear_attention``)."""
    if isinstance(pool, torch.Tensor) and pool.dim() and tokens.dim():
        _value_checks.check_linear_attention(fn, cu_arg, cu, tokens.shape[0], slots_arg, slots,
                                             pool.shape[0], max_steps)


def check_conv_weights(fn: str, x: Tensor, weight, bias, conv_state_arg: str,
                       conv_states, names: tuple[str, str, str] = ("x", "weight", "bias")
                       ) -> None:
    """``weight [dim, width]``, ``bias [dim]`` or None, ``conv_states [num_slots, dim, width - 1]``,
    all float tensors on x's device; ``dim = x.shape[-1]``. ``names``: the caller's names of
    ``x``, ``weight`` and ``bias`` (the messages name the caller's arguments)."""
    x_arg, w_arg, b_arg = names
    device, dim = x.device, x.shape[-1]
    check_tensor(fn, w_arg, weight, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_size(fn, w_arg, weight, 0, dim, f"{x_arg}.shape[-1] (dim)")
    if weight.shape[1] < 1:
        fail(fn, w_arg, "has no taps", f"width = {w_arg}.shape[1] >= 1",
             f"shape {tuple(weight.shape)}")
    check_optional(fn, b_arg, bias, ndim=1, dtypes=FLOAT_DTYPES, device=device)
    if bias is not None:
        check_size(fn, b_arg, bias, 0, dim, f"{x_arg}.shape[-1] (dim)")
    check_tensor(fn, conv_state_arg, conv_states, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    check_size(fn, conv_state_arg, conv_states, 1, dim, f"{x_arg}.shape[-1] (dim)")
    check_size(fn, conv_state_arg, conv_states, 2, weight.shape[1] - 1, f"{w_arg}.shape[1] - 1")
    check_writable(fn, conv_state_arg, conv_states, "each slot its own window; the op writes it")


def _check_causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices,
                            has_initial_state, activation) -> None:
    """Validate shapes/dtypes/devices (runs in the fake too)."""
    fn = "causal_conv1d_fn"
    check_tensor(fn, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_conv_weights(fn, x, weight, bias, "conv_states", conv_states)
    check_index(fn, "cache_indices", cache_indices, 1, x.device)
    batch = cache_indices.shape[0]
    check_cu_seqlens(fn, "query_start_loc", query_start_loc, batch, x.device)
    check_tensor(fn, "has_initial_state", has_initial_state, ndim=1, dtypes=(torch.bool,),
                 device=x.device)
    check_size(fn, "has_initial_state", has_initial_state, 0, batch, "cache_indices.shape[0] (b)")
    check_activation(fn, activation)


@define_op("xpu_ops::causal_conv1d_fn", mutates_args=("conv_states",), by_device=True)
def causal_conv1d_fn_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_states: Tensor,
                        query_start_loc: Tensor, cache_indices: Tensor, has_initial_state: Tensor,
                        activation: Optional[str]) -> Tensor:
    """Op form of ``causal_conv1d_fn``: returns ``out``, writes the states (the checks; the
    dispatcher then runs the provider of x's device)."""
    _check_causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices,
                            has_initial_state, activation)
    src = snapshot_aliased((conv_states,), (x, weight, bias))
    return None if src is None else (*src, conv_states, query_start_loc, cache_indices,
                                     has_initial_state, activation)


@causal_conv1d_fn_op.register_fake
def _(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
      activation):
    _check_causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices,
                            has_initial_state, activation)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices,
                     has_initial_state, activation="silu"):
    """Depthwise causal conv1d over packed requests (extend / prefill), with conv states.

    Request ``r`` owns tokens ``[query_start_loc[r], query_start_loc[r + 1])`` of ``x``. Its
    input is preceded by its state ``conv_states[cache_indices[r]]`` when
    ``has_initial_state[r]``, else by ``width - 1`` zeros; ``out[t, d] = act(bias[d] +
    sum_w weight[d, w] * e[t + w, d])`` over that extended sequence ``e`` (float32
    accumulation). The last ``width - 1`` entries of ``e`` become the request's new state.
    A slot of -1 (or outside ``[0, num_slots)``) means no state: zeros are read, nothing is
    written. Request rows are clamped into ``[0, total_tokens]``.

    Args:
        x: [total_tokens, dim] fp16|bf16|fp32, token-major (any strides).
        weight: [dim, width] float. bias: [dim] float or None.
        conv_states: [num_slots, dim, width - 1] float, mutated (addressed slots only).
        query_start_loc: [b + 1] int32 prefix sums of tokens per request.
        cache_indices: [b] int32 state slot per request, -1 for none.
        has_initial_state: [b] bool; False starts the request from zeros.
        activation: ``"silu"`` (or ``"swish"``) or None.
    Returns:
        out [total_tokens, dim] in x's dtype, contiguous.
    Raises:
        TypeError/ValueError: wrong kind, shape, dtype or device, naming the argument; under
            ``xpu_ops.debug_checks()`` also a slot outside ``[-1, num_slots)`` or repeated, or
            ``query_start_loc`` that is not prefix sums of ``total_tokens``.
    Source: Mamba's causal_conv1d (Gu and Dao, arXiv 2312.00752); sglang's varlen form.

    >>> import torch, xpu_ops
    >>> x, w = torch.randn(5, 3), torch.randn(3, 4)
    >>> states = torch.randn(2, 3, 3)
    >>> out = xpu_ops.causal_conv1d_fn(x, w, None, states, torch.tensor([0, 5], dtype=torch.int32),
    ...     torch.tensor([1], dtype=torch.int32), torch.tensor([False]), activation=None)
    >>> ref = torch.nn.functional.conv1d(x.T[None], w[:, None], padding=3, groups=3)[0, :, :5].T
    >>> torch.allclose(out, ref, atol=1e-5), torch.equal(states[1], x[2:].T)
    (True, True)
    """
    check_tensor_args("causal_conv1d_fn", ("bias",), x=x, weight=weight, bias=bias,
                      conv_states=conv_states, query_start_loc=query_start_loc,
                      cache_indices=cache_indices, has_initial_state=has_initial_state)
    check_activation("causal_conv1d_fn", activation)
    debug_check_slots("causal_conv1d_fn", "query_start_loc", query_start_loc, x,
                      "cache_indices", cache_indices, conv_states)
    return torch.ops.xpu_ops.causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc,
                                              cache_indices, has_initial_state, activation)


def _check_causal_conv1d_update(x, conv_state, weight, bias, activation,
                                conv_state_indices) -> None:
    """Validate shapes/dtypes/devices (runs in the fake too)."""
    fn = "causal_conv1d_update"
    check_tensor(fn, "x", x, ndim=(2, 3), dtypes=FLOAT_DTYPES)
    check_conv_weights(fn, x, weight, bias, "conv_state", conv_state)
    batch = x.shape[0]
    if conv_state_indices is not None:
        check_index(fn, "conv_state_indices", conv_state_indices, 1, x.device)
        check_size(fn, "conv_state_indices", conv_state_indices, 0, batch, "x.shape[0] (b)")
    elif conv_state.shape[0] < batch:
        fail(fn, "conv_state", "has fewer slots than requests (request r uses slot r when "
             "conv_state_indices is None)", f"conv_state.shape[0] >= b = {batch}",
             f"shape {tuple(conv_state.shape)}", "Pass conv_state_indices.")
    check_activation(fn, activation)


@define_op("xpu_ops::causal_conv1d_update", mutates_args=("conv_state",), by_device=True)
def causal_conv1d_update_op(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor],
                            activation: Optional[str],
                            conv_state_indices: Optional[Tensor]) -> Tensor:
    """Op form of ``causal_conv1d_update``: returns ``out``, writes the states (the checks);
    inputs that share memory with the states are read as they were before the call."""
    _check_causal_conv1d_update(x, conv_state, weight, bias, activation, conv_state_indices)
    src = snapshot_aliased((conv_state,), (x, weight, bias))
    return None if src is None else (src[0], conv_state, src[1], src[2], activation,
                                     conv_state_indices)


@causal_conv1d_update_op.register_fake
def _(x, conv_state, weight, bias, activation, conv_state_indices):
    _check_causal_conv1d_update(x, conv_state, weight, bias, activation, conv_state_indices)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def causal_conv1d_update(x, conv_state, weight, bias, activation="silu",
                         conv_state_indices=None):
    """Depthwise causal conv1d for decode / target verify: ``s`` new tokens per request.

    Request ``r`` reads its state ``conv_state[conv_state_indices[r]]`` (slot ``r`` when the
    indices are None), convolves its ``s`` tokens in order exactly as ``causal_conv1d_fn`` does
    with an initial state, and writes the last ``width - 1`` inputs back. A slot of -1 (or
    outside ``[0, num_slots)``) reads zeros and writes nothing.

    Args:
        x: [b, dim] (one token each) or [b, s, dim], fp16|bf16|fp32, any strides.
        conv_state: [num_slots, dim, width - 1] float, mutated (addressed slots only).
        weight: [dim, width] float. bias: [dim] float or None.
        activation: ``"silu"`` (or ``"swish"``) or None.
        conv_state_indices: [b] int32 slots, -1 for none; None: request r uses slot r.
    Returns:
        out, x's shape and dtype, contiguous.
    Raises:
        TypeError/ValueError: wrong kind, shape, dtype or device, naming the argument; under
            ``xpu_ops.debug_checks()`` also a slot outside ``[-1, num_slots)`` or repeated.
    Source: Mamba's causal_conv1d_update (Gu and Dao, arXiv 2312.00752).

    >>> import torch, xpu_ops
    >>> state, w = torch.randn(1, 2, 3), torch.randn(2, 4)
    >>> x = torch.randn(1, 2)
    >>> e = torch.cat([state[0], x.T], dim=1)                      # [dim, width]
    >>> out = xpu_ops.causal_conv1d_update(x, state, w, None, activation=None)
    >>> torch.allclose(out[0], (e * w).sum(1), atol=1e-6), torch.equal(state[0], e[:, 1:])
    (True, True)
    """
    check_tensor_args("causal_conv1d_update", ("bias", "conv_state_indices"), x=x,
                      conv_state=conv_state, weight=weight, bias=bias,
                      conv_state_indices=conv_state_indices)
    check_activation("causal_conv1d_update", activation)
    if conv_state_indices is not None:
        debug_check_slots("causal_conv1d_update", "", None, x, "conv_state_indices",
                          conv_state_indices, conv_state)
    return torch.ops.xpu_ops.causal_conv1d_update(x, conv_state, weight, bias, activation,
                                                  conv_state_indices)
