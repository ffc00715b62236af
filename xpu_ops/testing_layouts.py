"""Layouts of sample inputs: the same values as views with other strides (``sample_inputs``'s
``layout=`` dimension), so opcheck and the numeric tests see what API.md's "Layouts" allows.

``"strided"`` re-lays every tensor argument of an op call, by its schema name:

- per-tensor scales and sinks (``q_descale``, ``k_descale``, ``v_descale``, ``sinks``,
  ``k_scale``, ``v_scale``) become one value expanded (stride 0), as sglang passes an fp8
  per-tensor scale ``scale.expand(b, Hkv)``;
- integer tables of two or more dimensions (``page_table``, ``draft_slots``) become column
  slices ``[..., ::2]`` of a twice-as-wide table;
- every other tensor of one dimension (``loc``, ``cache_seqlens``, ``cu_seqlens_*``,
  ``seqused_*``) becomes the odd entries ``[1::2]`` of a longer one;
- every other tensor of two or more dimensions becomes a view with padded rows
  ``[..., 1:1 + n]`` of a wider buffer (unit stride in its last dimension, as the kernels need);
- scratch buffers (``workspace``) stay contiguous: they are reinterpreted as other dtypes.

Padding holds garbage (NaN, or ``2**30 - 1`` for integers), so a provider that ignores a
stride reads it, and a write outside a mutated view changes it (``outside_view_unchanged``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

#: The layouts ``sample_inputs(..., layout=...)`` accepts.
LAYOUTS = ("contiguous", "strided")
_EXPANDED = frozenset({"q_descale", "k_descale", "v_descale", "sinks", "k_scale", "v_scale"})
_KEPT = frozenset({"workspace"})
_INT_GARBAGE = 2 ** 30 - 1


def _garbage_like(buffer: Tensor) -> Tensor:
    """Fill ``buffer`` with garbage that shows when read: NaN for floats (fp8 included, through
    its bytes), a large id for integers, True for bools."""
    if buffer.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
        buffer.view(torch.uint8).fill_(0x7F)      # NaN in both fp8 formats (uint8: fp8 bytes)
    elif buffer.is_floating_point():
        buffer.fill_(float("nan"))
    elif buffer.dtype == torch.bool:
        buffer.fill_(True)
    else:
        buffer.fill_(_INT_GARBAGE)
    return buffer


def strided_view(t: Tensor) -> Tensor:
    """``t``'s values as a non-contiguous view of a larger, garbage-filled buffer (rules in the
    module docstring)."""
    if t.dim() == 0 or t.numel() == 0 and t.dim() == 1:
        return t.clone()
    if t.dim() == 1:
        buffer = _garbage_like(t.new_empty((2 * t.shape[0] + 1,)))
        view = buffer[1::2]
    elif not t.is_floating_point() and t.dtype != torch.bool:
        buffer = _garbage_like(t.new_empty((*t.shape[:-1], 2 * t.shape[-1])))
        view = buffer[..., ::2]
    else:
        buffer = _garbage_like(t.new_empty((*t.shape[:-1], t.shape[-1] + 3)))
        view = buffer[..., 1:1 + t.shape[-1]]
    view.copy_(t)
    return view


def expanded_view(t: Tensor) -> Tensor:
    """One value of ``t`` broadcast to its shape (stride 0 everywhere)."""
    if t.numel() == 0:
        return t
    return t.reshape(-1)[:1].reshape([1] * t.dim()).expand(t.shape)


def relayout(arg_names: Sequence[str], args: tuple, layout: str) -> tuple:
    """``args`` of an op call (named by ``arg_names``, the op's schema) in ``layout``."""
    if layout == "contiguous":
        return args
    if layout != "strided":
        raise ValueError(f"relayout: layout {layout!r} is unknown; expected one of {LAYOUTS}, "
                         f"got {layout!r}. Pass layout='contiguous' or 'strided'.")
    out = []
    for name, value in zip(arg_names, args):
        if not isinstance(value, Tensor) or name in _KEPT:
            out.append(value)
        elif name in _EXPANDED:
            out.append(expanded_view(value))
        else:
            out.append(strided_view(value))
    return tuple(out)


def outside_view_unchanged(view: Tensor, base_before: Tensor) -> bool:
    """True when every element of ``view``'s base outside ``view`` has the bytes it had in
    ``base_before`` (a clone of the base taken before the op ran): the op wrote nothing outside
    the tensor it was given."""
    base = view._base if view._base is not None else view
    after, before = base.detach().clone(), base_before.clone()
    for copy in (after, before):
        region = torch.as_strided(copy, view.shape, view.stride(),
                                  view.storage_offset() - base.storage_offset())
        (region.view(torch.uint8) if region.dtype.itemsize == 1 else region).zero_()
    return torch.equal(after.view(torch.uint8), before.view(torch.uint8))


__all__ = ["LAYOUTS", "relayout", "strided_view", "expanded_view", "outside_view_unchanged"]
