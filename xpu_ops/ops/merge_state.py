"""``merge_state_v2`` and ``merge_state``: combine two partial attention results by their LSE.

Used by cascade attention (shared prefix pass + per-draft expand pass) and split-KV reductions.
The ops ``torch.ops.xpu_ops.merge_state_v2`` (natural-log LSE, sglang's) and
``torch.ops.xpu_ops.merge_state`` (base-2 LSE, FlashInfer's and sgl-kernel's v1) write
``v_merged``/``s_merged`` (both mutated); the public wrappers allocate them when the caller gives
none and read an LSE of another float dtype as float32, as sgl-kernel's wrappers do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._registration import define_op
from .._checks import (FLOAT_DTYPES, all_dense_on, check_shape, check_tensor, check_tensor_args,
                       tensors_or_none)

NAME = "merge_state_v2"
NAME_V1 = "merge_state"


def _check_merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged, fn: str = NAME) -> None:
    """Validate shapes/dtypes/devices (runs in the fake too); ``fn`` names the op in errors."""
    check_tensor(fn, "v_a", v_a, ndim=3, dtypes=FLOAT_DTYPES)
    device = v_a.device
    num_tokens, num_heads, _ = v_a.shape
    check_tensor(fn, "v_b", v_b, ndim=3, dtypes=(v_a.dtype,), device=device)
    check_shape(fn, "v_b", v_b, v_a.shape, "v_a's shape [N, H, D]")
    check_tensor(fn, "v_merged", v_merged, ndim=3, dtypes=(v_a.dtype,), device=device)
    check_shape(fn, "v_merged", v_merged, v_a.shape, "v_a's shape [N, H, D]")
    for arg, s in (("s_a", s_a), ("s_b", s_b), ("s_merged", s_merged)):
        check_tensor(fn, arg, s, ndim=2, dtypes=(torch.float32,), device=device)
        check_shape(fn, arg, s, (num_tokens, num_heads), "[N, H]")


def _is_plain_valid_merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged) -> bool:
    """True when ``_check_merge_state_v2`` accepts the call: attribute reads and integer
    comparisons only; False sends the call through the full checks, which name what is wrong."""
    dtype, shape, f32 = v_a.dtype, v_a.shape, torch.float32
    return (dtype in FLOAT_DTYPES and v_b.dtype is dtype and v_merged.dtype is dtype
            and s_a.dtype is f32 and s_b.dtype is f32 and s_merged.dtype is f32
            and len(shape) == 3 and v_b.shape == shape and v_merged.shape == shape
            and s_a.shape == shape[:2] and s_b.shape == shape[:2] and s_merged.shape == shape[:2]
            and all_dense_on(v_a.device, (v_b, v_merged, s_a, s_b, s_merged, v_a)))


@define_op("xpu_ops::merge_state_v2", mutates_args=("v_merged", "s_merged"), by_device=True)
def merge_state_v2_op(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor, v_merged: Tensor,
                      s_merged: Tensor) -> None:
    """Op form of ``merge_state_v2``: writes ``v_merged`` and ``s_merged`` in place."""
    if not _is_plain_valid_merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged):
        _check_merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged)


@merge_state_v2_op.register_fake
def _(v_a, s_a, v_b, s_b, v_merged, s_merged):
    _check_merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged)


def merge_state_v2(v_a, s_a, v_b, s_b, v_merged=None, s_merged=None):
    """Merge two attention states over disjoint key sets (sgl-kernel ``merge_state_v2``).

    ``m = max(s_a, s_b)``, ``w = e^(s - m)``, ``v = (w_a v_a + w_b v_b) / (w_a + w_b)``,
    ``s = m + ln(w_a + w_b)``. A side with LSE ``-inf`` or ``+inf`` is empty and contributes
    nothing (the other state is returned bit-exactly); both empty gives ``(0, -inf)``, never NaN.
    ``+inf`` is how FlashAttention kernels report a row with no visible key.

    Args:
        v_a, v_b: [N, H, D] fp16|bf16|fp32 partial outputs (each normalised over its own keys).
        s_a, s_b: [N, H] float32 natural-log LSE of each part (transpose the ``[H, N]`` LSE that
            the attention ops return); ``-inf`` or ``+inf`` marks an empty part.
        v_merged, s_merged: optional outputs ``[N, H, D]`` / ``[N, H]``, written in place.
    Returns:
        ``(v_merged [N, H, D], s_merged [N, H] float32)``.
    Raises:
        TypeError/ValueError: wrong kind, shape, dtype or device, naming the argument.
    Source: FlashInfer's ``merge_state`` (cascade inference, Ye et al., 2024); FlashAttention-2
    online softmax rescaling.

    >>> import torch, xpu_ops
    >>> v_a, v_b = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    >>> s_a, s_b = torch.randn(3, 2), torch.randn(3, 2)
    >>> v, s = xpu_ops.merge_state_v2(v_a, s_a, v_b, s_b)
    >>> w = torch.stack([s_a, s_b]).softmax(0)[..., None]
    >>> torch.allclose(v, w[0] * v_a + w[1] * v_b, atol=1e-6), torch.allclose(s, torch.logaddexp(s_a, s_b))
    (True, True)
    >>> v, s = xpu_ops.merge_state_v2(v_a, torch.full_like(s_a, float("inf")), v_b, s_b)
    >>> torch.equal(v, v_b), torch.equal(s, s_b)
    (True, True)
    """
    return _merge(torch.ops.xpu_ops.merge_state_v2, NAME, v_a, s_a, v_b, s_b, v_merged,
                  s_merged)


def _merge(op, fn: str, v_a, s_a, v_b, s_b, v_merged, s_merged):
    """The public wrappers' part: type checks, LSEs of another float dtype read as float32 (as
    sgl-kernel's wrappers do), outputs allocated when not given, then ``op``."""
    if not tensors_or_none((v_a, s_a, v_b, s_b), (v_merged, s_merged)):
        check_tensor_args(fn, ("v_merged", "s_merged"), v_a=v_a, s_a=s_a, v_b=v_b, s_b=s_b,
                          v_merged=v_merged, s_merged=s_merged)
    s_a, s_b = (s.to(torch.float32) if s.dtype in FLOAT_DTYPES[:2] + (torch.float64,) else s
                for s in (s_a, s_b))
    if v_merged is None or s_merged is None:  # allocated like v_a and s_a: name a bad one
        check_tensor(fn, "v_a", v_a, ndim=3)
        check_tensor(fn, "s_a", s_a, ndim=2)
    if v_merged is None:
        v_merged = torch.empty_like(v_a, memory_format=torch.contiguous_format)
    if s_merged is None:
        s_merged = torch.empty_like(s_a, memory_format=torch.contiguous_format)
    op(v_a, s_a, v_b, s_b, v_merged, s_merged)
    return v_merged, s_merged


