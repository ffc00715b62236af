"""Argument checks shared by every op: one place, used by the public wrappers and the fakes.

Every check raises with the house message format
``"<function>: <argument> <what is wrong>; expected <rule>, got <value>. <how to fix>"``:
``TypeError`` for the wrong kind of object, ``ValueError`` for a bad shape, dtype, device or value,
``NotImplementedError`` for a valid but unsupported combination. Checks read only shapes, dtypes
and devices (never tensor values), so they run unchanged on fake tensors with symbolic sizes.

The ``ValueError`` and ``TypeError`` raised here are ``XpuOpsValueError`` and ``XpuOpsTypeError``:
subclasses that are also ``RuntimeError``, the type sgl-kernel's native ops raise for a bad
argument (``TORCH_CHECK``), so client code written as ``pytest.raises(RuntimeError)`` and code
written as ``pytest.raises(ValueError)`` both catch them.
"""

from __future__ import annotations

import operator
from typing import Iterable, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INDEX_DTYPES = (torch.int32,)


class XpuOpsValueError(ValueError, RuntimeError):
    """A bad value, shape, dtype or device (a ``ValueError``), also a ``RuntimeError`` as
    sgl-kernel's own argument checks raise."""


class XpuOpsTypeError(TypeError, RuntimeError):
    """An argument of the wrong kind (a ``TypeError``), also a ``RuntimeError`` as sgl-kernel's
    own argument checks raise."""


#: The house class raised for each plain exception type ``fail`` is asked for.
HOUSE_ERRORS = {ValueError: XpuOpsValueError, TypeError: XpuOpsTypeError}


def fail(fn: str, arg: str, problem: str, expected: str, got: object, fix: str = "",
         exc: type = ValueError) -> None:
    """Raise ``exc`` with the house message format (see the module docstring); ``ValueError``
    and ``TypeError`` become their house subclasses (also ``RuntimeError``)."""
    tail = f" {fix}" if fix else ""
    raise HOUSE_ERRORS.get(exc, exc)(f"{fn}: {arg} {problem}; expected {expected}, got {got}.{tail}")


def _dtype_list(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d) for d in dtypes)


