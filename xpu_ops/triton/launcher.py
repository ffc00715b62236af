"""``BoundLaunch``: re-launch an already specialised Triton kernel with little host work.

``kernel[grid](*args, **meta)`` goes through ``JITFunction.run`` on every call: it binds and
specialises every argument (integer divisibility, pointer alignment, dtypes), hashes the result
into a cache key and looks the compiled kernel up, which costs tens of microseconds of host time
for a kernel with ~50 arguments. A decode step calls the same few kernels once per layer with
arguments that differ only in some tensors (the layer's cache, its q/k/v/out), so the
specialisation can be done once: a ``BoundLaunch`` fixes the grid, the meta-parameters and every
argument except the tensors at ``slots``, and keeps the ``CompiledKernel`` that the first launch
returned per alignment class of the slot tensors (the only property of theirs that Triton
specialises on besides the dtype, which is part of the key too). Later launches call the compiled
kernel's own launcher (``CompiledKernel[grid](*args, stream=...)``), as Inductor's generated code
launches its kernels, with every tensor passed as its address: Triton's launcher accepts ints for
pointer arguments and then skips, per tensor, the ``data_ptr()`` call and, on CUDA, the driver
query (``cuPointerGetAttribute``) it makes to reject host memory, a large part of a launch's host
time for a kernel with 17 tensor arguments (Intel's XPU launcher queries every pointer either
way). Host tensors are rejected here instead (a ``ValueError`` for slot tensors; fixed host
tensors keep the normal path). The table of compiled kernels is keyed by the dtype and 16-byte
alignment of every tensor argument, fixed and slot; a launch keeps no call's slot tensors alive.

Falls back to ``kernel[grid](...)`` (the normal path) on the CPU interpreter, with Triton < 3.3
(whose launchers took a different argument list), and for launches created while
``XPU_OPS_TRITON_FAST_LAUNCH=0`` is set (read once per ``BoundLaunch``: the per-call
``os.environ`` lookup alone cost a few microseconds).
"""

from __future__ import annotations

import functools
import inspect

from typing import Any, Optional, Sequence

import torch

from .. import providers
from ._common import HAS_TRITON, launch

_knobs = None
if HAS_TRITON:
    import triton
    from triton.runtime.driver import driver as _driver
    try:
        from triton import knobs as _knobs  # Triton >= 3.3
    except ImportError:
        pass


def _triton_at_least(major: int, minor: int) -> bool:
    try:
        version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    except (NameError, ValueError):
        return False
    return version >= (major, minor)


# Triton >= 3.3 launchers take every bound argument, constexprs included, in signature order.
_LAUNCHER_TAKES_ALL_ARGS = _knobs is not None and _triton_at_least(3, 3)


def fast_launch_enabled() -> bool:
    """False when ``XPU_OPS_TRITON_FAST_LAUNCH=0`` (launches created while it is set take the
    normal path every time) or Triton is older than 3.3."""
    return _LAUNCHER_TAKES_ALL_ARGS and providers.getenv("XPU_OPS_TRITON_FAST_LAUNCH") != "0"


def _active(hook) -> bool:
    # Triton >= 3.5 keeps a HookChain (never None) that is empty unless a profiler added hooks.
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_installed() -> bool:
    """True when a launch hook is registered (profilers); launches then pass it metadata."""
    runtime = _knobs.runtime
    return _active(runtime.launch_enter_hook) or _active(runtime.launch_exit_hook)


