"""``store_cache_xpu``: sgl-kernel-xpu's fused store of K and V rows into flat row caches.

The op ``torch.ops.xpu_ops.store_cache`` (sgl-kernel-xpu's native op has the same name and
schema) writes row ``i`` of ``k``/``v`` into row ``indices[i]`` of ``k_cache``/``v_cache``; an
index of -1 skips the token (so does any index outside ``[0, cache rows)`` when the debug checks
are off). Only the addressed rows change; ``k``/``v`` are read, never modified, and read as they
were before the call even when they are views of the caches' rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _value_checks
from .._registration import define_op
from .kv_cache import snapshot_aliased
from .._checks import (FLOAT_DTYPES, FP8_DTYPES, check_same_size, check_tensor,
                       check_tensor_args, tensors_or_none)

NAME = "store_cache_xpu"
_ROW_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def _check_store_cache(k, v, k_cache, v_cache, indices) -> None:
    """Validate shapes/dtypes/devices (runs in the fake too)."""
    fn = NAME
    check_tensor(fn, "k", k, ndim=2, dtypes=_ROW_DTYPES)
    device = k.device
    check_tensor(fn, "v", v, ndim=2, dtypes=_ROW_DTYPES, device=device)
    check_tensor(fn, "indices", indices, ndim=1, dtypes=(torch.int64,), device=device,
                 fix="Pass int64 slot indices (the wrapper converts int32).")
    for arg, cache, rows in (("k_cache", k_cache, k), ("v_cache", v_cache, v)):
        row_arg = arg[0]
        check_tensor(fn, arg, cache, ndim=2, dtypes=(rows.dtype,), device=device,
                     fix=f"Allocate the cache in {row_arg}'s dtype (the rows are copied as "
                         "they are).")
        check_same_size(fn, "row_dim", (row_arg, rows, 1), (arg, cache, 1))
    check_same_size(fn, "num_tokens", ("k", k, 0), ("v", v, 0), ("indices", indices, 0))


@define_op("xpu_ops::store_cache", mutates_args=("k_cache", "v_cache"), by_device=True)
def store_cache_op(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                   indices: Tensor) -> None:
    """Op form of ``store_cache_xpu`` (sgl-kernel-xpu's ``store_cache`` schema); ``k``/``v``
    that share memory with a cache are read as they were before the call (``snapshot_aliased``)."""
    _check_store_cache(k, v, k_cache, v_cache, indices)
    sources = snapshot_aliased((k_cache, v_cache), (k, v))
    return None if sources is None else (*sources, k_cache, v_cache, indices)


@store_cache_op.register_fake
def _(k, v, k_cache, v_cache, indices):
    _check_store_cache(k, v, k_cache, v_cache, indices)


def store_cache_xpu(k, v, k_cache, v_cache, indices) -> None:
    """Store K and V rows into flat caches at slot ``indices`` (sgl-kernel-xpu
    ``store_cache_xpu``): ``k_cache[indices[i]] = k[i]``, ``v_cache[indices[i]] = v[i]``.

    Args:
        k: [N, Dk] rows (any row stride, e.g. one head of ``[N, H, Dk]``), float or fp8.
        v: [N, Dv] rows, likewise.
        k_cache: [S, Dk] in k's dtype; v_cache: [S, Dv] in v's dtype (modified in place).
        indices: [N] int64 (int32 is converted) cache rows; -1 skips the token. Any other
            index outside ``[0, S)`` is skipped too (no write outside the caches), or rejected
            under ``xpu_ops.debug_checks()``.
    Returns:
        None. Only the rows ``indices`` of the two caches change.
    Raises:
        TypeError/ValueError (also RuntimeError): wrong kind, rank, dtype, device or size,
        naming the argument; with debug checks, an index below -1 or at least ``S``.
    Source: sgl-kernel-xpu ``sgl_kernel.elementwise.store_cache_xpu`` (same semantics as
    ``k_cache[indices] = k`` for in-range indices).

    >>> import torch, xpu_ops
    >>> kc, vc = torch.zeros(6, 4), torch.zeros(6, 2)
    >>> k, v = torch.randn(3, 4), torch.randn(3, 2)
    >>> xpu_ops.store_cache_xpu(k, v, kc, vc, torch.tensor([4, -1, 0]))
    >>> torch.equal(kc[4], k[0]) and torch.equal(vc[0], v[2]) and kc[1:4].abs().sum().item() == 0
    True
    """
    if not tensors_or_none((k, v, k_cache, v_cache, indices)):
        check_tensor_args(NAME, k=k, v=v, k_cache=k_cache, v_cache=v_cache, indices=indices)
    if indices.dtype == torch.int32:
        indices = indices.long()       # as sgl-kernel-xpu's wrapper (``indices.long()``)
    _value_checks.check_store_cache(NAME, indices, k_cache)
    torch.ops.xpu_ops.store_cache(k, v, k_cache, v_cache, indices)
