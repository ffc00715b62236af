"""Provider routing: which implementation (``sgl_kernel``, ``triton``, ``reference``) runs an op.

The implementations live in ``provider_table.py``, which the provider packages register into;
this module is the loader (it imports the provider packages, once) and the router.

Each op has up to three implementations. By default the first available one in
``PROVIDER_ORDER`` that serves the op's device wins; ``XPU_OPS_PROVIDER=<name>`` or
``with xpu_ops.use_provider(name):`` forces one. A forced provider that cannot run raises
``RuntimeError`` naming what is missing. A provider may also decline a single call (for example a
page size its kernel does not support); the call then goes to the next provider and the fallback is
recorded (``fallbacks()``, printed by ``python -m xpu_ops info``) and warned about once, never
swapped silently.

Providers only compute: they receive the op's already-validated, fully defaulted arguments.

Routing: every op is registered per dispatch key (``xpu_ops/_registration.py``), so the
dispatcher picks the device type and the kernel of that key calls its ``Route``, one per
``(op, device type)``. A route resolves its chain of available implementations once, at its
first call, and again only when what the chain depends on differs from the previous call's:
the forced provider (``use_provider``'s context variable, then ``XPU_OPS_PROVIDER``) and the
values of the functions declared with ``availability_depends_on`` for that device type (the
``sgl_kernel`` binding). Resolutions are kept per such state, so a state seen before is not
resolved again; registering an implementation or ``refresh()`` forgets them. Per call a route
then reads the state (a context variable or two) and runs the first implementation of the
chain whose ``supports`` accepts the call's shapes (an implementation without ``supports``
accepts every call): a resolution holds that call's target, the provider's own function when
the first implementation has no ``supports``, so the op's kernel calls it directly.

Environment: the variables of ``ENVIRONMENT`` (``XPU_OPS_PROVIDER``, ``TRITON_INTERPRET``,
``XPU_OPS_DEBUG_CHECKS``) are read once, when first needed, never per call; a process that
changes one of them after its first op call calls ``xpu_ops.refresh()`` (this module's
``refresh``) to have the next call see it. ``use_provider`` and ``debug_checks`` are context
managers that take effect at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from typing import Callable, Iterator, Optional

import torch

from .provider_table import (DISPATCH_KEYS, ENVIRONMENT, PROVIDER_ORDER, AvailableFn,  # noqa: F401
                             Implementation, SupportsFn, _registry, _state_fns,
                             availability_depends_on, empty_lse, forget_environment, getenv,
                             on_change, register)

_forced: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("xpu_ops_provider",
                                                                       default=None)
_fallbacks: dict[tuple[str, str, str], int] = {}
_routes: dict[tuple[str, str], "Route"] = {}
_load_lock = threading.Lock()
_loaded = False


def refresh() -> None:
    """Read the environment again (``ENVIRONMENT``'s variables and any other name ``getenv``
    read) and forget every route's resolutions, so the next call of each op resolves again.

    Call it after changing ``XPU_OPS_PROVIDER``, ``TRITON_INTERPRET`` or
    ``XPU_OPS_DEBUG_CHECKS`` in a running process (they are read once, not per call), or after
    changing what some ``available`` reads in a way no ``availability_depends_on`` function
    reports.

    >>> import os, torch, xpu_ops
    >>> os.environ["XPU_OPS_PROVIDER"] = "reference"; xpu_ops.refresh()
    >>> xpu_ops.providers.select("merge_state_v2", torch.device("cpu")).provider
    'reference'
    >>> del os.environ["XPU_OPS_PROVIDER"]; xpu_ops.refresh()
    """
    forget_environment()
    for route in list(_routes.values()):
        route.forget()


on_change(refresh)  # a registration or a new state function forgets every resolution


def _check_provider_name(name: Optional[str]) -> Optional[str]:
    if name is not None and name not in PROVIDER_ORDER:
        raise ValueError(f"XPU_OPS_PROVIDER/use_provider: {name!r} is not a provider; expected "
                         f"one of {PROVIDER_ORDER}, got {name!r}.")
    return name


def _forced_name() -> Optional[str]:
    """The forced provider's name as set, unchecked (``forced_provider`` checks it)."""
    return _forced.get() or getenv("XPU_OPS_PROVIDER") or None


