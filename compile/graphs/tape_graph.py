"""``TapeGraph``: a CPU device graph that replays a recorded op tape, never the Python.

A CUDA (or XPU) graph records kernels, not Python: every host decision taken while capturing
is frozen into it. Python ints read from tensors, the tensor object an attribute held, a
provider's choice of kernel path, split count, grid or workspace, the length of a list: all are
what they were at capture, and a replay re-launches the recorded kernels on the recorded memory.
``EmulatedGraph`` (``compile/graphs/graph_wrapper.py``) reruns the callable at each replay, so on
the CPU a backend that rebinds ``self.buf = new_tensor`` between steps, or metadata computed on
the host at capture and stale later, passes tests that fail on a GPU. ``TapeGraph`` records what
a device graph would hold and replays only that.

Capture (``TapeGraph(fn, args)``): ``fn(*args)`` runs once, its result is this call's, under
``torch.compiler.set_stance("force_eager")`` (Dynamo refuses to trace under a dispatch mode; a
``torch.compile``d callable runs its eager code) inside a ``TorchDispatchMode`` that records:

- every ATen op that writes memory: in-place and ``out=`` ops (rerun at replay) and functional
  ops (rerun, the fresh result copied into the tensor the capture returned: a fixed address);
  their arguments are kept as they were (tensors by object, containers copied, Python numbers
  frozen). Views (ops that returned an alias of an input: a ``reshape`` that copied is
  recorded), allocations (``empty*``) and host reads (``.item()``, ``.tolist()``, ops without
  tensor results) are not rerun: their results are fixed objects or frozen numbers;
- a kernel op of ``xpu_ops`` (one routed to providers): its inner ops and Triton launches when
  it launched any (the ``triton`` provider: its host logic, grid, split count and workspace are
  frozen, as on a GPU); else one entry that reruns the op on the recorded arguments (the
  ``reference`` provider stands for a device kernel: its PyTorch code reads lengths from
  memory on every replay, as the kernel would; a provider forced at capture is forced again);
- other custom ops (``compile``'s split ops: the attention backend's Python): their inner ops;
- Triton launches (``xpu_ops.triton._common.LAUNCH_OBSERVERS``): kernel, grid, arguments.

Replay (``replay()``): the entries in order, on the recorded tensors, under the grad and
inference modes of the capture. A functional op whose fresh result changed shape (a
data-dependent shape, e.g. ``nonzero``, which a device graph cannot capture) raises.

Not seen, so not faithful:

- Inductor's CPU kernels (C++ called around the dispatcher): under ``force_eager`` a
  ``torch.compile``d callable runs its eager code, so a whole step's replay reruns the eager op
  sequence of the capture, not Inductor's kernels; an Inductor piece (``PiecewiseBackend``) is
  captured with the rerun emulation instead (compiled code is a fixed kernel sequence: rerunning
  it is a replay);
- host versus device memory: every tensor here is device memory, so an op on what would be a
  host tensor on a GPU (a ``*_cpu`` list's tensor) is rerun at replay, where a device graph
  would have frozen its result (or, pinned and ``non_blocking``, copied it again);
- the shared memory pool: a real graph's intermediates may reuse memory of another graph of
  the pool; here each graph keeps its own (outputs are never overwritten by another graph).

CUDA-graph mapping: the tape is the graph's kernel list, its tensors are the pool memory that
the graph holds alive, and the frozen Python is what the capture baked in.

>>> import torch
>>> class Step:
...     def __init__(self):
...         self.scale = torch.tensor([2.0])
...     def __call__(self, x):
...         return x * self.scale
>>> step, x = Step(), torch.ones(2)
>>> graph = TapeGraph(step, (x,))
>>> step.scale = torch.tensor([3.0])  # rebinding: a device graph still reads the old tensor
>>> _ = x.fill_(5.0)
>>> graph.replay()
>>> graph.outputs.tolist()  # 5 * 2: the rerun callable (EmulatedGraph) gives 5 * 3
[10.0, 10.0]
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from xpu_ops import providers
from xpu_ops.triton import _common as triton_common

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_aten = torch.ops.aten
_ALLOCATIONS = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                _aten.new_empty.default, _aten.new_empty_strided.default}


@dataclasses.dataclass
class TapeOp:
    """An op rerun at replay: ``func(*args, **kwargs)``; ``outputs`` are the capture's result
    tensors with their shapes right after the op (a later ``resize_`` may change them);
    ``provider``: the provider forced at capture (``xpu_ops.use_provider``) of a kernel op, forced
    again at replay."""

    func: Any
    args: tuple
    kwargs: dict
    outputs: list[tuple[Tensor, tuple[int, ...]]]
    provider: Optional[str] = None

    def replay(self) -> None:
        with (providers.use_provider(self.provider) if self.provider
              else contextlib.nullcontext()):
            result = self.func(*self.args, **self.kwargs)
        fresh = [t for t in tree_leaves(result) if isinstance(t, Tensor)]
        for (dst, shape), src in zip(self.outputs, fresh):
            if dst is src or (dst.data_ptr() == src.data_ptr() and dst.stride() == src.stride()):
                continue  # in place or out=: already written at the recorded address
            if tuple(src.shape) != shape:
                raise RuntimeError(f"TapeGraph: {self.func} returned shape {tuple(src.shape)} at "
                                   f"replay, {shape} at capture; a device graph cannot capture "
                                   "an op whose result shape depends on data. Keep such ops "
                                   "out of captured steps.")
            if tuple(dst.shape) != shape:
                dst.resize_(shape)
            dst.copy_(src)


@dataclasses.dataclass
class TapeLaunch:
    """A Triton launch rerun at replay on the recorded arguments (grid and constants frozen)."""

    kernel: Any
    grid: Any
    device: torch.device
    args: tuple
    kwargs: dict

    def replay(self) -> None:
        triton_common.launch(self.kernel, self.grid, self.device, *self.args, **self.kwargs)


def _frozen(tree: Any) -> Any:
    """``tree`` with its containers copied (a later append to a list does not leak in)."""
    return tree_map(lambda leaf: leaf, tree)


def _is_kernel_op(func) -> bool:
    """True for an ``xpu_ops`` op routed to providers (a device kernel on a GPU)."""
    return func.namespace == "xpu_ops" and providers.has_providers(func._opname)


class _Recorder(TorchDispatchMode):
    """The dispatch mode of a capture: appends entries to the innermost open tape."""

    def __init__(self):
        super().__init__()
        self.tapes: list[list] = [[]]
        self.reads: list[int] = [0]  # host reads per open tape
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if func.namespace not in ("aten", "prims"):
            return self._record_custom(func, args, kwargs)
        out = func(*args, **kwargs)
        self._record_aten(func, args, kwargs, out)
        return out

    def _record_aten(self, func, args, kwargs, out) -> None:
        if func in _ALLOCATIONS or (func.is_view and _aliases_an_input(out, args)):
            return
        if not func._schema.is_mutable and not any(isinstance(t, Tensor)
                                                   for t in tree_leaves(out)):
            self.reads[-1] += 1  # its value was read by the host: frozen
            return
        self.tapes[-1].append(_entry(func, args, kwargs, out))

    def _record_custom(self, func, args, kwargs):
        self.tapes.append([])
        self.reads.append(0)
        try:
            with self:
                out = func.redispatch(_CPU_KEYS, *args, **kwargs)
        finally:
            inner, reads = self.tapes.pop(), self.reads.pop()
        if _is_kernel_op(func) and not any(isinstance(e, TapeLaunch) for e in inner):
            entry = _entry(func, args, kwargs, out)  # a device kernel: its reads are its own
            entry.provider = providers.forced_provider()
            self.tapes[-1].append(entry)
        else:
            self.tapes[-1].extend(inner)
            self.reads[-1] += reads
        return out

    def observe_launch(self, kernel, grid, device, args, kwargs):
        """Record a Triton launch; the context keeps the interpreter's own ops off the tape."""
        grid = grid if callable(grid) else tuple(grid)
        self.tapes[-1].append(TapeLaunch(kernel, grid, device, _frozen(args), _frozen(kwargs)))
        return self._pause()

    @contextlib.contextmanager
    def _pause(self):
        self.paused, was = True, self.paused
        try:
            yield
        finally:
            self.paused = was


