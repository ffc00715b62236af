"""``OpPlan``: validate an op call once, then re-run it with new tensors in some arguments.

The plan/run split of FlashInfer's wrappers, applied to any ``xpu_ops`` op: a decode step calls
the same op once per layer with the same metadata (page table, sequence lengths, scalars) and
different per-layer tensors (q, the layer's cache, out). ``OpPlan(op, args, kwargs, slots)``
runs the op's shape checks (its fake implementation) and provider selection once; ``run`` then
only checks that each slot tensor has the planned shape, strides, dtype and device and calls the
selected provider's implementation directly (or the provider's own plan of the call, when it
registered one): no public-wrapper defaults, no dispatcher round trip, no repeated checks.
Outputs a provider allocates per call (the LSE of the attention ops) may be buffers of the plan,
overwritten by its next run. ``planned_call`` keeps plans in a caller-owned dict (e.g. one per
forward step) and re-plans when a slot tensor no longer matches.

For eager execution only (piecewise graphs run attention eagerly between captured pieces): a
plan calls Python directly, so it is invisible to ``torch.compile`` and to autograd (mutated
arguments get no version-counter bump), and the debug-mode value checks
(``XPU_OPS_DEBUG_CHECKS=1``) of the public wrappers do not run. Callers use the ops themselves
unless ``plan_applies(t)`` says a plan would do the same thing.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import providers
from ._registration import DEFINED
from ._value_checks import debug_checks_enabled


def plan_applies(t: Tensor) -> bool:
    """True when a plan may replace an op call on ``t``: the call would run its kernel right
    away (not under Dynamo, no Python dispatch mode such as fake tensors, ``make_fx`` or
    functionalization, ``t`` a plain tensor rather than a subclass such as ``FakeTensor``) and
    the debug value checks (``XPU_OPS_DEBUG_CHECKS=1``, ``xpu_ops.debug_checks()``), which only
    the public ops run, are off."""
    return (type(t) is Tensor and not torch.compiler.is_compiling()
            and _get_current_dispatch_mode() is None and not debug_checks_enabled())


def _signature(t: Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


_SCALAR_TYPES = {"int": (int,), "float": (float, int), "bool": (bool,)}


def _check_call(op: str, opdef, args: Sequence[Any], kwargs: dict[str, Any],
                slots: Sequence[int]) -> list[str]:
    """The op's argument names, after checking the slots and the scalar arguments' types
    against the schema (what the dispatcher would check on an op call). Raises as ``OpPlan``."""
    schema = opdef.op.default._schema
    names = [a.name for a in schema.arguments]
    for i in slots:
        if not 0 <= i < len(args) or not isinstance(args[i], Tensor):
            got = "out of range" if not 0 <= i < len(args) else type(args[i]).__name__
            raise ValueError(f"OpPlan({op}): slot {i} must be the position of a tensor in args "
                             f"(0..{len(args) - 1}, {names[:len(args)]}); got {got}.")
    values = dict(zip(names, args), **kwargs)
    for arg in schema.arguments:
        allowed = _SCALAR_TYPES.get(str(arg.type))
        value = values.get(arg.name)
        if allowed and arg.name in values and (not isinstance(value, allowed)
                                               or (bool not in allowed
                                                   and isinstance(value, bool))):
            raise TypeError(f"OpPlan({op}): {arg.name} must be {arg.type}, got "
                            f"{type(value).__name__} {value!r}.")
    return names


class OpPlan:
    """One validated call of ``torch.ops.xpu_ops.<op>``, re-runnable with new slot tensors.

    Args:
        op: op name without namespace, e.g. ``"flash_attn_with_kvcache"``.
        args, kwargs: a complete call of the op (as ``torch.ops.xpu_ops.<op>`` takes it).
        slots: positions in ``args`` of the tensors that change between runs.
    Raises:
        KeyError: ``op`` is not an ``xpu_ops`` op.
        ValueError: a slot is not a position of a tensor in ``args``.
        TypeError: a scalar argument has the wrong type for the op's schema (int, float, bool).
        TypeError, ValueError, NotImplementedError: the op's own checks reject ``args``.
        RuntimeError: no provider can run the call.

    A plan made under ``torch.inference_mode()`` may return inference tensors (the LSE buffer of
    the Triton provider's plan) also when run outside it.
    """

    __slots__ = ("op", "_args", "_kwargs", "slots", "_names", "_template", "_fn", "_planned")

    def __init__(self, op: str, args: Sequence[Any], kwargs: dict[str, Any],
                 slots: Sequence[int]):
        opdef = DEFINED[f"xpu_ops::{op}"]
        names = _check_call(op, opdef, args, kwargs, slots)
        if opdef.fake is not None:
            opdef.fake(*args, **kwargs)  # the op's shape/dtype/device checks
        device = next(a.device for a in args if isinstance(a, Tensor))
        impl = providers.select(op, device, *args, **kwargs)
        self.op = op
        self._fn = impl.fn
        self._args = list(args)
        self._kwargs = dict(kwargs)
        self.slots = tuple(slots)
        self._names = tuple(names[i] for i in self.slots)
        self._template = tuple(_signature(args[i]) for i in self.slots)
        # The provider's own plan (e.g. Triton: launch grid, scratch and arguments fixed once).
        self._planned = impl.plan(tuple(args), self._kwargs, self.slots) if impl.plan else None

    def matches(self, tensors: Sequence[Tensor]) -> bool:
        """True when every tensor has its slot's planned shape, strides, dtype and device."""
        for t, (shape, stride, dtype, device) in zip(tensors, self._template):
            if t.dtype != dtype or t.shape != shape or t.stride() != stride or t.device != device:
                return False
        return True

    def run(self, *tensors: Tensor):
        """Run the op with ``tensors`` in the slots; returns what the op returns.

        Raises:
            TypeError: not one tensor per slot.
            ValueError: a tensor differs from its slot's planned shape, strides, dtype or device.
        """
        if len(tensors) != len(self.slots) or not all(isinstance(t, Tensor) for t in tensors):
            raise TypeError(f"OpPlan({self.op}).run: expected one tensor per slot "
                            f"{list(self._names)}, got "
                            f"{[type(t).__name__ for t in tensors]}.")
        if not self.matches(tensors):
            for name, t, want in zip(self._names, tensors, self._template):
                if _signature(t) != want:
                    raise ValueError(f"OpPlan({self.op}).run: {name} has shape "
                                     f"{tuple(t.shape)}, strides {t.stride()}, {t.dtype} on "
                                     f"{t.device}; expected the planned {tuple(want[0])}, "
                                     f"{want[1]}, {want[2]} on {want[3]}. Make a new plan.")
        return self.run_matched(tensors)

    def run_matched(self, tensors: Sequence[Tensor]):
        """``run`` for tensors already known to match (``matches`` returned True)."""
        if self._planned is not None:
            return self._planned(*tensors)
        args = self._args
        for i, t in zip(self.slots, tensors):
            args[i] = t
        return self._fn(*args, **self._kwargs)


def planned_call(plans: dict, key: Any, op: str, args: Sequence[Any], kwargs: dict[str, Any],
                 slots: Sequence[int]):
    """Call ``op`` through the plan stored under ``key`` in ``plans``, planning it first when
    there is none or its slot tensors no longer match.

    ``key`` must identify everything outside the slots: the non-slot tensors (by ``id``; the
    plan keeps them alive, so an id cannot be reused while the plan exists) and every scalar.
    Raises what ``OpPlan`` raises.
    """
    tensors = [args[i] for i in slots]
    plan = plans.get(key)
    if plan is None or not plan.matches(tensors):
        plan = plans[key] = OpPlan(op, args, kwargs, slots)
    return plan.run_matched(tensors)


__all__ = ["OpPlan", "planned_call", "plan_applies"]
