"""Gated delta rule (Gated DeltaNet): ``fused_gdn_gating``, ``chunk_gated_delta_rule`` (extend)
and ``fused_recurrent_gated_delta_rule`` (decode and target verify), flash-linear-attention's
interface over packed requests with a pool of recurrent states.

Per value head ``h`` (reading key head ``h // (Hv // Hk)``) and token ``t`` of a request, with
``k_t``, ``q_t`` L2-normalised when ``use_qk_l2norm_in_kernel`` (``x / sqrt(sum x^2 + 1e-6)``)
and the state ``S [K, V]``::

    S   = exp(g_t) * S
    u_t = beta_t * (v_t - S^T k_t)
    S   = S + k_t u_t^T
    o_t = S^T (scale * q_t)

A request starts from ``ssm_states[cache_indices[r]]`` (chunked form: only where
``has_initial_state[r]``; else zeros) and its final state is written back to that slot. A slot of
-1 (or outside ``[0, num_slots)``) starts from zeros and writes nothing.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .._checks import (FLOAT_DTYPES, check_optional, check_shape, check_size, check_tensor,
                       check_tensor_args, check_writable, fail, int_scalar)
from .._registration import define_op
from .causal_conv1d import debug_check_slots
from .kv_cache import snapshot_aliased
from .common import check_cu_seqlens, check_flag, check_index, finite_scale



# ----------------------------------------------------------------------------------------------
# fused_gdn_gating
# ----------------------------------------------------------------------------------------------

def _check_fused_gdn_gating(A_log, a, dt_bias, b) -> None:
    """Validate shapes/dtypes/devices (runs in the fake too)."""
    fn = "fused_gdn_gating"
    check_tensor(fn, "a", a, ndim=2, dtypes=FLOAT_DTYPES)
    device, num_heads = a.device, a.shape[1]
    check_tensor(fn, "b", b, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_shape(fn, "b", b, a.shape, "a's shape [T, Hv]")
    for arg, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_tensor(fn, arg, t, ndim=1, dtypes=FLOAT_DTYPES, device=device)
        check_size(fn, arg, t, 0, num_heads, "a.shape[1] (Hv)")


@define_op("xpu_ops::fused_gdn_gating", mutates_args=(), by_device=True)
def fused_gdn_gating_op(A_log: Tensor, a: Tensor, dt_bias: Tensor,
                        b: Tensor) -> tuple[Tensor, Tensor]:
    """Op form of ``fused_gdn_gating`` (the checks; the dispatcher then runs the provider)."""
    _check_fused_gdn_gating(A_log, a, dt_bias, b)


@fused_gdn_gating_op.register_fake
def _(A_log, a, dt_bias, b):
    _check_fused_gdn_gating(A_log, a, dt_bias, b)
    return (a.new_empty(a.shape, dtype=torch.float32), a.new_empty(a.shape, dtype=torch.float32))


def fused_gdn_gating(A_log, a, dt_bias, b):
    """Gated DeltaNet's per-token decay and write strength, Qwen3-Next's definition.

    ``g = -exp(A_log) * softplus(a + dt_bias)`` in float32 (softplus with torch's default
    ``beta=1, threshold=20``: ``x`` itself above 20), ``beta = sigmoid(b)`` computed in
    float32 and rounded to b's dtype (what ``b.sigmoid()`` gives), returned as float32.

    Args:
        A_log: [Hv] float, log of the decay rate per value head.
        a: [T, Hv] fp16|bf16|fp32 decay projection. dt_bias: [Hv] float.
        b: [T, Hv] fp16|bf16|fp32 write-strength projection.
    Returns:
        ``(g [T, Hv] float32 (log decay, <= 0), beta [T, Hv] float32)``, contiguous.
    Raises:
        TypeError/ValueError: wrong kind, shape, dtype or device, naming the argument.
    Source: Qwen3-Next's ``Qwen3NextGatedDeltaNet`` (transformers); Gated DeltaNet (Yang et al.,
    arXiv 2412.06464).

    >>> import torch, xpu_ops
    >>> A_log, dt_bias, a, b = torch.randn(4), torch.randn(4), torch.randn(3, 4), torch.randn(3, 4)
    >>> g, beta = xpu_ops.fused_gdn_gating(A_log, a, dt_bias, b)
    >>> sp = torch.nn.functional.softplus(a + dt_bias)
    >>> torch.allclose(g, -A_log.exp() * sp), torch.allclose(beta, b.sigmoid())
    (True, True)
    """
    check_tensor_args("fused_gdn_gating", A_log=A_log, a=a, dt_bias=dt_bias, b=b)
    return torch.ops.xpu_ops.fused_gdn_gating(A_log, a, dt_bias, b)


# ----------------------------------------------------------------------------------------------
# Checks shared by the chunked and the recurrent form
# ----------------------------------------------------------------------------------------------

def _check_qkv_gates(fn: str, q, k, v, g, beta) -> None:
    """``q, k [T, Hk, K]``, ``v [T, Hv, V]`` one float dtype, ``Hv % Hk == 0``, ``g [T, Hv]``
    float32, ``beta [T, Hv]`` float."""
    check_tensor(fn, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    device = q.device
    check_tensor(fn, "k", k, ndim=3, dtypes=(q.dtype,), device=device)
    check_shape(fn, "k", k, q.shape, "q's shape [T, Hk, K]")
    check_tensor(fn, "v", v, ndim=3, dtypes=(q.dtype,), device=device)
    check_size(fn, "v", v, 0, q.shape[0], "q.shape[0] (T)")
    num_k_heads, num_v_heads = q.shape[1], v.shape[1]
    if num_k_heads == 0 or num_v_heads % num_k_heads != 0:
        fail(fn, "q/v head counts", "are incompatible",
             "Hk >= 1 and Hv a multiple of Hk (value head h reads key head h // (Hv // Hk))",
             f"Hk={num_k_heads}, Hv={num_v_heads}")
    rows = (q.shape[0], num_v_heads)
    check_tensor(fn, "g", g, ndim=2, dtypes=(torch.float32,), device=device)
    check_shape(fn, "g", g, rows, "[T, Hv]")
    check_tensor(fn, "beta", beta, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_shape(fn, "beta", beta, rows, "[T, Hv]")


def _check_states(fn: str, q, v, ssm_states, cache_indices, cu_seqlens,
                  writes: bool = True) -> int:
    """``ssm_states [num_slots, Hv, K, V]`` float32 (not expanded when ``writes``),
    ``cache_indices [b]`` and ``cu_seqlens [b + 1]`` int32; returns ``b``."""
    device = q.device
    check_tensor(fn, "ssm_states", ssm_states, ndim=4, dtypes=(torch.float32,), device=device)
    check_size(fn, "ssm_states", ssm_states, 1, v.shape[1], "v.shape[1] (Hv)")
    check_size(fn, "ssm_states", ssm_states, 2, q.shape[2], "q.shape[2] (K)")
    check_size(fn, "ssm_states", ssm_states, 3, v.shape[2], "v.shape[2] (V)")
    if writes:
        check_writable(fn, "ssm_states", ssm_states, "each slot its own state; the op writes it")
    check_index(fn, "cache_indices", cache_indices, 1, device)
    batch = cache_indices.shape[0]
    check_cu_seqlens(fn, "cu_seqlens", cu_seqlens, batch, device)
    return batch


def _check_scale(fn: str, scale: float) -> None:
    if not -math.inf < scale < math.inf:  # a comparison Dynamo traces; False for NaN
        finite_scale(fn, "scale", scale)


# ----------------------------------------------------------------------------------------------
# chunk_gated_delta_rule (extend)
# ----------------------------------------------------------------------------------------------

def _check_chunk_gated_delta_rule(q, k, v, g, beta, scale, ssm_states, cache_indices,
                                  has_initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                                  chunk_size) -> None:
    """Validate shapes/dtypes/devices and scalars (runs in the fake too)."""
    fn = "chunk_gated_delta_rule"
    _check_qkv_gates(fn, q, k, v, g, beta)
    batch = _check_states(fn, q, v, ssm_states, cache_indices, cu_seqlens)
    check_tensor(fn, "has_initial_state", has_initial_state, ndim=1, dtypes=(torch.bool,),
                 device=q.device)
    check_size(fn, "has_initial_state", has_initial_state, 0, batch, "cache_indices.shape[0] (b)")
    _check_scale(fn, scale)
    if chunk_size < 1:
        fail(fn, "chunk_size", "is not positive", "an int >= 1 (tokens per chunk)", chunk_size)


@define_op("xpu_ops::chunk_gated_delta_rule", mutates_args=("ssm_states",), by_device=True)
def chunk_gated_delta_rule_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                              scale: float, ssm_states: Tensor, cache_indices: Tensor,
                              has_initial_state: Tensor, cu_seqlens: Tensor,
                              use_qk_l2norm_in_kernel: bool, chunk_size: int) -> Tensor:
    """Op form of ``chunk_gated_delta_rule``: returns ``o``, writes the final states; inputs
    that share memory with the states are read as they were before the call."""
    _check_chunk_gated_delta_rule(q, k, v, g, beta, scale, ssm_states, cache_indices,
                                  has_initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                                  chunk_size)
    src = snapshot_aliased((ssm_states,), (q, k, v, g, beta))
    return None if src is None else (*src, scale, ssm_states, cache_indices, has_initial_state,
                                     cu_seqlens, use_qk_l2norm_in_kernel, chunk_size)


@chunk_gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, scale, ssm_states, cache_indices, has_initial_state, cu_seqlens,
      use_qk_l2norm_in_kernel, chunk_size):
    _check_chunk_gated_delta_rule(q, k, v, g, beta, scale, ssm_states, cache_indices,
                                  has_initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                                  chunk_size)
    return torch.empty_like(v, memory_format=torch.contiguous_format)


def _scalars(fn: str, q, scale, use_qk_l2norm_in_kernel) -> tuple[float, bool]:
    """``scale`` (None: ``K ** -0.5``) as a finite float and the L2-norm flag as a bool."""
    if scale is None:
        check_tensor(fn, "q", q, ndim=3)
        scale = 1.0 / math.sqrt(q.shape[2]) if q.shape[2] else 1.0
    return (finite_scale(fn, "scale", scale),
            check_flag(fn, "use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel))


def chunk_gated_delta_rule(q, k, v, g, beta, scale, ssm_states, cache_indices, has_initial_state,
                           cu_seqlens, use_qk_l2norm_in_kernel=True, chunk_size=64):
    """Gated delta rule over packed requests (extend / prefill), chunked form.

    Computes the recurrence of the module docstring for every request ``r`` (tokens
    ``[cu_seqlens[r], cu_seqlens[r + 1])``, clamped into ``[0, T]``), in chunks of
    ``chunk_size`` tokens (the UT/WY form: one triangular solve per chunk); the result does
    not depend on ``chunk_size`` beyond rounding. Float32 accumulation.

    Args:
        q, k: [T, Hk, K] fp16|bf16|fp32. v: [T, Hv, V], q's dtype, ``Hv % Hk == 0``.
        g: [T, Hv] float32 log decay (<= 0). beta: [T, Hv] float.
        scale: multiplier of q (float; None: ``K ** -0.5``).
        ssm_states: [num_slots, Hv, K, V] float32, mutated: addressed slots get final states.
        cache_indices: [b] int32 slot per request, -1 for none.
        has_initial_state: [b] bool; False starts from zeros (the slot is still written).
        cu_seqlens: [b + 1] int32 prefix sums of tokens per request.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head first (eps 1e-6).
        chunk_size: tokens per chunk (>= 1; a speed choice).
    Returns:
        o [T, Hv, V] in v's dtype, contiguous (rows no request covers are 0).
    Raises:
        TypeError/ValueError: wrong kind, shape, dtype, device or scalar, naming the argument;
            under ``xpu_ops.debug_checks()`` also a slot outside ``[-1, num_slots)`` or
            repeated, ``cu_seqlens`` that are not prefix sums of ``T`` (and, for the
            recurrent form, a request longer than ``intermediate_states``' steps).
    Source: Gated DeltaNet (Yang, Kautz and Hatamizadeh, arXiv 2412.06464); the chunked UT form
    of DeltaNet (Yang et al., arXiv 2406.06484); flash-linear-attention's interface.

    >>> import torch, xpu_ops
    >>> q, k, v = torch.randn(3, 1, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 2)
    >>> g, beta = -torch.rand(3, 1), torch.rand(3, 1)
    >>> states, one = torch.zeros(1, 1, 4, 2), torch.tensor([0], dtype=torch.int32)
    >>> cu = torch.tensor([0, 3], dtype=torch.int32)
    >>> o = xpu_ops.chunk_gated_delta_rule(q, k, v, g, beta, 0.5, states, one,
    ...     torch.tensor([False]), cu, use_qk_l2norm_in_kernel=False, chunk_size=2)
    >>> S = torch.zeros(4, 2)
    >>> for t in range(3):
    ...     S = S * g[t].exp(); S = S + torch.outer(k[t, 0], beta[t] * (v[t, 0] - S.T @ k[t, 0]))
    >>> torch.allclose(o[2, 0], S.T @ (0.5 * q[2, 0]), atol=1e-5), torch.allclose(states[0, 0], S, atol=1e-5)
    (True, True)
    """
    fn = "chunk_gated_delta_rule"
    check_tensor_args(fn, q=q, k=k, v=v, g=g, beta=beta, ssm_states=ssm_states,
                      cache_indices=cache_indices, has_initial_state=has_initial_state,
                      cu_seqlens=cu_seqlens)
    scale, l2norm = _scalars(fn, q, scale, use_qk_l2norm_in_kernel)
    chunk_size = int_scalar(fn, "chunk_size", chunk_size, "an int >= 1 (tokens per chunk)")
    debug_check_slots(fn, "cu_seqlens", cu_seqlens, q, "cache_indices", cache_indices, ssm_states)
    return torch.ops.xpu_ops.chunk_gated_delta_rule(q, k, v, g, beta, scale, ssm_states,
                                                    cache_indices, has_initial_state, cu_seqlens,
                                                    l2norm, chunk_size)


# ----------------------------------------------------------------------------------------------
# fused_recurrent_gated_delta_rule (decode, target verify)
# ----------------------------------------------------------------------------------------------

def _check_fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, ssm_states, cache_indices,
                                            cu_seqlens, use_qk_l2norm_in_kernel,
                                            intermediate_states, disable_state_update) -> None:
    """Validate shapes/dtypes/devices and scalars (runs in the fake too)."""
    fn = "fused_recurrent_gated_delta_rule"
    _check_qkv_gates(fn, q, k, v, g, beta)
    batch = _check_states(fn, q, v, ssm_states, cache_indices, cu_seqlens,
                          writes=not disable_state_update)
    _check_scale(fn, scale)
    check_optional(fn, "intermediate_states", intermediate_states, ndim=5,
                   dtypes=(torch.float32,), device=q.device)
    if intermediate_states is None:
        return
    check_writable(fn, "intermediate_states", intermediate_states)
    if intermediate_states.shape[0] < batch:
        fail(fn, "intermediate_states", "has fewer rows than requests (request r writes row r)",
             f"intermediate_states.shape[0] >= b = {batch}",
             f"shape {tuple(intermediate_states.shape)}")
    for dim, size, rule in ((2, v.shape[1], "v.shape[1] (Hv)"), (3, q.shape[2], "q.shape[2] (K)"),
                            (4, v.shape[2], "v.shape[2] (V)")):
        check_size(fn, "intermediate_states", intermediate_states, dim, size, rule)


@define_op("xpu_ops::fused_recurrent_gated_delta_rule",
           mutates_args=("ssm_states", "intermediate_states"), by_device=True)
def fused_recurrent_gated_delta_rule_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                                        scale: float, ssm_states: Tensor, cache_indices: Tensor,
                                        cu_seqlens: Tensor, use_qk_l2norm_in_kernel: bool,
                                        intermediate_states: Optional[Tensor],
                                        disable_state_update: bool) -> Tensor:
    """Op form of ``fused_recurrent_gated_delta_rule``: returns ``o``, writes the states;
    inputs that share memory with the states are read as they were before the call."""
    _check_fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, ssm_states, cache_indices,
                                            cu_seqlens, use_qk_l2norm_in_kernel,
                                            intermediate_states, disable_state_update)
    src = snapshot_aliased((ssm_states, intermediate_states), (q, k, v, g, beta))
    return None if src is None else (*src, scale, ssm_states, cache_indices, cu_seqlens,
                                     use_qk_l2norm_in_kernel, intermediate_states,
                                     disable_state_update)


@fused_recurrent_gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, scale, ssm_states, cache_indices, cu_seqlens, use_qk_l2norm_in_kernel,
      intermediate_states, disable_state_update):
    _check_fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, ssm_states, cache_indices,
                                            cu_seqlens, use_qk_l2norm_in_kernel,
                                            intermediate_states, disable_state_update)
    return torch.empty_like(v, memory_format=torch.contiguous_format)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, ssm_states, cache_indices,
                                     cu_seqlens, use_qk_l2norm_in_kernel=True,
                                     intermediate_states=None, disable_state_update=False):
    """Gated delta rule token by token: decode (one token per request) and target verify.

    Runs the recurrence of the module docstring for every request ``r`` (tokens
    ``[cu_seqlens[r], cu_seqlens[r + 1])``, clamped into ``[0, T]``), starting from
    ``ssm_states[cache_indices[r]]`` (zeros for slot -1). With ``intermediate_states``, the
    state after the request's ``i``-th token is written to ``intermediate_states[r, i]`` (row
    ``r`` = the request's index in the batch, as sglang's verify scratch), so a rejected draft
    rolls back to the state after its last accepted token; steps ``i >= max_steps`` are not
    kept. ``disable_state_update=True`` leaves ``ssm_states`` untouched.

    Args:
        q, k: [T, Hk, K] fp16|bf16|fp32. v: [T, Hv, V], q's dtype, ``Hv % Hk == 0``.
        g: [T, Hv] float32 log decay (<= 0). beta: [T, Hv] float.
        scale: multiplier of q (float; None: ``K ** -0.5``).
        ssm_states: [num_slots, Hv, K, V] float32, mutated unless ``disable_state_update``.
        cache_indices: [b] int32 slot per request, -1 for none.
        cu_seqlens: [b + 1] int32 prefix sums of tokens per request.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head first (eps 1e-6).
        intermediate_states: None or [rows >= b, max_steps, Hv, K, V] float32, mutated.
        disable_state_update: keep ``ssm_states`` as they are.
    Returns:
        o [T, Hv, V] in v's dtype, contiguous (rows no request covers are 0).
    Raises:
        TypeError/ValueError: wrong kind, shape, dtype, device or scalar, naming the argument;
            under ``xpu_ops.debug_checks()`` also a slot outside ``[-1, num_slots)`` or
            repeated, ``cu_seqlens`` that are not prefix sums of ``T`` (and, for the
            recurrent form, a request longer than ``intermediate_states``' steps).
    Source: Gated DeltaNet (Yang, Kautz and Hatamizadeh, arXiv 2412.06464);
    flash-linear-attention's ``fused_recurrent_gated_delta_rule``; sglang's verify scratch.

    >>> import torch, xpu_ops
    >>> q, k, v = torch.randn(2, 1, 4), torch.randn(2, 1, 4), torch.randn(2, 2, 3)
    >>> g, beta = -torch.rand(2, 2), torch.rand(2, 2)
    >>> states = torch.randn(3, 2, 4, 3); before = states.clone()
    >>> o = xpu_ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta, 1.0, states,
    ...     torch.tensor([2, -1], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32),
    ...     use_qk_l2norm_in_kernel=False)
    >>> S = before[2, 1] * g[0, 1].exp()
    >>> S = S + torch.outer(k[0, 0], beta[0, 1] * (v[0, 1] - S.T @ k[0, 0]))
    >>> torch.allclose(o[0, 1], S.T @ q[0, 0], atol=1e-5), torch.equal(states[:2], before[:2])
    (True, True)
    """
    fn = "fused_recurrent_gated_delta_rule"
    check_tensor_args(fn, ("intermediate_states",), q=q, k=k, v=v, g=g, beta=beta,
                      ssm_states=ssm_states, cache_indices=cache_indices, cu_seqlens=cu_seqlens,
                      intermediate_states=intermediate_states)
    scale, l2norm = _scalars(fn, q, scale, use_qk_l2norm_in_kernel)
    disable = check_flag(fn, "disable_state_update", disable_state_update)
    steps = (intermediate_states.shape[1] if intermediate_states is not None
             and intermediate_states.dim() > 1 else None)
    debug_check_slots(fn, "cu_seqlens", cu_seqlens, q, "cache_indices", cache_indices, ssm_states,
                      steps)
    return torch.ops.xpu_ops.fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, scale, ssm_states, cache_indices, cu_seqlens, l2norm,
        intermediate_states, disable)