def _aliases_an_input(out, args) -> bool:
    """True when every tensor of ``out`` shares memory with a tensor of ``args`` (a view op
    that viewed: ``reshape``, ``to``, ``flatten`` may copy instead, and are then recorded)."""
    storages = {t.untyped_storage().data_ptr() for t in tree_leaves(args) if isinstance(t, Tensor)}
    return all(t.untyped_storage().data_ptr() in storages
               for t in tree_leaves(out) if isinstance(t, Tensor))


def _entry(func, args, kwargs, out) -> TapeOp:
    outputs = [(t, tuple(t.shape)) for t in tree_leaves(out) if isinstance(t, Tensor)]
    return TapeOp(func, _frozen(args), _frozen(kwargs), outputs)


# The captures recording now (innermost last); ``_observe_launch`` is one of
# ``LAUNCH_OBSERVERS`` only while this is not empty, so launches outside a capture pay nothing.
_RECORDING: list[_Recorder] = []


def _observe_launch(kernel, grid, device, args, kwargs):
    return _RECORDING[-1].observe_launch(kernel, grid, device, args, kwargs)


class TapeGraph:
    """A captured CPU graph: ``fn(*args)`` recorded once (its result is ``outputs``), replayed
    as the tape of the module docstring.

    Args:
        fn: the callable captured (a step, a piece).
        args: its inputs (kept: a replay reads them where they are).
    Attributes:
        outputs: the capture call's result (a replay writes these tensors).
        tape: ``TapeOp`` and ``TapeLaunch`` entries in order.
        host_reads: ops whose result the host read at capture (frozen numbers; a reference
            kernel op's own reads are not counted). On a GPU each is a host read of device
            memory, which a capture refuses, or of host memory, frozen.
    Raises:
        RuntimeError: at replay, an op whose result shape changed since the capture.
    """

    def __init__(self, fn: Callable, args: Sequence[Any]):
        recorder = _Recorder()
        self.args = tuple(args)
        self.grad, self.inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        if not _RECORDING:
            triton_common.LAUNCH_OBSERVERS.append(_observe_launch)
        _RECORDING.append(recorder)
        try:
            with torch.compiler.set_stance("force_eager"), recorder:
                self.outputs = fn(*self.args)
        finally:
            _RECORDING.remove(recorder)
            if not _RECORDING:
                triton_common.LAUNCH_OBSERVERS.remove(_observe_launch)
        self.tape, self.host_reads = recorder.tapes[0], recorder.reads[0]

    @property
    def launches(self) -> int:
        """Triton launches on the tape."""
        return sum(isinstance(e, TapeLaunch) for e in self.tape)

    def replay(self) -> None:
        """Rerun the tape on the recorded tensors."""
        with torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad):
            for entry in self.tape:
                entry.replay()


__all__ = ["TapeGraph", "TapeOp", "TapeLaunch"]
