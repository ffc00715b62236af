"""Operator registration with a short eager path: ``define_op``.

``torch.library.custom_op`` wraps a mutating op in Python kernels for the Autograd and
ADInplaceOrView keys; the latter re-binds every argument against the schema on each call, which
measured 250-350 us per call of ``flash_attn_with_kvcache`` (18 arguments) on a 2-core CPU,
more than the attention kernel of a decode step. ``define_op`` registers the same thing through
``torch.library.Library`` directly (as vLLM's ``direct_register_custom_op`` does): the schema
(inferred from type hints like ``custom_op``, or given), one ``CompositeExplicitAutograd`` kernel
that serves every device, and a fake. A call then costs one C++ dispatch into the Python
function (about 5 us).

What ``custom_op`` did that ``define_op`` keeps: mutated arguments get their version counter
bumped after the kernel ran (``torch.autograd.graph.increment_version``), so autograd notices
the in-place write. What it drops: the Python autograd kernel. These ops have no backward:
the kernel and the fake raise ``NotImplementedError`` naming the op when grad mode is on and an
input requires grad (``_checks.check_no_grad``), so every provider, eager or traced, refuses
the same calls instead of returning an output whose graph depends on the provider.
``torch.compile`` treats the result like any op with a mutable schema (``auto_functionalized``),
and ``torch.library.opcheck`` runs on it unchanged.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch

from ._checks import check_no_grad

_LIBRARIES: dict[str, torch.library.Library] = {}
DEFINED: dict[str, "OpDef"] = {}


class OpDef:
    """An operator defined by ``define_op``.

    Attributes:
        qualname: ``"namespace::name"``.
        fn: the Python kernel (validated arguments in, results out).
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
        name = self.qualname.split("::")[1]

        def checked_fake(*args, **kwargs):
            check_no_grad(name, args)
            return fake(*args, **kwargs)

        torch.library.register_fake(self.qualname, checked_fake, lib=self._lib)
        self.fake = fake
        return fake

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)

    def __repr__(self) -> str:
        return f"OpDef({self.qualname})"


def define_op(qualname: str, *, mutates_args: Sequence[str],
              schema: Optional[str] = None) -> Callable[[Callable], OpDef]:
    """Decorator: define operator ``qualname`` with the decorated function as its kernel.

    Args:
        qualname: ``"namespace::name"``; the namespace gets one ``FRAGMENT`` library.
        mutates_args: names of the arguments the kernel writes in place (positional
            arguments only; their version counters are bumped after each call).
        schema: the schema after the name, e.g. ``"(Tensor q, Tensor(a!) out) -> ()"``; default:
            inferred from the type hints (``torch.library.infer_schema``).
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

        def kernel(*args, **kwargs):
            check_no_grad(name, args)
            result = fn(*args, **kwargs)
            written = [args[i] for i in mutated if i < len(args) and args[i] is not None]
            if written:
                torch.autograd.graph.increment_version(written)
            return result

        kernel.__name__ = kernel.__qualname__ = fn.__name__
        lib.impl(name, kernel, "CompositeExplicitAutograd")
        opdef = DEFINED[qualname] = OpDef(qualname, fn, lib)
        return opdef

    return decorate


__all__ = ["OpDef", "DEFINED", "define_op"]
