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

Validation is cached across plans: a decode step makes new plans for its new metadata tensors,
but with the shapes of the previous step's. What validation found (the schema's argument
checks, the fake's shape checks, the selected provider) is kept per call signature: ``op``, the
slots, every tensor argument's shape, strides, dtype and device, every scalar's type and exact
value, and ``providers.selection_state()``. A plan whose signature was validated before skips
straight to binding its own tensors (and the provider's own plan of them). Only successful
validations are kept, so a rejected call raises again every time. The checks read nothing else
(``xpu_ops/_checks.py``: never tensor values), so a cached answer is the answer the checks would
give. Calls with arguments of other kinds (tensor subclasses, lists) are validated every time.

For eager execution only (piecewise graphs run attention eagerly between captured pieces): a
plan calls Python directly, so it is invisible to ``torch.compile`` and to autograd (mutated
arguments get no version-counter bump), and the debug-mode value checks
(``XPU_OPS_DEBUG_CHECKS=1``) of the public wrappers do not run. Callers use the ops themselves
unless ``plan_applies(t)`` says a plan would do the same thing.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import providers
from ._registration import DEFINED
from ._value_checks import debug_checks_enabled


def plans_enabled() -> bool:
    """The half of ``plan_applies`` that does not depend on the tensor: not under Dynamo, no
    Python dispatch mode (fake tensors, ``make_fx``, functionalization) and the debug value
    checks off. Callers that plan several calls in a row without running other code in between
    (one attention layer: its store, then its attention) may ask once and test each tensor with
    ``type(t) is Tensor``."""
    return (not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and not debug_checks_enabled())


def plan_applies(t: Tensor) -> bool:
    """True when a plan may replace an op call on ``t``: the call would run its kernel right
    away (``plans_enabled()``: not under Dynamo, no Python dispatch mode such as fake tensors,
    ``make_fx`` or functionalization; the debug value checks (``XPU_OPS_DEBUG_CHECKS=1``,
    ``xpu_ops.debug_checks()``), which only the public ops run, off) and ``t`` is a plain tensor
    rather than a subclass such as ``FakeTensor``."""
    return type(t) is Tensor and plans_enabled()


def _signature(t: Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


_SCALAR_TYPES = {"int": (int,), "float": (float, int), "bool": (bool,)}


@functools.lru_cache(maxsize=None)
def _schema_info(opdef) -> tuple[tuple[str, ...], tuple[tuple[str, tuple, str], ...]]:
    """``(argument names, (name, allowed Python types, schema type) of each int/float/bool
    argument)`` of ``opdef``'s schema, read once (reading a schema builds new objects)."""
    arguments = opdef.op.default._schema.arguments
    names = tuple(a.name for a in arguments)
    scalars = tuple((a.name, _SCALAR_TYPES[str(a.type)], str(a.type)) for a in arguments
                    if str(a.type) in _SCALAR_TYPES)
    return names, scalars


def _check_call(op: str, opdef, args: Sequence[Any], kwargs: dict[str, Any],
                slots: Sequence[int]) -> tuple[str, ...]:
    """The op's argument names, after checking the slots and the scalar arguments' types
    against the schema (what the dispatcher would check on an op call). Raises as ``OpPlan``."""
    names, scalars = _schema_info(opdef)
    for i in slots:
        if not 0 <= i < len(args) or not isinstance(args[i], Tensor):
            got = "out of range" if not 0 <= i < len(args) else type(args[i]).__name__
            raise ValueError(f"OpPlan({op}): slot {i} must be the position of a tensor in args "
                             f"(0..{len(args) - 1}, {list(names[:len(args)])}); got {got}.")
    values = dict(zip(names, args), **kwargs)
    for name, allowed, type_name in scalars:
        value = values.get(name)
        if name in values and (not isinstance(value, allowed)
                               or (bool not in allowed and isinstance(value, bool))):
            raise TypeError(f"OpPlan({op}): {name} must be {type_name}, got "
                            f"{type(value).__name__} {value!r}.")
    return names


class _Validated(NamedTuple):
    """What validating one call signature found (see the module docstring)."""
    slot_names: tuple[str, ...]
    impl: providers.Implementation
    declined: tuple[tuple[str, str], ...]  # (provider, reason) fallbacks, re-counted per plan


_VALIDATED: dict[tuple, _Validated] = {}
_VALIDATED_MAX = 1024  # signatures kept; the oldest goes first
_VALIDATED_LOCK = threading.Lock()  # held to change _VALIDATED (reads need no lock)
_validation_counts = {"hits": 0, "misses": 0}


def _arg_key(value: Any) -> Optional[tuple]:
    """All that checks and provider selection may read of one argument, hashable: a plain
    tensor's shape, strides, dtype and device; a scalar's type and value (a float's exact bits);
    None for any other kind of argument (its call is not cached)."""
    kind = type(value)
    if kind is Tensor:
        return _signature(value)
    if kind is float:
        return kind, value.hex()
    if value is None or kind is bool or kind is int or kind is str:
        return kind, value
    return None


def _call_key(op: str, args: Sequence[Any], kwargs: dict[str, Any],
              slots: tuple[int, ...]) -> Optional[tuple]:
    """The signature ``_VALIDATED`` is keyed by, or None when the call cannot be cached."""
    arg_keys = tuple(map(_arg_key, args))
    kw_keys = tuple(zip(kwargs, map(_arg_key, kwargs.values())))
    if None in arg_keys or any(key is None for _, key in kw_keys):
        return None
    try:
        state = providers.selection_state()
    except ValueError:  # a bad XPU_OPS_PROVIDER: validate afresh, which raises in order
        return None
    return op, slots, arg_keys, kw_keys, state


def _validate(op: str, args: Sequence[Any], kwargs: dict[str, Any],
              slots: tuple[int, ...]) -> _Validated:
    """Run the checks of a call and select its provider. Raises as ``OpPlan``."""
    opdef = DEFINED[f"xpu_ops::{op}"]
    names = _check_call(op, opdef, args, kwargs, slots)
    if opdef.fake is not None:
        opdef.fake(*args, **kwargs)  # the op's shape/dtype/device checks
    device = next(a.device for a in args if isinstance(a, Tensor))
    impl, declined = providers.select_declined(op, device, *args, **kwargs)
    return _Validated(tuple(names[i] for i in slots), impl, declined)


def _validated(key: Optional[tuple], op: str, args: Sequence[Any], kwargs: dict[str, Any],
               slots: tuple[int, ...]) -> _Validated:
    """``_validate``'s answer for this call, cached under its ``_call_key`` ``key`` (see the
    module docstring)."""
    found = None if key is None else _VALIDATED.get(key)
    if found is not None:
        _validation_counts["hits"] += 1
        for provider, reason in found.declined:  # count the fallback for this call too
            providers.record_fallback(op, provider, reason)
        return found
    _validation_counts["misses"] += 1
    found = _validate(op, args, kwargs, slots)
    if key is not None:
        with _VALIDATED_LOCK:  # threads planning at once: evict and insert one at a time
            if len(_VALIDATED) >= _VALIDATED_MAX:
                del _VALIDATED[next(iter(_VALIDATED))]
            _VALIDATED[key] = found
    return found


def validation_cache_info() -> dict[str, int]:
    """``{"hits", "misses", "size"}``: plans that reused a cached validation, plans that ran the
    checks, and the signatures kept now."""
    return dict(_validation_counts, size=len(_VALIDATED))


def clear_validation_cache() -> None:
    """Forget every cached validation (and reset the counts of ``validation_cache_info``)."""
    with _VALIDATED_LOCK:
        _VALIDATED.clear()
    _validation_counts.update(hits=0, misses=0)


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

    The checks and the provider selection run once per call signature (module docstring); a
    plan of an already validated signature only binds its tensors.

    A plan made under ``torch.inference_mode()`` may return inference tensors (the LSE buffer of
    the Triton provider's plan) also when run outside it.
    """

    __slots__ = ("op", "_args", "_kwargs", "slots", "_names", "_template", "_fn", "_planned")

    def __init__(self, op: str, args: Sequence[Any], kwargs: dict[str, Any],
                 slots: Sequence[int]):
        slots = tuple(slots)
        key = _call_key(op, args, kwargs, slots)
        checked = _validated(key, op, args, kwargs, slots)
        impl = checked.impl
        self.op = op
        self._fn = impl.fn
        self._args = list(args)
        self._kwargs = dict(kwargs)
        self.slots = slots
        self._names = checked.slot_names
        # The slots' tensor keys, a list so that ``matches`` compares them in one go.
        self._template = ([_signature(args[i]) for i in slots] if key is None
                          else [key[2][i] for i in slots])
        # The provider's own plan (e.g. Triton: launch grid, scratch and arguments fixed once).
        self._planned = impl.plan(tuple(args), self._kwargs, self.slots) if impl.plan else None

    def matches(self, tensors: Sequence[Tensor]) -> bool:
        """True when every tensor has its slot's planned shape, strides, dtype and device."""
        return [(t.shape, t.stride(), t.dtype, t.device) for t in tensors] == self._template

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


def planned_run(plans: dict, key: Any, tensors: Sequence[Tensor],
                make_call: Callable[[], tuple[str, Sequence[Any], dict[str, Any], Sequence[int]]],
                record: Optional[list] = None):
    """Run the plan stored under ``key`` in ``plans`` with ``tensors`` in its slots; when there
    is none or the tensors no longer match it, plan ``make_call()`` first.

    ``planned_call`` for hot paths: the full call ``(op, args, kwargs, slots)`` is only built
    when a plan is made, a re-run only reads ``tensors`` (``args[i] for i in slots``, in order).
    ``key`` must identify everything outside the slots, as for ``planned_call``. ``record``:
    a list that gets ``(plan, tensors)`` appended, for callers that replay the run later with
    ``plan.run_matched(tensors)`` (``compile/layer_replay.py``).

    Raises:
        ValueError: ``tensors`` are not the slot tensors of ``make_call()``'s call.
        Whatever ``OpPlan`` raises.
    """
    plan = plans.get(key)
    if plan is None or not plan.matches(tensors):
        op, args, kwargs, slots = make_call()
        if len(slots) != len(tensors) or any(args[i] is not t for i, t in zip(slots, tensors)):
            raise ValueError(f"planned_run({op}): tensors must be args[i] for i in slots "
                             f"{tuple(slots)}; got {len(tensors)} other tensors. Pass the "
                             "call's own slot tensors.")
        plan = plans[key] = OpPlan(op, args, kwargs, slots)
    if record is not None:
        record.append((plan, tensors))
    return plan.run_matched(tensors)


def planned_call(plans: dict, key: Any, op: str, args: Sequence[Any], kwargs: dict[str, Any],
                 slots: Sequence[int]):
    """Call ``op`` through the plan stored under ``key`` in ``plans``, planning it first when
    there is none or its slot tensors no longer match.

    ``key`` must identify everything outside the slots: the non-slot tensors (by ``id``; the
    plan keeps them alive, so an id cannot be reused while the plan exists) and every scalar.
    Raises what ``OpPlan`` raises.
    """
    return planned_run(plans, key, [args[i] for i in slots], lambda: (op, args, kwargs, slots))


__all__ = ["OpPlan", "planned_call", "planned_run", "plan_applies", "plans_enabled",
           "validation_cache_info", "clear_validation_cache"]