@functools.lru_cache(maxsize=None)
def _parameter_names(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def _check_slots(fn, slots: tuple[int, ...], num_args: int) -> None:
    bad = [i for i in slots if not 0 <= i < num_args]
    if bad:
        raise ValueError(f"BoundLaunch: slots {bad} are not positions of the {num_args} "
                         f"positional arguments of {fn.__name__}.")


class BoundLaunch:
    """``kernel[grid](*args, **meta)`` with everything fixed but the tensors at ``slots``.

    Args:
        kernel: a ``@triton.jit`` function.
        grid: ``(x, y, z)`` program counts (ints; missing trailing entries are 1).
        device: where the kernel runs; ``cpu`` launches through the interpreter every time.
        args: the positional arguments in the kernel's order; the entries at ``slots`` are
            placeholders (their values at construction are ignored).
        meta: keyword arguments: every kernel parameter after the positional ones (the
            constexprs, defaulted or not) and launch options (``num_warps``, ``num_stages``).
        slots: positions in ``args`` of the tensors given per call.
    Raises:
        TypeError: a parameter after the positional ones is missing from ``meta``, or more
            positional arguments than parameters.
        ValueError: ``grid`` is not 1 to 3 ints >= 0, or a slot is not a positional index.
        (Calls raise TypeError unless given exactly one tensor per slot.)

    Calling the object with one tensor per slot launches the kernel. The caller guarantees that
    these tensors have the shapes and strides the fixed arguments were computed from (dtype and
    16-byte alignment may change: both select a separately compiled kernel).
    """

    __slots__ = ("kernel", "grid", "device", "args", "meta", "slots", "_tail", "_compiled",
                 "_families", "_device_index", "_fast", "_ptrs")

    def __init__(self, kernel, grid: Sequence[int], device: torch.device, args: Sequence[Any],
                 meta: dict[str, Any], slots: Sequence[int],
                 _families: Optional[dict[tuple, dict]] = None):
        if not 1 <= len(grid) <= 3 or not all(
                isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in grid):
            raise ValueError(f"BoundLaunch: grid must be 1 to 3 ints >= 0, got {tuple(grid)!r}.")
        grid = tuple(int(g) for g in grid)
        self.kernel = kernel
        self.grid = grid + (1,) * (3 - len(grid))
        self.device = device
        self.args = list(args)
        self.meta = dict(meta)
        self.slots = tuple(slots)
        # Parameter names from the Python function (the interpreter's kernels have no .params).
        fn = getattr(kernel, "fn", kernel)
        names = _parameter_names(fn)
        if len(args) > len(names):
            raise TypeError(f"BoundLaunch: {len(args)} positional arguments for kernel "
                            f"{fn.__name__} of {len(names)} parameters.")
        missing = [n for n in names[len(args):] if n not in meta]
        if missing:
            raise TypeError(f"BoundLaunch: kernel {fn.__name__} needs {missing} in "
                            f"meta; expected every parameter after the positional ones, "
                            f"got {sorted(meta)}.")
        _check_slots(fn, self.slots, len(args))
        # Constexpr values in signature order, appended after the positional arguments.
        self._tail: Optional[tuple] = (tuple(meta[n] for n in names[len(args):])
                                       if hasattr(kernel, "params") else None)
        self._init_launch_state({} if _families is None else _families)

    def _init_launch_state(self, families: dict[tuple, dict]) -> None:
        """Share ``families`` with the launches bound from this one: (slots, dtype and 16-byte
        alignment of each fixed tensor) -> (dtype and alignment of each slot tensor) ->
        CompiledKernel, i.e. every property Triton specialises a tensor argument on; read
        ``XPU_OPS_TRITON_FAST_LAUNCH`` and the device index for this launch."""
        fixed = [a for i, a in enumerate(self.args)
                 if isinstance(a, torch.Tensor) and i not in self.slots]
        self._families = families
        family = (self.slots, tuple((t.dtype, t.data_ptr() & 15 == 0) for t in fixed))
        self._compiled: dict[tuple, Any] = families.setdefault(family, {})
        self._fast = (self.device.type != "cpu" and self._tail is not None
                      and fast_launch_enabled())
        # Fast launches pass the fixed tensors as their addresses (ints): the compiled kernel's
        # launcher otherwise calls data_ptr() and asks the driver about every pointer on every
        # launch (cuPointerGetAttribute on CUDA, to reject host memory). Host tensors keep the
        # normal path, whose launcher rejects them with its own error. self.args keeps the
        # fixed tensors alive (and serves the JIT path); slot tensors are never kept.
        self._ptrs = None
        if self._fast:
            if any(t.device.type == "cpu" for t in fixed):
                self._fast = False
            else:
                self._ptrs = [a.data_ptr() if isinstance(a, torch.Tensor) else a
                              for a in self.args]
        device = self.device
        self._device_index = device.index if device.index is not None else (
            torch.cuda.current_device() if device.type == "cuda" and torch.cuda.is_available()
            else 0)

    def bind(self, fixed: dict[int, Any], slots: Sequence[int]) -> "BoundLaunch":
        """A new launch with the arguments at ``fixed`` (position -> value) set and ``slots`` as
        its per-call tensors (e.g. a layer-independent page table fixed for a whole step).

        It shares this launch's table of compiled kernels, keyed by everything Triton
        specialises a tensor on (dtype, 16-byte alignment) for the fixed and the slot tensors.
        Grid, meta-parameters and constexpr tail were checked when this launch was made and are
        shared, not checked again (a decode step binds a few launches per step, so this is host
        time per step).

        Raises:
            TypeError: a value in ``fixed`` is not a tensor (scalars are fixed at construction).
            ValueError: a slot is not a positional index.
        """
        args = list(self.args)
        for i, value in fixed.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"BoundLaunch.bind: fixed argument {i} is "
                                f"{type(value).__name__}; expected a tensor.")
            args[i] = value
        slots = tuple(slots)
        _check_slots(getattr(self.kernel, "fn", self.kernel), slots, len(args))
        bound = object.__new__(BoundLaunch)
        bound.kernel, bound.grid, bound.device = self.kernel, self.grid, self.device
        bound.args, bound.slots, bound._tail = args, slots, self._tail
        bound.meta = self.meta  # shared: never mutated after construction
        bound._init_launch_state(self._families)
        return bound

    def _with(self, tensors: Sequence[torch.Tensor]) -> list:
        """The positional arguments with ``tensors`` at the slots (a new list: the launch does
        not keep a call's tensors alive)."""
        args = list(self.args)
        for i, t in zip(self.slots, tensors):
            args[i] = t
        return args

    def __call__(self, *tensors: torch.Tensor) -> None:
        if len(tensors) != len(self.slots):
            raise TypeError(f"BoundLaunch: {self.kernel.fn.__name__} takes {len(self.slots)} "
                            f"tensors (slots {list(self.slots)}), got {len(tensors)}.")
        if not self._fast:
            launch(self.kernel, self.grid, self.device, *self._with(tensors), **self.meta)
            return
        ptrs, key = self._ptrs, []
        for i, t in zip(self.slots, tensors):
            if t.is_cpu:  # an address the device cannot read: the launcher would not check it
                raise ValueError(f"BoundLaunch: {self.kernel.fn.__name__} argument {i} is a "
                                 f"host tensor; expected a tensor on {self.device}.")
            ptr = ptrs[i] = t.data_ptr()
            key.append((t.dtype, ptr & 15 == 0))
        key = tuple(key)
        compiled = self._compiled.get(key)
        if compiled is None:
            # First launch of this alignment class: Triton binds, specialises, compiles or
            # finds the kernel, launches it and returns it.
            self._compiled[key] = self.kernel[self.grid](*self._with(tensors), **self.meta)
            return
        stream = _driver.active.get_current_stream(self._device_index)
        if _hooks_installed():  # the launcher then builds launch metadata for the hooks
            compiled[self.grid](*self._with(tensors), *self._tail, stream=stream)
            return
        g = self.grid
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None,
                     None, None, *ptrs, *self._tail)


__all__ = ["BoundLaunch", "fast_launch_enabled"]