def forced_provider() -> Optional[str]:
    """The provider forced by ``use_provider`` (innermost) or ``XPU_OPS_PROVIDER``, if any.

    Raises:
        ValueError: the name is not one of ``PROVIDER_ORDER``.
    """
    return _check_provider_name(_forced_name())


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
    with _load_lock:
        if _loaded:
            return
        from . import reference  # noqa: F401
        from . import triton as _triton  # noqa: F401
        from . import sgl_kernel as _sgl
        availability_depends_on(_sgl.native.binding)  # bound_to() switches the native library
        _loaded = True


def candidates(op: str, device_type: str) -> list[tuple[str, Optional[str]]]:
    """Every provider of ``op`` in priority order with ``None`` or the reason it cannot run
    (asked afresh: ``python -m xpu_ops info`` reports what a call would resolve to now)."""
    _load_providers()
    impls = _registry.get(op, {})
    return [(name, "no implementation of this op" if name not in impls
             else impls[name].available(device_type)) for name in PROVIDER_ORDER]


def has_providers(op: str) -> bool:
    """True when ``op`` (a bare ``xpu_ops`` op name) is a kernel op routed to providers (not one
    of the ops whose kernel is its own Python, like ``compile``'s split ops)."""
    _load_providers()
    return op in _registry


def record_fallback(op: str, provider: str, reason: str) -> None:
    """Count one call of ``op`` that ``provider`` declined for ``reason`` (warns the first
    time)."""
    key = (op, provider, reason)
    if key not in _fallbacks:
        warnings.warn(f"xpu_ops.{op}: provider {provider} declined this call ({reason}); "
                      f"using the next provider.", stacklevel=5)
    _fallbacks[key] = _fallbacks.get(key, 0) + 1


def fallbacks() -> dict[tuple[str, str, str], int]:
    """Calls that a provider declined so far: ``{(op, provider, reason): count}``."""
    return dict(_fallbacks)


