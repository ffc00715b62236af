"""``apply_rotary_emb``: rotary position embedding of per-token rows, FlashAttention's convention.

``flash_attn_with_kvcache`` rotates its appended keys and its queries with this op before it
writes the cache and attends (FlashAttention-3 does both inside one kernel). The op returns a new
tensor; the input is never modified.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import FLOAT_DTYPES, check_size, check_tensor, check_tensor_args, fail
from .._registration import define_op
from .common import check_flag, check_index

NAME = "apply_rotary_emb"


def _check_apply_rotary_emb(x, cos, sin, positions) -> None:
    """Validate shapes/dtypes/devices (runs in the fake too)."""
    fn = NAME
    check_tensor(fn, "x", x, ndim=3, dtypes=FLOAT_DTYPES)
    device = x.device
    check_tensor(fn, "cos", cos, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_tensor(fn, "sin", sin, ndim=2, dtypes=(cos.dtype,), device=device)
    if sin.shape != cos.shape:
        for dim in (0, 1):
            check_size(fn, "sin", sin, dim, cos.shape[dim], f"cos.shape[{dim}]")
    if 2 * cos.shape[1] > x.shape[2]:
        fail(fn, "cos", "has more columns than half the head dim",
             f"cos.shape[1] (rotary_dim / 2) <= x.shape[2] / 2 = {x.shape[2] // 2}",
             cos.shape[1], "Pass cos/sin of shape [seqlen_ro, rotary_dim / 2].")
    check_index(fn, "positions", positions, 1, device)
    check_size(fn, "positions", positions, 0, x.shape[0], "x.shape[0] (N)")


@define_op("xpu_ops::apply_rotary_emb", mutates_args=(), by_device=True)
def apply_rotary_emb_op(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, *,
                        interleaved: bool) -> Tensor:
    """Op form of ``apply_rotary_emb``: returns the rotated copy of ``x`` (the checks; the
    dispatcher then runs the provider of x's device)."""
    _check_apply_rotary_emb(x, cos, sin, positions)


@apply_rotary_emb_op.register_fake
def _(x, cos, sin, positions, *, interleaved):
    _check_apply_rotary_emb(x, cos, sin, positions)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def apply_rotary_emb(x, cos, sin, positions, *, interleaved=False):
    """Rotate the first ``rotary_dim = 2 * cos.shape[1]`` features of every row of ``x``.

    Token ``t`` at position ``p = positions[t]`` (a row of ``cos``/``sin``) has its feature
    pairs ``(x1, x2)`` mapped to ``(x1 cos - x2 sin, x1 sin + x2 cos)`` with the angle of pair
    ``i`` being ``cos[p, i]``/``sin[p, i]``. NeoX style (``interleaved=False``) pairs feature
    ``i`` with ``i + rotary_dim / 2``; GPT-J style (``interleaved=True``) pairs ``2i`` with
    ``2i + 1``. Features past ``rotary_dim`` are copied. Computed in float32.

    Args:
        x: [N, H, D] fp16|bf16|fp32 (query or key rows; any strides).
        cos, sin: [seqlen_ro, rotary_dim / 2] float tables (``rotary_dim <= D``, even).
        positions: [N] int32 row of the tables per token, in ``[0, seqlen_ro)`` (a position
            outside is clamped into range, never read out of bounds).
        interleaved: pair layout, see above.
    Returns:
        [N, H, D] in x's dtype, contiguous; ``x`` is not modified.
    Raises:
        TypeError/ValueError: wrong kind, shape, dtype or device, naming the argument.
    Source: RoFormer (Su et al., arXiv 2104.09864); FlashAttention's ``apply_rotary_emb``
    convention (cos/sin ``[seqlen_ro, rotary_dim / 2]``, ``interleaved``).

    >>> import torch, xpu_ops
    >>> from xpu_ops.ops.rotary import apply_rotary_emb
    >>> x = torch.randn(2, 1, 4); angle = torch.rand(8, 2)
    >>> y = apply_rotary_emb(x, angle.cos(), angle.sin(), torch.tensor([3, 0], dtype=torch.int32))
    >>> c, s = angle[3].cos(), angle[3].sin()
    >>> torch.allclose(y[0, 0], torch.cat([x[0, 0, :2] * c - x[0, 0, 2:] * s, x[0, 0, :2] * s + x[0, 0, 2:] * c]))
    True
    """
    check_tensor_args(NAME, x=x, cos=cos, sin=sin, positions=positions)
    return torch.ops.xpu_ops.apply_rotary_emb(x, cos, sin, positions,
                                              interleaved=bool(interleaved))


def apply_rotary_emb_per_token(x, cos, sin, is_neox_style: bool):
    """Rotary embedding with one table row per token: vLLM's and sgl-kernel's testing form
    (``sgl_kernel.testing.rotary_embedding._apply_rotary_emb``), ``apply_rotary_emb`` with
    ``positions = arange(N)`` and ``interleaved = not is_neox_style``.

    Args:
        x: [N, H, D] fp16|bf16|fp32 (the features to rotate: ``D = 2 * cos.shape[1]``; any
            further features are copied).
        cos, sin: [N, D / 2] float tables, row ``t`` for token ``t``.
        is_neox_style: NeoX halves (True) or GPT-J interleaved pairs (False).
    Returns:
        [N, H, D] in x's dtype (computed in float32); ``x`` is not modified.
    Raises:
        TypeError/ValueError (also RuntimeError): as ``apply_rotary_emb``; ``cos`` with fewer
        rows than tokens.

    >>> import torch
    >>> from xpu_ops.ops.rotary import apply_rotary_emb_per_token
    >>> x = torch.randn(2, 1, 4); angle = torch.rand(2, 2)
    >>> y = apply_rotary_emb_per_token(x, angle.cos(), angle.sin(), is_neox_style=False)
    >>> c, s = angle[1, 0].cos(), angle[1, 0].sin()
    >>> torch.allclose(y[1, 0, :2], torch.stack([x[1, 0, 0] * c - x[1, 0, 1] * s, x[1, 0, 0] * s + x[1, 0, 1] * c]))
    True
    """
    check_tensor_args("_apply_rotary_emb", x=x, cos=cos, sin=sin)
    is_neox_style = check_flag("_apply_rotary_emb", "is_neox_style", is_neox_style)
    check_tensor("_apply_rotary_emb", "x", x, ndim=3)
    check_tensor("_apply_rotary_emb", "cos", cos, ndim=2)
    if cos.shape[0] < x.shape[0]:
        check_size("_apply_rotary_emb", "cos", cos, 0, x.shape[0], "x.shape[0] (one row a token)")
    positions = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
    return torch.ops.xpu_ops.apply_rotary_emb(x, cos, sin, positions,
                                              interleaved=not is_neox_style)
