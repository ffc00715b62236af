"""``hadamard_transform``: the fast Walsh-Hadamard transform over the last dimension, times a
scale (DeepSeek-V3.2 rotates the indexer's queries and keys with it before fp8 quantisation).

``out = scale * x @ H_n`` with ``H_n`` the Sylvester Hadamard matrix of size ``n`` (a power of
two): ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``, so ``H_n[i, j] = (-1)^popcount(i & j)``.
A last dimension ``d`` that is not a power of two is zero-padded to the next power of two ``n``,
transformed, and the first ``d`` outputs are kept (Dao-AILab fast-hadamard-transform's rule).
Computed in float32, returned in x's dtype as a new contiguous tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import FLOAT_DTYPES, check_tensor, check_tensor_args, fail
from .._registration import define_op
from .common import finite_scale

NAME = "hadamard_transform"


def _check_hadamard_transform(x, scale) -> None:
    """Validate x and scale (runs in the fake too)."""
    check_tensor(NAME, "x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0:
        fail(NAME, "x", "is a 0-D tensor", "at least 1-D (the transform runs over the last "
             "dimension)", "0-D")
    if not -float("inf") < scale < float("inf"):
        finite_scale(NAME, "scale", scale)


@define_op("xpu_ops::hadamard_transform", mutates_args=(), by_device=True)
def hadamard_transform_op(x: Tensor, scale: float) -> Tensor:
    """Op form of ``hadamard_transform`` (the checks; the provider of x's device computes)."""
    _check_hadamard_transform(x, scale)


@hadamard_transform_op.register_fake
def _(x, scale):
    _check_hadamard_transform(x, scale)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def hadamard_transform(x, scale=1.0):
    """Walsh-Hadamard transform of the last dimension of ``x``, times ``scale``.

    Rules: the module docstring (Sylvester order; non-powers of two zero-padded, truncated).
    ``scale = d ** -0.5`` makes it orthonormal (DeepSeek-V3.2's ``rotate_activation``).

    Args:
        x: [..., d] fp16|bf16|fp32, any strides.
        scale: finite float multiplier.
    Returns:
        [..., d] in x's dtype, a new contiguous tensor.
    Raises:
        TypeError/ValueError: not a float tensor, 0-D, or a non-finite scale.
    Source: Sylvester (1867) Hadamard matrices; the fast Walsh-Hadamard transform
    (Fino and Algazi, 1976); sgl-kernel ``hadamard_transform``.

    >>> import torch, xpu_ops
    >>> xpu_ops.hadamard_transform(torch.tensor([1.0, 2.0, 3.0, 4.0]), 0.5).tolist()
    [5.0, -1.0, -2.0, 0.0]
    """
    check_tensor_args(NAME, x=x)
    return torch.ops.xpu_ops.hadamard_transform(x, finite_scale(NAME, "scale", scale))


__all__ = ["hadamard_transform"]