class Route:
    """The implementations of ``op`` on ``device_type``, resolved once per state.

    Calling a route with the op's arguments runs the implementation that serves them (see the
    module docstring); ``select`` returns it without running it; ``target`` returns the function
    a call runs in the current state: the first implementation's own ``fn`` when it has no
    ``supports`` (so a dispatcher kernel calls the provider with nothing in between), else a
    function that asks each ``supports`` of the chain first.
    Raises (all three):
        ValueError: the forced provider's name is not a provider.
        RuntimeError: the forced provider cannot run on this device type, or no provider can.
        NotImplementedError: the forced provider declines this call's arguments.
    """

    __slots__ = ("op", "device_type", "_fns", "_current", "_chains")

    def __init__(self, op: str, device_type: str):
        self.op, self.device_type = op, device_type
        self.forget()

    def forget(self) -> None:
        """Drop every resolution (the next call resolves again) and re-read which state
        functions apply to this device type."""
        self._fns = tuple(_state_fns.get(None, ())) + tuple(_state_fns.get(self.device_type, ()))
        self._chains: dict[tuple, tuple[tuple[Implementation, ...], Callable]] = {}
        # (state, chain, target): the state is never equal to a real one
        self._current: tuple = (object(), (), None)

    def _state(self) -> tuple:
        forced = _forced_name()
        fns = self._fns
        if len(fns) == 1:  # the usual one (the sgl_kernel binding): no list to build
            return (forced, fns[0]())
        return (forced, *[f() for f in fns]) if fns else (forced,)

    def _resolve(self, state: tuple) -> tuple:
        """``(state, chain, target)`` of ``state``, resolved once per state and made current."""
        found = self._chains.get(state)
        if found is None:
            _load_providers()
            state = self._state()  # loading providers may have declared state functions
            chain = self._chain(_check_provider_name(state[0]))
            found = self._chains[state] = (chain, self._target_of(chain, state))
        self._current = (state, *found)
        return self._current

    def _chain(self, forced: Optional[str]) -> tuple[Implementation, ...]:
        impls = _registry.get(self.op, {})
        rows = [(name, impls[name], impls[name].available(self.device_type))
                for name in PROVIDER_ORDER if name in impls]
        if forced is not None:
            reason = next((why for name, _, why in rows if name == forced),
                          "no implementation of this op")
            if reason is not None:
                raise RuntimeError(f"xpu_ops.{self.op}: provider {forced!r} was requested "
                                   f"(use_provider or XPU_OPS_PROVIDER) but cannot run on "
                                   f"{self.device_type}: {reason}.")
            return (impls[forced],)
        chain = tuple(impl for _, impl, why in rows if why is None)
        if not chain:
            raise RuntimeError(f"xpu_ops.{self.op}: no provider can run on {self.device_type}; "
                               f"tried {list(impls)}. See `python -m xpu_ops info`.")
        return chain

    def _target_of(self, chain: tuple[Implementation, ...], state: tuple) -> Callable:
        """What a call in ``state`` runs: the provider's ``fn`` itself, or the ``supports``
        walk of the chain before it."""
        first = chain[0]
        if first.supports is None:
            return first.fn
        supports, fn = first.supports, first.fn

        def serve(*args, **kwargs):
            if supports(*args, **kwargs) is None:  # the usual call: the first one serves
                return fn(*args, **kwargs)
            return self._serving(chain, state, args, kwargs).fn(*args, **kwargs)
        serve.__name__ = serve.__qualname__ = f"{self.op}_{self.device_type}_serving"
        return serve

    def target(self) -> Callable:
        """The function that runs a call of the op in the current state (see the class)."""
        state = self._state()
        current = self._current
        return current[2] if state == current[0] else self._resolve(state)[2]

    def select(self, *args, **kwargs) -> Implementation:
        """The implementation that serves this call (fallbacks recorded); raises as above."""
        state = self._state()
        current = self._current
        if state != current[0]:
            current = self._resolve(state)
        chain = current[1]
        impl = chain[0]
        if impl.supports is None:
            return impl
        return self._serving(chain, current[0], args, kwargs)

    def _serving(self, chain: tuple[Implementation, ...], state: tuple, args: tuple,
                 kwargs: dict) -> Implementation:
        """The first implementation of ``chain`` whose ``supports`` accepts the call."""
        for impl in chain:
            declined = impl.supports(*args, **kwargs) if impl.supports is not None else None
            if declined is None:
                return impl
            if len(chain) == 1 and state[0] is not None:
                raise NotImplementedError(f"xpu_ops.{self.op}: provider {impl.provider!r} was "
                                          f"requested but does not support this call: "
                                          f"{declined}.")
            record_fallback(self.op, impl.provider, declined)
        raise RuntimeError(f"xpu_ops.{self.op}: every provider that runs on {self.device_type} "
                           f"declined this call. See `python -m xpu_ops info`.")

    def __call__(self, *args, **kwargs):
        return self.target()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Route({self.op!r}, {self.device_type!r})"


def route(op: str, device_type: str) -> Route:
    """The ``Route`` of ``op`` on ``device_type`` (one per pair, made on first request)."""
    found = _routes.get((op, device_type))
    if found is None:
        found = _routes.setdefault((op, device_type), Route(op, device_type))
    return found


def select(op: str, device: torch.device, *args, **kwargs) -> Implementation:
    """The implementation of ``op`` that a call with these arguments on ``device`` runs.

    Raises:
        ValueError, RuntimeError, NotImplementedError: as ``Route``.
    """
    return route(op, device.type).select(*args, **kwargs)


__all__ = ["PROVIDER_ORDER", "ENVIRONMENT", "DISPATCH_KEYS", "Implementation", "Route", "register",
           "availability_depends_on", "refresh", "getenv", "forced_provider", "use_provider",
           "candidates", "has_providers", "record_fallback", "fallbacks", "empty_lse", "route",
           "select"]