def check_tensor(fn: str, arg: str, t: object, *, ndim: Optional[int | Sequence[int]] = None,
                 dtypes: Optional[Sequence[torch.dtype]] = None,
                 device: Optional[torch.device] = None, fix: str = "") -> torch.Tensor:
    """Check that ``t`` is a tensor with the given rank, dtype and device; return it.

    ``fix`` is the how-to-fix sentence of a dtype mismatch (rank and device errors carry their
    own), so a dtype hint never follows a wrong rank.

    Raises:
        TypeError: ``t`` is not a ``torch.Tensor``.
        ValueError: not a dense (strided) tensor, or rank, dtype or device differ, naming
            ``arg`` and both values.
    """
    if not isinstance(t, torch.Tensor):
        fail(fn, arg, "is not a tensor", "a torch.Tensor", type(t).__name__, exc=TypeError)
    if t.layout != torch.strided:
        fail(fn, arg, "is not a dense tensor", "layout torch.strided", t.layout,
             "Convert it with .to_dense().")
    if ndim is not None:
        dim = t.dim()
        if dim != ndim if isinstance(ndim, int) else dim not in ndim:
            ndims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
            rule = " or ".join(f"{n}-D" for n in ndims)
            fail(fn, arg, "has the wrong number of dimensions", rule,
                 f"{t.dim()}-D with shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        fix = fix or (f"Build it with dtype={dtypes[0]}." if len(dtypes) == 1 else "")
        fail(fn, arg, f"has dtype {t.dtype}", _dtype_list(dtypes), t.dtype, fix)
    if device is not None and t.device != device:
        fail(fn, arg, "is on the wrong device", f"{device} (the device of q)", t.device,
             "Move it with .to(q.device).")
    return t


def check_writable(fn: str, arg: str, t: torch.Tensor, why: str = "it is written") -> None:
    """An output written in place has no expanded dimension (stride 0 over several elements:
    one memory location for several elements, which a copy into it refuses mid-call).

    Raises:
        ValueError: naming ``arg`` and its strides.
    """
    if any(n > 1 and st == 0 for n, st in zip(t.shape, t.stride())):
        fail(fn, arg, "has elements that share memory (an expanded tensor)",
             f"distinct elements ({why})", f"strides {tuple(t.stride())}",
             f"Pass {arg}.contiguous().")


_STRIDED = torch.strided


def all_dense_on(device: torch.device, tensors: Sequence[torch.Tensor]) -> bool:
    """True when every tensor of ``tensors`` is dense (``torch.strided``) and on ``device``: the
    part of ``check_tensor`` that an op's fast path for valid calls needs (no message built)."""
    for t in tensors:
        if t.layout is not _STRIDED or t.device != device:
            return False
    return True


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


def check_same_size(fn: str, what: str, *entries: tuple[str, torch.Tensor, int]) -> None:
    """Check that several arguments agree on one size (``what``, e.g. ``N`` or ``Hkv``).

    ``entries`` are ``(arg, tensor, dim)``. On a mismatch the argument that disagrees with the
    size most entries share is named (ties: the size of the earliest entry), with the arguments
    that agree, so the message blames the tensor that is actually off.
    """
    sizes = [t.shape[dim] for _, t, dim in entries]
    if all(size == sizes[0] for size in sizes[1:]):
        return
    ref = max(sizes, key=lambda size: (sizes.count(size), -sizes.index(size)))
    agree = ", ".join(f"{arg}.shape[{dim}]" for (arg, _, dim), size in zip(entries, sizes)
                      if size == ref)
    arg, t, dim = next(e for e, size in zip(entries, sizes) if size != ref)
    fail(fn, arg, f"has the wrong size in dimension {dim} ({what})",
         f"{what} = {ref} as in {agree}", f"shape {tuple(t.shape)}")


def check_store_dtypes(fn: str, *pairs: tuple[str, torch.Tensor, str, torch.Tensor]) -> None:
    """Dtypes of new rows and the caches they are written into: ``pairs`` of
    ``(row_arg, rows, cache_arg, cache)``. Rows share one float dtype; a cache has that dtype
    or an fp8 one (rows are quantised on the way in).

    When the rows agree, a cache that differs is named; when they do not, the row that differs
    from its (non-fp8) cache, else the row that differs from the first.
    """
    first_arg, first = pairs[0][0], pairs[0][1]
    if all(rows.dtype == first.dtype for _, rows, _, _ in pairs):
        owners = " and ".join(f"{row_arg}'s" for row_arg, _, _, _ in pairs)
        for _, _, cache_arg, cache in pairs:
            if cache.dtype not in FP8_DTYPES and cache.dtype != first.dtype:
                fail(fn, cache_arg, f"has dtype {cache.dtype}",
                     f"{owners} dtype {first.dtype} or an fp8 dtype", cache.dtype,
                     "Allocate the cache in the dtype of the rows it stores, or in fp8.")
        return
    for row_arg, rows, cache_arg, cache in pairs:
        if cache.dtype not in FP8_DTYPES and rows.dtype != cache.dtype:
            fail(fn, row_arg, f"has dtype {rows.dtype}",
                 f"{cache_arg}'s dtype {cache.dtype} (the cache is not fp8)", rows.dtype,
                 f"Cast it with {row_arg}.to({cache_arg}.dtype).")
    row_arg, rows = next((a, r) for a, r, _, _ in pairs if r.dtype != first.dtype)
    fail(fn, row_arg, f"has dtype {rows.dtype}", f"{first_arg}'s dtype {first.dtype}",
         rows.dtype, f"Pass {first_arg} and {row_arg} in the same dtype.")


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
    if num_heads_kv == 0:
        fail(fn, "q/k_cache head counts", "are incompatible",
             "Hkv >= 1 (at least one KV head) and Hq a multiple of Hkv",
             f"Hq={num_heads_q}, Hkv={num_heads_kv}")
    if num_heads_q % num_heads_kv != 0:
        fail(fn, "q/k_cache head counts", "are incompatible",
             "Hq to be a multiple of Hkv (grouped-query attention)",
             f"Hq={num_heads_q}, Hkv={num_heads_kv}")


def int_scalar(fn: str, arg: str, value: object, rule: str = "an int") -> int:
    """Accept a Python/NumPy integer (or a symbolic one while tracing) for an int argument.

    Raises:
        TypeError: ``value`` is a float, a bool, a string or another non-integer object, naming
            ``arg`` and the value (a float such as ``3.0`` is not rounded silently).
    """
    if type(value) is int:
        return value
    if isinstance(value, torch.SymInt):
        return value  # a traced size: already an integer
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    fail(fn, arg, "is not an integer", rule, f"{value!r} ({type(value).__name__})",
         f"Pass int({arg}).", exc=TypeError)


def check_window(fn: str, window_size: object) -> tuple[int, int]:
    """Validate ``window_size=(left, right)``; -1 (or None, FlashAttention-4's spelling) means
    unbounded on that side.

    Raises:
        TypeError: not a pair, or a side that is neither an integer nor None.
        ValueError: a side below -1.
    """
    if type(window_size) is tuple and len(window_size) == 2:
        left, right = window_size
        if type(left) is int and type(right) is int and left >= -1 and right >= -1:
            return left, right  # the common case, without the conversions below
    if isinstance(window_size, torch.Tensor) and window_size.shape == (2,):
        window_size = window_size.tolist()  # FlashAttention's tests pass torch.randint(..., (2,))
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        fail(fn, "window_size", "is not a pair", "(left, right) with -1 for unbounded",
             repr(window_size), exc=TypeError)
    window_size = tuple(-1 if side is None else side for side in window_size)
    for side in window_size:
        if isinstance(side, bool) or not isinstance(side, (int, torch.SymInt)) and not hasattr(
                side, "__index__"):
            fail(fn, "window_size", "has a side that is not an integer",
                 "(left, right) of ints, -1 or None for unbounded", repr(tuple(window_size)),
                 "Pass an int, or -1 for an unbounded side.", exc=TypeError)
    left, right = (operator.index(side) for side in window_size)
    if left < -1 or right < -1:
        fail(fn, "window_size", "has a negative bound", "each side >= 0 or -1 (unbounded)",
             (left, right))
    return left, right


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value) if isinstance(value, (bool, int, float, str)) else type(value).__name__


def check_not_implemented(fn: str, defaults: Optional[dict[str, object]] = None,
                          **kwargs) -> None:
    """Reject keywords that sgl-kernel accepts but xpu-ops does not implement (non-default).

    A keyword passes when it is ``None`` or its default: ``defaults[name]`` when given (same
    type and value; a default of ``None`` admits only ``None``), else ``False``/``0``.

    Raises:
        NotImplementedError: naming the first keyword with another value, its default and the
            value received.
    """
    defaults = defaults or {}
    for name, value in kwargs.items():
        if name in defaults:
            default = defaults[name]
            ok = value is None or (type(value) is type(default) and value == default)
            rule = ("None (its default)" if default is None
                    else f"None or {default!r} (its default)")
        else:
            ok = value is None or value is False or (type(value) is int and value == 0)
            rule = "None (its default)"
        if not ok:
            raise NotImplementedError(
                f"{fn}: keyword {name} is accepted for compatibility with sgl-kernel but is not "
                f"implemented by xpu-ops; expected {rule}, got "
                f"{_describe(value)}. See the function's docstring for the supported way to "
                f"get the same effect.")
