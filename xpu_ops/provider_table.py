"""The provider table: every registered implementation of every op, and nothing that uses it.

A provider package (``reference``, ``triton``, ``sgl_kernel``) registers its implementations here
with ``register`` when it is imported; ``providers.py`` imports the provider packages (the loader)
and routes calls through this table. This module imports nothing of ``xpu_ops``, so the
registrants and the loader both point down to it and no import circle forms (the pattern of
``torch.library`` itself and of vLLM's platform registry).

What changes the table (``register``, ``availability_depends_on``) tells the listeners that
``on_change`` added (the loader's ``refresh``, which forgets every route's resolutions).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import torch

PROVIDER_ORDER = ("sgl_kernel", "triton", "reference")
#: The environment variables that xpu_ops reads (once each; ``refresh()`` reads them again).
ENVIRONMENT = ("XPU_OPS_PROVIDER", "TRITON_INTERPRET", "XPU_OPS_DEBUG_CHECKS")
#: The dispatch key whose kernels serve each device type.
DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU"}

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
# device type (None: every device type) -> zero-argument state functions
_state_fns: dict[Optional[str], list[Callable[[], object]]] = {}
_environ: dict[str, Optional[str]] = {}  # name -> value when read (``getenv``)
_listeners: list[Callable[[], None]] = []


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener()`` after every later change of the table (the loader's ``refresh``)."""
    if listener not in _listeners:
        _listeners.append(listener)


def _changed() -> None:
    for listener in _listeners:
        listener()


def forget_environment() -> None:
    """Drop what ``getenv`` read, so the next ``getenv`` of each name reads the environment."""
    _environ.clear()


def _always(device_type: str) -> Optional[str]:
    return None


def register(op: str, provider: str, *, available: AvailableFn = _always,
             supports: Optional[SupportsFn] = None) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn`` as ``provider``'s implementation of ``op``.

    Args:
        op: op name without namespace, e.g. ``"flash_attn_with_kvcache"``.
        provider: one of ``PROVIDER_ORDER``.
        available: ``available(device_type) -> None | reason`` (reason why it cannot run there);
            asked when a route resolves, not per call.
        supports: ``supports(*args, **kwargs) -> None | reason`` for one call's arguments;
            must read only shapes, strides, dtypes and Python scalars (it runs per call).
    Raises:
        ValueError: unknown provider name.
    """
    if provider not in PROVIDER_ORDER:
        raise ValueError(f"register: provider {provider!r} is unknown; expected one of "
                         f"{PROVIDER_ORDER}, got {provider!r}.")

    def decorate(fn: Callable) -> Callable:
        _registry.setdefault(op, {})[provider] = Implementation(op, provider, fn, available,
                                                                supports)
        _changed()
        return fn

    return decorate


def availability_depends_on(state: Callable[[], object],
                            device_types: Optional[tuple[str, ...]] = None
                            ) -> Callable[[], object]:
    """Declare that some provider's ``available`` answer on ``device_types`` (default: every
    device type) changes with ``state()``.

    ``state`` is a cheap zero-argument function returning a value comparable with ``==`` and
    hashable (an environment flag, a context variable); the routes of those device types read
    it on every call and resolve again when it changes. Returns ``state`` (usable as a
    decorator).
    """
    for device_type in device_types or (None,):
        fns = _state_fns.setdefault(device_type, [])
        if state not in fns:
            fns.append(state)
    _changed()
    return state


def getenv(name: str) -> Optional[str]:
    """``os.environ.get(name)`` as read at the first request since the last ``refresh()``."""
    try:
        return _environ[name]
    except KeyError:
        value = _environ[name] = os.environ.get(name)
        return value


def empty_lse(q: torch.Tensor) -> torch.Tensor:
    """The LSE an attention op returns when called with ``return_softmax_lse=False``: an empty
    contiguous float32 ``[Hq, 0]`` on q's device (what the fakes return), for providers that
    computed (or never computed) the full one."""
    return q.new_empty((q.shape[1], 0), dtype=torch.float32)


__all__ = ["PROVIDER_ORDER", "ENVIRONMENT", "DISPATCH_KEYS", "AvailableFn", "SupportsFn",
           "Implementation", "register", "availability_depends_on", "on_change", "getenv",
           "forget_environment", "empty_lse"]
