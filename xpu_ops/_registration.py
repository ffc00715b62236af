"""Operator registration with a short eager path: ``define_op``.

``torch.library.custom_op`` wraps a mutating op in Python kernels for the Autograd and
ADInplaceOrView keys; the latter re-binds every argument against the schema on each call, a
large part of an eager call of ``flash_attn_with_kvcache`` (18 arguments). ``define_op``
registers the same thing through ``torch.library.Library`` directly (as vLLM's
``direct_register_custom_op`` does): the schema (inferred from type hints like ``custom_op``, or
given), the kernels and a fake. A call then costs one C++ dispatch into the Python kernel.

Kernels: ``define_op(..., by_device=True)`` (the ``xpu_ops`` ops) registers one kernel per
dispatch key of ``providers.DISPATCH_KEYS`` (CPU, CUDA, XPU), as
``torch.library.register_kernel`` does, so the dispatcher routes a call by device: the kernel of
a device type runs the decorated function (the op's shape checks) and then the target of that
device type's ``providers.Route``: the provider resolved for it, its own function called
directly. Other backend keys (sparse layouts, other devices) get a
``CompositeExplicitAutograd`` kernel that runs the checks (they name a non-dense argument) and
otherwise raises ``RuntimeError`` naming the device. Without
``by_device`` the decorated function is the kernel for every device
(``CompositeExplicitAutograd``).

What ``custom_op`` did that ``define_op`` keeps: mutated arguments get their version counter
bumped after the kernel ran (``torch.autograd.graph.increment_version``), so autograd notices
the in-place write. What it drops: the Python autograd kernel. These ops are not differentiable, and say so the
way PyTorch asks non-differentiable ops to: a fallthrough kernel at the ``Autograd`` key (no
autograd node, no per-call Python), and the kernel body runs under ``torch.no_grad()`` when grad
mode is on, so a provider's own PyTorch code records no graph either. Under grad mode every op
runs on every provider (sgl-kernel's tests call the ops with inputs that require grad) and its
outputs never require grad; a backward through them raises autograd's own "does not require
grad" error.
``torch.compile`` treats the result like any op with a mutable schema (``auto_functionalized``),
and ``torch.library.opcheck`` runs on it unchanged.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch

from . import providers

_LIBRARIES: dict[str, torch.library.Library] = {}
DEFINED: dict[str, "OpDef"] = {}


class OpDef:
    """An operator defined by ``define_op``.

    Attributes:
        qualname: ``"namespace::name"``.
        fn: the decorated function: the kernel, or with ``by_device`` the op's checks.
        fake: the registered fake (output metadata and shape checks), None until registered.
        op: ``torch.ops.<namespace>.<name>`` (the ``OpOverloadPacket``).
    Calling the ``OpDef`` calls ``op``.
    """

    def __init__(self, qualname: str, fn: Callable, lib: torch.library.Library):
        self.qualname, self.fn, self._lib = qualname, fn, lib
        self.fake: Optional[Callable] = None
        namespace, name = qualname.split("::")
        self.op = getattr(getattr(torch.ops, namespace), name)

    def register_fake(self, fake: Callable) -> Callable:
        """Decorator: ``fake`` computes output metadata (and runs the shape checks) for fake
        tensors, meta tensors and tracing."""
        torch.library.register_fake(self.qualname, fake, lib=self._lib)
        self.fake = fake
        return fake

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)

    def __repr__(self) -> str:
        return f"OpDef({self.qualname})"


def define_op(qualname: str, *, mutates_args: Sequence[str], schema: Optional[str] = None,
              by_device: bool = False) -> Callable[[Callable], OpDef]:
    """Decorator: define operator ``qualname`` with the decorated function as its kernel.

    Args:
        qualname: ``"namespace::name"``; the namespace gets one ``FRAGMENT`` library.
        mutates_args: names of the arguments the kernel writes in place (positional
            arguments only; their version counters are bumped after each call).
        schema: the schema after the name, e.g. ``"(Tensor q, Tensor(a!) out) -> ()"``; default:
            inferred from the type hints (``torch.library.infer_schema``).
        by_device: register one kernel per dispatch key of ``providers.DISPATCH_KEYS``; each
            runs the decorated function (the checks; it returns None, or the tuple of
            positional arguments, some values normalised, that the provider gets instead) and
            then returns what the provider resolved for ``(name, device type)`` returns
            (``providers.Route``). Hot ops take no keyword-only arguments: the dispatcher hands
            those to a Python kernel as a new dict on every call (about half the cost of a
            21-argument call).
    Returns:
        an ``OpDef`` (register the fake with ``@opdef.register_fake``).
    Raises:
        ValueError: a name in ``mutates_args`` is not a positional argument of the function.

    >>> import torch
    >>> @define_op("xpu_ops_doc::scale_", mutates_args=("x",))
    ... def scale_(x: torch.Tensor, factor: float) -> None:
    ...     x.mul_(factor)
    >>> t = torch.ones(2); scale_(t, 3.0); t.tolist(), t._version > 0
    ([3.0, 3.0], True)
    """
    namespace, name = qualname.split("::")

    def decorate(fn: Callable) -> OpDef:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        unknown = [a for a in mutates_args if a not in params]
        if unknown:
            raise ValueError(f"define_op({qualname!r}): mutates_args {unknown} are not positional "
                             f"arguments of {fn.__name__}; expected names among {params}.")
        mutated = tuple(params.index(a) for a in mutates_args)
        lib = _LIBRARIES.get(namespace)
        if lib is None:
            lib = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
        lib.define(name + (schema or torch.library.infer_schema(fn, mutates_args=mutates_args)))

        if by_device:
            for device_type, key in providers.DISPATCH_KEYS.items():
                lib.impl(name, _device_kernel(fn, providers.route(name, device_type), mutated), key)
            lib.impl(name, _other_backends_kernel(fn, qualname), "CompositeExplicitAutograd")
        else:
            lib.impl(name, _kernel(fn, name, mutated), "CompositeExplicitAutograd")
        lib.impl(name, torch.library.fallthrough_kernel, "Autograd")  # not differentiable
        opdef = DEFINED[qualname] = OpDef(qualname, fn, lib)
        return opdef

    return decorate


def _bump_versions(args: tuple, mutated: tuple[int, ...]) -> None:
    if len(mutated) == 1:  # one written argument (the attention ops' out): no list to build
        i = mutated[0]
        if i < len(args) and args[i] is not None:
            torch.autograd.graph.increment_version(args[i])
        return
    written = [args[i] for i in mutated if i < len(args) and args[i] is not None]
    if written:
        torch.autograd.graph.increment_version(written)


def _kernel(fn: Callable, name: str, mutated: tuple[int, ...]) -> Callable:
    """``fn`` as a kernel for every device: its result, mutated arguments' versions bumped."""
    def run(args, kwargs):
        result = fn(*args, **kwargs)
        if mutated:
            _bump_versions(args, mutated)
        return result

    def kernel(*args, **kwargs):
        if torch.is_grad_enabled():  # one frame more, not a second pass through the kernel
            with torch.no_grad():
                return run(args, kwargs)
        return run(args, kwargs)

    kernel.__name__ = kernel.__qualname__ = fn.__name__
    return kernel


