"""Provider registry: which implementation (``sgl_kernel``, ``triton``, ``reference``) runs an op.

Each op has up to three implementations. By default the first available one in
``PROVIDER_ORDER`` that serves the op's device wins; ``XPU_OPS_PROVIDER=<name>`` or
``with xpu_ops.use_provider(name):`` forces one. A forced provider that cannot run raises
``RuntimeError`` naming what is missing. A provider may also decline a single call (for example a
page size its kernel does not support); the call then goes to the next provider and the fallback is
recorded (``fallbacks()``, printed by ``python -m xpu_ops info``) and warned about once, never
swapped silently.

Providers only compute: they receive the op's already-validated, fully defaulted arguments.

Selection runs on every op call, so its host cost counts (piecewise decode calls two ops per layer
eagerly). ``XPU_OPS_PROVIDER`` and ``use_provider`` are read on every call. What each provider's
``available(device_type)`` says is cached per ``(op, device_type)`` and the current values of the
functions declared with ``availability_depends_on`` (Triton's ``TRITON_INTERPRET`` flag, the
``sgl_kernel`` binding); registering an implementation clears the cache. ``supports`` runs on
every call. ``selection_state()`` is everything besides the call's own arguments that a
selection depends on, for callers that cache what they derived from one (``xpu_ops.plan``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import warnings
from typing import Callable, Iterator, Optional

import torch

PROVIDER_ORDER = ("sgl_kernel", "triton", "reference")

# Returns None when the provider can run on a device type, else the reason it cannot.
AvailableFn = Callable[[str], Optional[str]]
# Returns None when the provider serves this call, else the reason it declines it.
SupportsFn = Callable[..., Optional[str]]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One registered implementation: ``fn`` is ``provider``'s code for ``op``; ``available``
    and the optional ``supports`` return ``None`` or the reason it cannot run / declines a call;
    the optional ``plan(args, kwargs, slots)`` returns a function of the slot tensors that runs
    ``fn(*args, **kwargs)`` with those tensors in the slots (``xpu_ops.plan.OpPlan`` uses it to
    do the per-call work of the provider once).
    """
    op: str
    provider: str
    fn: Callable
    available: AvailableFn
    supports: Optional[SupportsFn] = None
    plan: Optional[Callable] = None


_registry: dict[str, dict[str, Implementation]] = {}
_forced: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("xpu_ops_provider",
                                                                       default=None)
_fallbacks: dict[tuple[str, str, str], int] = {}
# (op, device_type, *availability state) -> ((provider, Implementation | None, reason), ...)
_rows_cache: dict[tuple, tuple[tuple[str, Optional[Implementation], Optional[str]], ...]] = {}
_state_fns: list[Callable[[], object]] = []
_generation = 0  # bumped by invalidate_cache: part of selection_state()
_loaded = False


def _always(device_type: str) -> Optional[str]:
    return None