@define_op("xpu_ops::merge_state", mutates_args=("v_merged", "s_merged"), by_device=True)
def merge_state_op(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor, v_merged: Tensor,
                   s_merged: Tensor) -> None:
    """Op form of ``merge_state`` (base-2 LSE): writes ``v_merged`` and ``s_merged`` in place."""
    if not _is_plain_valid_merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged):
        _check_merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged, NAME_V1)


@merge_state_op.register_fake
def _(v_a, s_a, v_b, s_b, v_merged, s_merged):
    _check_merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged, NAME_V1)


def merge_state(v_a, s_a, v_b, s_b, v_merged=None, s_merged=None):
    """Merge two attention states whose LSEs are in base 2 (sgl-kernel / FlashInfer
    ``merge_state``, the v1 contract).

    ``m = max(s_a, s_b)``, ``w = 2^(s - m)``, ``v = (w_a v_a + w_b v_b) / (w_a + w_b)``,
    ``s = m + log2(w_a + w_b)``: ``merge_state_v2`` with every LSE in log2 units. Empty sides
    (LSE ``-inf`` or ``+inf``) as in ``merge_state_v2``: they contribute nothing; both empty gives
    ``(0, -inf)``.

    Args:
        v_a, v_b: [N, H, D] fp16|bf16|fp32 partial outputs.
        s_a, s_b: [N, H] base-2 LSE (float32; another float dtype is read as float32).
        v_merged, s_merged: optional outputs ``[N, H, D]`` / ``[N, H]`` float32, written in place.
    Returns:
        ``(v_merged [N, H, D], s_merged [N, H] float32)``.
    Raises:
        TypeError/ValueError (also RuntimeError): wrong kind, shape, dtype or device, naming the
        argument.
    Source: FlashInfer's ``merge_state`` (cascade inference, Ye et al., 2024).

    >>> import torch, xpu_ops
    >>> v_a, v_b = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    >>> s_a, s_b = torch.randn(3, 2), torch.randn(3, 2)
    >>> v, s = xpu_ops.merge_state(v_a, s_a, v_b, s_b)
    >>> w_a = 1 / (1 + 2 ** (s_b - s_a))
    >>> torch.allclose(v, w_a[..., None] * v_a + (1 - w_a[..., None]) * v_b, atol=1e-6)
    True
    >>> torch.allclose(s, torch.log2(2 ** s_a + 2 ** s_b))
    True
    """
    return _merge(torch.ops.xpu_ops.merge_state, NAME_V1, v_a, s_a, v_b, s_b, v_merged, s_merged)
