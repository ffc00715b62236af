"""``GraphWrapper``: capture a callable into a device graph per batch descriptor, then replay it.

One class serves both kinds of graph of the serving path (vLLM's ``CUDAGraphWrapper``): a whole
step (``GraphMode.FULL``, wrapped by ``compile/graphs/graph_runner.py``) and each compiled piece
between attention calls (``GraphMode.PIECEWISE``, wrapped by ``compile/graphs/piecewise.py``).
Per call:

1. Read the step's ``BatchDescriptor`` from the forward context. No descriptor, or one of the
   other graph mode (a piece inside a full-graph step): run the callable, uncaptured.
2. The first ``warmup_calls`` calls of a descriptor run the callable (compilation and Triton
   autotuning happen there, never during capture).
3. The next call captures it (one memory pool shared with the owner's other graphs), records
   its input addresses and outputs, and replays once for this call's result.
4. Later calls replay and return the same output tensors (fixed addresses). With ``debug``,
   every replay first checks that no tensor input moved.

What it does not do: copy inputs into fixed buffers (its owner feeds it from its step buffers),
build metadata, or capture while another capture records (graphs cannot nest: it raises).
On the CPU ``emulate`` captures stand-ins, so the bookkeeping runs in tests: ``"tape"``
(``compile/graphs/tape_graph.py``: a replay reruns the recorded ops and Triton launches with every
host decision of the capture frozen, as a device graph does) or ``"rerun"`` (``EmulatedGraph``:
a replay reruns the Python callable; ``True`` picks ``DEFAULT_EMULATION``).

>>> import torch
>>> from compile.graphs.forward_context import BatchDescriptor, GraphMode, set_forward_context
>>> double = GraphWrapper(lambda x: x * 2, GraphMode.PIECEWISE, torch.device("cpu"), emulate=True)
>>> x = torch.ones(2)
>>> with set_forward_context({}, None, 2, BatchDescriptor(GraphMode.PIECEWISE, None, 2)):
...     outs = [double(x) for _ in range(3)]  # warm-up, capture, replay
>>> double.captures, double.replays, outs[2] is outs[1], outs[2].tolist()
(1, 1, True, [2.0, 2.0])
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from compile.graphs import device as dev
from compile.graphs.forward_context import BatchDescriptor, GraphMode, current_batch_descriptor
from compile.graphs.tape_graph import TapeGraph


class EmulatedGraph:
    """CPU stand-in for a captured device graph (tests): it keeps the callable, the very input
    tensors of the capture call and that call's outputs (making it runs the callable once, the
    capture call's result); ``replay()`` reruns the callable on those inputs and copies the
    result into the same outputs. Like a real graph it never sees
    later calls' arguments, so a replay after an input moved reads stale values.
    """

    def __init__(self, fn: Callable, args: Sequence[Any]):
        self.fn, self.args = fn, tuple(args)
        self.outputs = fn(*self.args)

    def replay(self) -> None:
        for dst, src in zip(output_tensors(self.outputs), output_tensors(self.fn(*self.args))):
            dst.copy_(src)


EMULATIONS = {"tape": TapeGraph, "rerun": EmulatedGraph}
DEFAULT_EMULATION = "tape"  # what ``emulate=True`` captures


def emulation(emulate) -> Optional[type]:
    """The stand-in graph class of ``emulate`` (False: None, True: ``DEFAULT_EMULATION``'s).

    Raises:
        ValueError: a name not in ``EMULATIONS``.
    """
    if emulate is False or emulate is None:
        return None
    name = DEFAULT_EMULATION if emulate is True else emulate
    if name not in EMULATIONS:
        raise ValueError(f"GraphWrapper: emulate must be a bool or one of {sorted(EMULATIONS)}; "
                         f"got {emulate!r}. Pass True for the default emulation.")
    return EMULATIONS[name]


def output_tensors(out: Any) -> list[Tensor]:
    """The tensors of a callable's output (a tensor, or a tuple/list of values)."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, Tensor)]


def capture_in_progress(device: torch.device) -> bool:
    """True while a device graph capture is recording on ``device``'s current stream."""
    fn = getattr(getattr(torch, device.type, None), "is_current_stream_capturing", None)
    return bool(fn()) if fn is not None else False


@dataclasses.dataclass
class CapturedGraph:
    """One capture: the graph, its inputs' addresses (None for non-tensors), its outputs."""

    graph: Any
    addresses: list[Optional[int]]
    output: Any


class GraphWrapper:
    """Runs ``runnable`` directly, or captured and replayed per ``BatchDescriptor``.

    Args:
        runnable: the callable captured (its inputs must keep their addresses across calls of
            one descriptor).
        graph_mode: the descriptors this wrapper captures (others run ``runnable``).
        device: where graphs are captured.
        name: used in errors ("piece 3", "full step").
        capture: False never captures (the CPU without emulation, or a runnable that reads
            per-step inputs; ``uncaptured_reason`` says which).
        emulate: capture stand-in graphs on the CPU (tests): ``"tape"``, ``"rerun"`` or True
            (``DEFAULT_EMULATION``); see ``emulation``.
        debug: check input addresses on every replay.
        pool: a ``device.graph_pool_handle`` shared with the owner's other graphs, or None.
        warmup_calls: uncaptured calls of a descriptor before its capture.
        uncaptured_reason: why ``capture`` is False, or None.
    Attributes:
        entries: ``BatchDescriptor -> CapturedGraph``.
        captures, replays: counts.
    """

    def __init__(self, runnable: Callable, graph_mode: GraphMode, device: torch.device, *,
                 name: str = "graph", capture: bool = True, emulate: bool = False,
                 debug: bool = False, pool=None, warmup_calls: int = 1,
                 uncaptured_reason: Optional[str] = None):
        self.runnable, self.graph_mode, self.device, self.name = (runnable, graph_mode,
                                                                  torch.device(device), name)
        self.capture = capture and uncaptured_reason is None
        self.emulate, self.debug, self.pool = emulation(emulate), debug, pool
        self.warmup_calls, self.uncaptured_reason = warmup_calls, uncaptured_reason
        self.entries: dict[BatchDescriptor, CapturedGraph] = {}
        self.calls: dict[BatchDescriptor, int] = {}
        self.captures = self.replays = 0

    def __call__(self, *args):
        desc = current_batch_descriptor()
        if not self.capture or desc is None or desc.graph_mode is not self.graph_mode:
            return self.runnable(*args)
        entry = self.entries.get(desc)
        if entry is None:
            return self._warm_up_or_capture(desc, args)
        if self.debug:
            self._check_addresses(desc, entry, args)
        entry.graph.replay()
        self.replays += 1
        return entry.output

    def _warm_up_or_capture(self, desc: BatchDescriptor, args):
        self.calls[desc] = self.calls.get(desc, 0) + 1
        if self.calls[desc] <= self.warmup_calls:
            return self.runnable(*args)
        if capture_in_progress(self.device):
            raise RuntimeError(f"GraphWrapper: {self.name} was asked to capture {desc} while a "
                               "device graph capture is already recording; graphs cannot nest. "
                               "Pieces inside a full-graph step must see its FULL descriptor "
                               "(compile.graphs.graph_runner.GraphRunner sets it).")
        if self.emulate is not None:  # ran the step once: this call's result (a step runs
            graph = self.emulate(self.runnable, args)  # once per call, as it must)
            output = graph.outputs
        else:
            graph = dev.new_graph(self.device)
            dev.synchronize(self.device)
            with dev.graph_capture(graph, self.device, pool=self.pool):
                output = self.runnable(*args)
            graph.replay()  # capture records without running; run it once for this result
        addresses = [a.data_ptr() if isinstance(a, Tensor) else None for a in args]
        self.entries[desc] = CapturedGraph(graph, addresses, output)
        self.captures += 1
        return output

    def _check_addresses(self, desc: BatchDescriptor, entry: CapturedGraph, args) -> None:
        for i, (ptr, a) in enumerate(zip(entry.addresses, args)):
            if isinstance(a, Tensor) and a.data_ptr() != ptr:
                raise RuntimeError(f"GraphWrapper: input {i} of {self.name} moved from "
                                   f"{ptr:#x} to {a.data_ptr():#x} since its capture at {desc}; "
                                   "a replay would read stale memory. Feed inputs through the "
                                   "owner's step buffers.")


__all__ = ["EmulatedGraph", "EMULATIONS", "DEFAULT_EMULATION", "emulation", "CapturedGraph",
           "GraphWrapper", "output_tensors", "capture_in_progress"]
