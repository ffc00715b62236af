"""sgl-kernel-xpu's channel-first causal conv1d (``sgl_kernel.causal_conv1d_fn_xpu`` and
``causal_conv1d_update_xpu``, its ``python/sgl_kernel/mamba.py``) on xpu-ops' token-major
``causal_conv1d_fn`` / ``causal_conv1d_update`` (no new math here).

sgl-kernel-xpu's layouts and contract (``src/sycl/causal_conv1d.cpp``):

* ``x`` is channel-first and the output is written into it (the functions return ``x``):
  ``[batch, dim, seqlen]``, or ``[dim, total_tokens]`` with ``query_start_loc`` (requests
  packed along the last dimension); ``causal_conv1d_update_xpu`` takes ``[batch, dim]`` (one
  token each) or ``[batch, dim, seqlen]``.
* States are ``[num_slots, dim, width - 1]`` (xpu-ops' pool layout). Request ``r`` uses slot
  ``cache_indices[r]`` (``conv_state_indices[r]``), or slot ``r`` when those are None. A
  request whose slot equals ``pad_slot_id`` is not processed: its output rows and its state are
  left as they are.
* ``causal_conv1d_fn_xpu``: without ``conv_states`` no state is read or written; with them a
  request starts from its slot when ``has_initial_state[r]`` (None: from zeros) and its last
  ``width - 1`` inputs are written back.
* ``activation`` ``"silu"`` / ``"swish"`` applies SiLU, None the identity.

Not served (ValueError): ``causal_conv1d_update_xpu``'s circular-buffer states
(``cache_seqlens``, or a state longer than ``width - 1``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._checks import check_tensor, check_tensor_args, fail, int_scalar
from .ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update, check_activation
from .ops.kvcache_layout import uniform_cu_seqlens

FN, UPDATE = "causal_conv1d_fn_xpu", "causal_conv1d_update_xpu"


def _slots(fn: str, arg: str, given, batch: int, pad_slot_id: int, device) -> tuple[Tensor, Tensor]:
    """``(slots, processed)``: each request's slot (request ``r``: ``r`` when ``given`` is None)
    with padded ones as -1, and which requests are processed (slot != ``pad_slot_id``)."""
    if given is None:
        slots = torch.arange(batch, dtype=torch.int32, device=device)
    else:
        check_tensor(fn, arg, given, ndim=1, dtypes=(torch.int32,), device=device)
        if given.shape[0] != batch:
            fail(fn, arg, "has the wrong length", f"one slot per request ({batch})",
                 f"shape {tuple(given.shape)}")
        slots = given
    processed = slots != pad_slot_id
    return torch.where(processed, slots, -1), processed


def _write_back(x: Tensor, out: Tensor, processed_rows: Tensor) -> None:
    """``x[rows] = out[rows]`` where ``processed_rows`` (x's leading-dimension mask)."""
    mask = processed_rows.view(-1, *([1] * (x.dim() - 1)))
    x.copy_(torch.where(mask, out, x))


def causal_conv1d_fn_xpu(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                         conv_states: Optional[Tensor] = None,
                         query_start_loc: Optional[Tensor] = None,
                         cache_indices: Optional[Tensor] = None,
                         has_initial_state: Optional[Tensor] = None,
                         activation: Optional[str] = "silu", pad_slot_id: int = -1,
                         **kwargs) -> Tensor:
    """sgl-kernel-xpu's ``causal_conv1d_fn_xpu``: depthwise causal conv1d over requests,
    written into ``x`` (contract: the module docstring).

    Args:
        x: ``[batch, dim, seqlen]``, or ``[dim, total_tokens]`` with ``query_start_loc``;
            fp16|bf16|fp32 (mutated: the output).
        weight: ``[dim, width]``. bias: ``[dim]`` or None.
        conv_states: ``[num_slots, dim, width - 1]`` or None (mutated: addressed slots).
        query_start_loc: int32 ``[batch + 1]`` prefix sums of the tokens, or None.
        cache_indices: int32 ``[batch]`` slots, or None (request r: slot r).
        has_initial_state: bool ``[batch]`` or None (every request from zeros).
        activation: ``"silu"``/``"swish"`` or None. pad_slot_id: the slot value that skips a
            request. Other keywords are ignored (as sgl-kernel-xpu's wrapper does).
    Returns:
        ``x``.
    Raises:
        TypeError/ValueError naming the argument; nothing is written then.
    Source: sgl-kernel-xpu ``python/sgl_kernel/mamba.py`` and ``src/sycl/causal_conv1d.cpp``.
    """
    check_tensor_args(FN, ("bias", "conv_states", "query_start_loc", "cache_indices",
                           "has_initial_state"), x=x, weight=weight, bias=bias,
                      conv_states=conv_states, query_start_loc=query_start_loc,
                      cache_indices=cache_indices, has_initial_state=has_initial_state)
    check_activation(FN, activation)
    pad = int_scalar(FN, "pad_slot_id", pad_slot_id)
    varlen = query_start_loc is not None
    check_tensor(FN, "x", x, ndim=2 if varlen else 3)
    if varlen:
        check_tensor(FN, "query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,),
                     device=x.device)
        batch, tokens = query_start_loc.shape[0] - 1, x.T                       # [T, dim]
    else:
        batch, seqlen = x.shape[0], x.shape[2]
        tokens = x.transpose(1, 2).reshape(-1, x.shape[1])
        query_start_loc = uniform_cu_seqlens(x, batch, seqlen)
    slots, processed = _slots(FN, "cache_indices", cache_indices, max(batch, 0), pad, x.device)
    if conv_states is None:             # no state: a stand-in pool no request addresses
        width = weight.shape[-1] if weight.dim() == 2 else 1
        conv_states = x.new_empty((1, tokens.shape[-1], max(width - 1, 0)))
        slots = torch.full_like(slots, -1)
    initial = (torch.zeros(slots.shape[0], dtype=torch.bool, device=x.device)
               if has_initial_state is None else has_initial_state)
    out = causal_conv1d_fn(tokens, weight, bias, conv_states, query_start_loc, slots, initial,
                           activation)
    if not varlen:
        _write_back(x, out.view(batch, seqlen, x.shape[1]).transpose(1, 2), processed)
    elif batch > 0:                     # a token is written when its request is processed
        owner = torch.searchsorted(query_start_loc[1:], torch.arange(
            tokens.shape[0], dtype=torch.int32, device=x.device), right=True)
        _write_back(tokens, out, (owner < batch) & processed[owner.clamp(max=batch - 1)])
    return x


def causal_conv1d_update_xpu(x: Tensor, conv_state: Tensor, weight: Tensor,
                             bias: Optional[Tensor] = None, activation: Optional[str] = None,
                             cache_seqlens: Optional[Tensor] = None,
                             conv_state_indices: Optional[Tensor] = None,
                             pad_slot_id: int = -1) -> Tensor:
    """sgl-kernel-xpu's ``causal_conv1d_update_xpu``: ``seqlen`` new tokens per request on
    their conv state, written into ``x`` (contract: the module docstring).

    Args:
        x: ``[batch, dim]`` or ``[batch, dim, seqlen]`` fp16|bf16|fp32 (mutated: the output).
        conv_state: ``[num_slots, dim, width - 1]`` (mutated: addressed slots).
        weight: ``[dim, width]``. bias: ``[dim]`` or None.
        activation: ``"silu"``/``"swish"`` or None.
        cache_seqlens: None (circular-buffer states are not served).
        conv_state_indices: int32 ``[batch]`` slots, or None (request r: slot r).
        pad_slot_id: the slot value that skips a request.
    Returns:
        ``x`` (its input shape).
    Raises:
        TypeError/ValueError naming the argument; nothing is written then.
    Source: sgl-kernel-xpu ``python/sgl_kernel/mamba.py`` and ``src/sycl/causal_conv1d.cpp``.
    """
    check_tensor_args(UPDATE, ("bias", "cache_seqlens", "conv_state_indices"), x=x,
                      conv_state=conv_state, weight=weight, bias=bias,
                      cache_seqlens=cache_seqlens, conv_state_indices=conv_state_indices)
    check_activation(UPDATE, activation)
    pad = int_scalar(UPDATE, "pad_slot_id", pad_slot_id)
    if cache_seqlens is not None:
        fail(UPDATE, "cache_seqlens", "is given", "None (circular-buffer conv states are not "
             "served by xpu-ops' shim)", f"shape {tuple(cache_seqlens.shape)}")
    check_tensor(UPDATE, "x", x, ndim=(2, 3))
    x3 = x.unsqueeze(-1) if x.dim() == 2 else x
    slots, processed = _slots(UPDATE, "conv_state_indices", conv_state_indices, x3.shape[0],
                              pad, x.device)
    out = causal_conv1d_update(x3.transpose(1, 2), conv_state, weight, bias, activation, slots)
    _write_back(x3, out.transpose(1, 2), processed)
    return x


__all__ = ["causal_conv1d_fn_xpu", "causal_conv1d_update_xpu"]