def register(op: str, provider: str, *, available: AvailableFn = _always,
             supports: Optional[SupportsFn] = None,
             plan: Optional[Callable] = None) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn`` as ``provider``'s implementation of ``op``.

    Args:
        op: op name without namespace, e.g. ``"flash_attn_with_kvcache"``.
        provider: one of ``PROVIDER_ORDER``.
        available: ``available(device_type) -> None | reason`` (reason why it cannot run there).
        supports: ``supports(*args, **kwargs) -> None | reason`` for one call's arguments;
            must read only shapes, dtypes and Python scalars (it runs per call).
        plan: ``plan(args, kwargs, slots) -> run(*slot_tensors)``, optional (see
            ``Implementation``).
    Raises:
        ValueError: unknown provider name.
    """
    if provider not in PROVIDER_ORDER:
        raise ValueError(f"register: provider {provider!r} is unknown; expected one of "
                         f"{PROVIDER_ORDER}, got {provider!r}.")

    def decorate(fn: Callable) -> Callable:
        _registry.setdefault(op, {})[provider] = Implementation(op, provider, fn, available,
                                                                supports, plan)
        invalidate_cache()
        return fn

    return decorate


def availability_depends_on(state: Callable[[], object]) -> Callable[[], object]:
    """Declare that some provider's ``available`` answer changes with ``state()``.

    ``state`` is a cheap zero-argument function returning a hashable value (an environment flag,
    a context variable); ``select`` keys its availability cache on the values of all of them, so
    a change (``TRITON_INTERPRET`` set by a test, ``sgl_kernel.native.bound_to``) is seen by the
    next call. Returns ``state`` (usable as a decorator).
    """
    if state not in _state_fns:
        _state_fns.append(state)
        invalidate_cache()
    return state


def invalidate_cache() -> None:
    """Forget the cached availability answers (after changing what ``available`` depends on in a
    way no ``availability_depends_on`` function reports); also changes ``selection_state()``."""
    global _generation
    _rows_cache.clear()
    _generation += 1


def selection_state() -> tuple:
    """Hashable snapshot of what ``select`` depends on besides the call's arguments: the forced
    provider, the registry's generation (every ``register``/``invalidate_cache`` changes it)
    and the ``availability_depends_on`` values. Equal snapshots and equal call signatures
    (shapes, strides, dtypes, devices, scalars: all that ``supports`` may read) select the same
    implementation.

    Raises:
        ValueError: as ``forced_provider``.
    """
    _load_providers()
    return (forced_provider(), _generation, *[state() for state in _state_fns])


def getenv(name: str) -> Optional[str]:
    """``os.environ.get(name)``, read on every call so that flags set at run time take effect."""
    return os.environ.get(name)


def forced_provider() -> Optional[str]:
    """The provider forced by ``use_provider`` (innermost) or ``XPU_OPS_PROVIDER``, if any."""
    name = _forced.get() or getenv("XPU_OPS_PROVIDER") or None
    if name is not None and name not in PROVIDER_ORDER:
        raise ValueError(f"XPU_OPS_PROVIDER/use_provider: {name!r} is not a provider; expected "
                         f"one of {PROVIDER_ORDER}, got {name!r}.")
    return name


@contextlib.contextmanager
def use_provider(name: str) -> Iterator[None]:
    """Force provider ``name`` for every op called inside the ``with`` block.

    Raises:
        ValueError: ``name`` is not one of ``PROVIDER_ORDER``.

    >>> import torch, xpu_ops
    >>> v, s = torch.randn(2, 1, 4), torch.randn(2, 1)
    >>> with xpu_ops.use_provider("reference"):
    ...     out, lse = xpu_ops.merge_state_v2(v, s, v, s)
    >>> torch.allclose(out, v, atol=1e-6) and torch.allclose(lse, s + torch.log(torch.tensor(2.0)))
    True
    """
    if name not in PROVIDER_ORDER:
        raise ValueError(f"use_provider: name {name!r} is not a provider; expected one of "
                         f"{PROVIDER_ORDER}, got {name!r}.")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def _load_providers() -> None:
    # Importing a provider package registers its implementations (once per process).
    global _loaded
    if _loaded:
        return
    from . import reference  # noqa: F401
    from . import triton as _triton  # noqa: F401
    from . import sgl_kernel as _sgl
    availability_depends_on(_sgl.native.binding)  # bound_to() switches the native library
    _loaded = True


def _rows(op: str, device_type: str
          ) -> tuple[tuple[str, Optional[Implementation], Optional[str]], ...]:
    """``(provider, implementation or None, None or why it cannot run)`` in priority order,
    cached per op, device type and availability state (see the module docstring)."""
    _load_providers()
    key = (op, device_type, *[state() for state in _state_fns])
    rows = _rows_cache.get(key)
    if rows is None:
        impls = _registry.get(op, {})
        rows = tuple((name, impls.get(name), "no implementation of this op" if name not in impls
                      else impls[name].available(device_type)) for name in PROVIDER_ORDER)
        _rows_cache[key] = rows
    return rows


def candidates(op: str, device_type: str) -> list[tuple[str, Optional[str]]]:
    """Every provider of ``op`` in priority order with ``None`` or the reason it cannot run."""
    _load_providers()
    impls = _registry.get(op, {})
    rows = []
    for name in PROVIDER_ORDER:
        impl = impls.get(name)
        rows.append((name, "no implementation of this op" if impl is None
                     else impl.available(device_type)))
    return rows


def record_fallback(op: str, provider: str, reason: str) -> None:
    """Count one call of ``op`` that ``provider`` declined for ``reason`` (warns the first
    time). ``select`` calls it; a caller reusing an earlier selection for a new call repeats
    that selection's ``declined`` entries, so ``fallbacks()`` keeps counting calls."""
    key = (op, provider, reason)
    if key not in _fallbacks:
        warnings.warn(f"xpu_ops.{op}: provider {provider} declined this call ({reason}); "
                      f"using the next provider.", stacklevel=5)
    _fallbacks[key] = _fallbacks.get(key, 0) + 1


def fallbacks() -> dict[tuple[str, str, str], int]:
    """Calls that a provider declined so far: ``{(op, provider, reason): count}``."""
    return dict(_fallbacks)


def select(op: str, device: torch.device, *args, **kwargs) -> Implementation:
    """Pick the implementation of ``op`` for a call on ``device`` (see the module docstring).

    Raises:
        RuntimeError: the forced provider cannot run on this device, or no provider can.
        NotImplementedError: the forced provider declines this call's arguments.
    """
    return select_declined(op, device, *args, **kwargs)[0]


def select_declined(op: str, device: torch.device, *args, **kwargs
                    ) -> tuple[Implementation, tuple[tuple[str, str], ...]]:
    """``select``, plus the ``(provider, reason)`` of every provider that declined the call on
    the way (already counted by ``record_fallback``). Raises as ``select``."""
    rows = _rows(op, device.type)
    forced = forced_provider()
    if forced is not None:
        _, impl, reason = rows[PROVIDER_ORDER.index(forced)]
        if reason is not None:
            raise RuntimeError(f"xpu_ops.{op}: provider {forced!r} was requested (use_provider or "
                               f"XPU_OPS_PROVIDER) but cannot run on {device.type}: {reason}.")
        declined = impl.supports(*args, **kwargs) if impl.supports else None
        if declined is not None:
            raise NotImplementedError(f"xpu_ops.{op}: provider {forced!r} was requested but does "
                                      f"not support this call: {declined}.")
        return impl, ()
    declines: list[tuple[str, str]] = []
    for name, impl, reason in rows:
        if reason is not None:
            continue
        declined = impl.supports(*args, **kwargs) if impl.supports is not None else None
        if declined is None:
            return impl, tuple(declines)
        record_fallback(op, name, declined)
        declines.append((name, declined))
    raise RuntimeError(f"xpu_ops.{op}: no provider can run on {device.type}; tried "
                       f"{list(_registry.get(op, {}))}. See `python -m xpu_ops info`.")


def dispatch(op: str, device: torch.device, *args, **kwargs):
    """Run ``op``'s selected implementation with the op's own arguments."""
    return select(op, device, *args, **kwargs).fn(*args, **kwargs)