def _device_kernel(check: Callable, route: providers.Route, mutated: tuple[int, ...]) -> Callable:
    """The kernel of one device type: ``check``, then what ``route`` resolved runs (the
    provider's function itself, ``Route.target``), then the written arguments' versions.

    One Python frame between the dispatcher and the provider. Not differentiable: under grad
    mode the body runs with grad mode switched off (``torch.set_grad_enabled`` called as a
    function, what ``torch.no_grad()`` does, without a second frame) and on again after, also
    when it raises, so no provider records a graph."""
    target = route.target
    one = mutated[0] if len(mutated) == 1 else None  # one written argument: no list to build
    increment_version = torch.autograd.graph.increment_version
    is_grad_enabled, set_grad_enabled = torch.is_grad_enabled, torch.set_grad_enabled

    def kernel(*args, **kwargs):
        grad = is_grad_enabled()
        if grad:
            set_grad_enabled(False)
        try:
            replaced = check(*args, **kwargs)
            if replaced is not None:
                args = replaced
            result = target()(*args, **kwargs)
            if one is not None:  # (trailing defaulted arguments may not be passed)
                if one < len(args) and args[one] is not None:
                    increment_version(args[one])
            elif mutated:
                _bump_versions(args, mutated)
            return result
        finally:
            if grad:
                set_grad_enabled(True)

    kernel.__name__ = kernel.__qualname__ = f"{check.__name__}_{route.device_type}"
    return kernel


def _other_backends_kernel(check: Callable, qualname: str) -> Callable:
    """The kernel of every other backend key (sparse layouts, devices without providers): the
    checks, which name a non-dense argument, else a ``RuntimeError`` naming the device."""
    def kernel(*args, **kwargs):
        check(*args, **kwargs)
        kinds = sorted({f"{a.device.type} {a.layout}" for a in args
                        if isinstance(a, torch.Tensor)})
        raise RuntimeError(f"{qualname}: no provider runs on {', '.join(kinds)} tensors; "
                           f"expected dense (torch.strided) tensors on one of "
                           f"{sorted(providers.DISPATCH_KEYS)}.")

    kernel.__name__ = kernel.__qualname__ = f"{check.__name__}_other_backends"
    return kernel


__all__ = ["OpDef", "DEFINED", "define_op"]
