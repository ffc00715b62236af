"""Provider registry: which implementation (``sgl_kernel``, ``triton``, ``reference``) runs an op.

Each op has up to three implementations. By default the first available one in
``PROVIDER_ORDER`` that serves the op's device wins; ``XPU_OPS_PROVIDER=<name>`` or
``with xpu_ops.use_provider(name):`` forces one. A forced provider that cannot run raises
``RuntimeError`` naming what is missing. A provider may also decline a single call (for example a
page size its kernel does not support); the call then goes to the next provider and the fallback is
recorded (``fallbacks()``, printed by ``python -m xpu_ops info``) and warned about once, never
swapped silently.

Providers only compute: they receive the op's already-validated, fully defaulted arguments.
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
    and the optional ``supports`` return ``None`` or the reason it cannot run / declines a call.
    """
    op: str
    provider: str
    fn: Callable
    available: AvailableFn
    supports: Optional[SupportsFn] = None


_registry: dict[str, dict[str, Implementation]] = {}
_forced: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("xpu_ops_provider",
                                                                       default=None)
_fallbacks: dict[tuple[str, str, str], int] = {}


def _always(device_type: str) -> Optional[str]:
    return None


def register(op: str, provider: str, *, available: AvailableFn = _always,
             supports: Optional[SupportsFn] = None) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn`` as ``provider``'s implementation of ``op``.

    Args:
        op: op name without namespace, e.g. ``"flash_attn_with_kvcache"``.
        provider: one of ``PROVIDER_ORDER``.
        available: ``available(device_type) -> None | reason`` (reason why it cannot run there).
        supports: ``supports(*args, **kwargs) -> None | reason`` for one call's arguments;
            must read only shapes, dtypes and Python scalars (it runs per call).
    Raises:
        ValueError: unknown provider name.
    """
    if provider not in PROVIDER_ORDER:
        raise ValueError(f"register: provider {provider!r} is unknown; expected one of "
                         f"{PROVIDER_ORDER}, got {provider!r}.")

    def decorate(fn: Callable) -> Callable:
        _registry.setdefault(op, {})[provider] = Implementation(op, provider, fn, available,
                                                                supports)
        return fn

    return decorate


def forced_provider() -> Optional[str]:
    """The provider forced by ``use_provider`` (innermost) or ``XPU_OPS_PROVIDER``, if any."""
    name = _forced.get() or os.environ.get("XPU_OPS_PROVIDER") or None
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
    # Importing a provider package registers its implementations; optional ones may be missing.
    from . import reference  # noqa: F401
    from . import triton as _triton  # noqa: F401
    from . import sgl_kernel as _sgl  # noqa: F401


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


def _record_fallback(op: str, provider: str, reason: str) -> None:
    key = (op, provider, reason)
    if key not in _fallbacks:
        warnings.warn(f"xpu_ops.{op}: provider {provider} declined this call ({reason}); "
                      f"using the next provider.", stacklevel=4)
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
    _load_providers()
    impls = _registry.get(op, {})
    forced = forced_provider()
    if forced is not None:
        impl = impls.get(forced)
        reason = "no implementation of this op" if impl is None else impl.available(device.type)
        if reason is not None:
            raise RuntimeError(f"xpu_ops.{op}: provider {forced!r} was requested (use_provider or "
                               f"XPU_OPS_PROVIDER) but cannot run on {device.type}: {reason}.")
        declined = impl.supports(*args, **kwargs) if impl.supports else None
        if declined is not None:
            raise NotImplementedError(f"xpu_ops.{op}: provider {forced!r} was requested but does "
                                      f"not support this call: {declined}.")
        return impl
    for name in PROVIDER_ORDER:
        impl = impls.get(name)
        if impl is None or impl.available(device.type) is not None:
            continue
        declined = impl.supports(*args, **kwargs) if impl.supports else None
        if declined is None:
            return impl
        _record_fallback(op, name, declined)
    raise RuntimeError(f"xpu_ops.{op}: no provider can run on {device.type}; tried "
                       f"{list(impls)}. See `python -m xpu_ops info`.")


def dispatch(op: str, device: torch.device, *args, **kwargs):
    """Run ``op``'s selected implementation with the op's own arguments."""
    return select(op, device, *args, **kwargs).fn(*args, **kwargs)
