"""Argument checks shared by every op: one place, used by the public wrappers and the fakes.

Every check raises with the house message format
``"<function>: <argument> <what is wrong>; expected <rule>, got <value>. <how to fix>"``:
``TypeError`` for the wrong kind of object, ``ValueError`` for a bad shape, dtype, device or value,
``NotImplementedError`` for a valid but unsupported combination. Checks read only shapes, dtypes
and devices (never tensor values), so they run unchanged on fake tensors with symbolic sizes.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INDEX_DTYPES = (torch.int32,)


def fail(fn: str, arg: str, problem: str, expected: str, got: object, fix: str = "",
         exc: type = ValueError) -> None:
    """Raise ``exc`` with the house message format (see the module docstring)."""
    tail = f" {fix}" if fix else ""
    raise exc(f"{fn}: {arg} {problem}; expected {expected}, got {got}.{tail}")


def _dtype_list(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d) for d in dtypes)


def check_tensor(fn: str, arg: str, t: object, *, ndim: Optional[int | Sequence[int]] = None,
                 dtypes: Optional[Sequence[torch.dtype]] = None,
                 device: Optional[torch.device] = None, fix: str = "") -> torch.Tensor:
    """Check that ``t`` is a tensor with the given rank, dtype and device; return it.

    Raises:
        TypeError: ``t`` is not a ``torch.Tensor``.
        ValueError: rank, dtype or device differ, naming ``arg`` and both values.
    """
    if not isinstance(t, torch.Tensor):
        fail(fn, arg, "is not a tensor", "a torch.Tensor", type(t).__name__, exc=TypeError)
    if ndim is not None:
        dim = t.dim()
        if dim != ndim if isinstance(ndim, int) else dim not in ndim:
            ndims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
            rule = " or ".join(f"{n}-D" for n in ndims)
            fail(fn, arg, "has the wrong number of dimensions", rule,
                 f"{t.dim()}-D with shape {tuple(t.shape)}", fix)
    if dtypes is not None and t.dtype not in dtypes:
        fix = fix or (f"Build it with dtype={dtypes[0]}." if len(dtypes) == 1 else "")
        fail(fn, arg, f"has dtype {t.dtype}", _dtype_list(dtypes), t.dtype, fix)
    if device is not None and t.device != device:
        fail(fn, arg, "is on the wrong device", f"{device} (the device of q)", t.device,
             "Move it with .to(q.device).")
    return t


def tensors_or_none(required: Sequence[object], optional: Sequence[object] = ()) -> bool:
    """True when every value of ``required`` is a tensor and every value of ``optional`` a tensor
    or ``None``: the allocation-free common case of ``check_tensor_args`` (wrappers call that one
    only when this says False, so it names the argument)."""
    for value in required:
        if not isinstance(value, torch.Tensor):
            return False
    for value in optional:
        if value is not None and not isinstance(value, torch.Tensor):
            return False
    return True


def check_tensor_args(fn: str, optional: Iterable[str] = (), **args: object) -> None:
    """``TypeError`` naming the first argument that is not a tensor (``None`` is allowed for the
    names in ``optional``). Public wrappers call it first, before the dispatcher sees the call.
    """
    allowed_none = set(optional)
    for arg, value in args.items():
        if value is None and arg in allowed_none:
            continue
        if not isinstance(value, torch.Tensor):
            rule = "a torch.Tensor or None" if arg in allowed_none else "a torch.Tensor"
            fail(fn, arg, "is not a tensor", rule, type(value).__name__, exc=TypeError)


def check_optional(fn: str, arg: str, t: object, **kwargs) -> Optional[torch.Tensor]:
    """``check_tensor`` for an argument that may be ``None``."""
    return None if t is None else check_tensor(fn, arg, t, **kwargs)


def check_size(fn: str, arg: str, t: torch.Tensor, dim: int, expected, rule: str) -> None:
    """Check ``t.shape[dim] == expected``; ``rule`` says where ``expected`` comes from."""
    if t.shape[dim] != expected:
        fail(fn, arg, f"has the wrong size in dimension {dim}", f"{rule} = {expected}",
             f"shape {tuple(t.shape)}")


def check_shape(fn: str, arg: str, t: torch.Tensor, expected: Sequence, rule: str) -> None:
    """Check the whole shape of ``t``; ``rule`` names the expected layout, e.g. ``[b, Hkv]``."""
    if tuple(t.shape) != tuple(expected):
        fail(fn, arg, "has the wrong shape", f"{rule} = {tuple(expected)}", tuple(t.shape))


def check_contiguous_last(fn: str, arg: str, t: torch.Tensor) -> None:
    """Kernels index the last dimension with unit stride."""
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(fn, arg, "has a non-unit stride in its last dimension", "stride 1",
             f"strides {t.stride()}", "Call .contiguous() on it.")


def check_gqa(fn: str, num_heads_q: int, num_heads_kv: int) -> None:
    """Grouped-query attention needs ``Hq % Hkv == 0`` (query head h reads KV head h // (Hq/Hkv))."""
    if num_heads_kv == 0 or num_heads_q % num_heads_kv != 0:
        fail(fn, "q/k_cache head counts", "are incompatible",
             "Hq to be a multiple of Hkv (grouped-query attention)",
             f"Hq={num_heads_q}, Hkv={num_heads_kv}")


def check_window(fn: str, window_size: object) -> tuple[int, int]:
    """Validate ``window_size=(left, right)``; -1 means unbounded on that side."""
    if type(window_size) is tuple and len(window_size) == 2:
        left, right = window_size
        if type(left) is int and type(right) is int and left >= -1 and right >= -1:
            return left, right  # the common case, without the int() conversions below
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        fail(fn, "window_size", "is not a pair", "(left, right) with -1 for unbounded",
             repr(window_size), exc=TypeError)
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        fail(fn, "window_size", "has a negative bound", "each side >= 0 or -1 (unbounded)",
             (left, right))
    return left, right


def check_not_implemented(fn: str, **kwargs) -> None:
    """Reject keywords that sgl-kernel accepts but xpu-ops does not implement (non-default)."""
    for name, value in kwargs.items():
        if value is not None and value is not False and not (isinstance(value, int) and value == 0):
            raise NotImplementedError(
                f"{fn}: keyword {name} is accepted for compatibility with sgl-kernel but is not "
                f"implemented by xpu-ops; expected None/default, got {type(value).__name__}. "
                f"See the function's docstring for the supported way to get the same effect.")
