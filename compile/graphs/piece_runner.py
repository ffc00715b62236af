"""``PieceRunner``: run one compiled piece of a piecewise model, captured per token bucket.

A piece's first call at a bucket warms it up, the second captures it into a device graph (or an
``EmulatedGraph`` on the CPU, for tests) and replays it, later calls only replay and return the
same output tensors. ``compile/graphs/piecewise.py`` describes the whole flow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from compile.graphs import device as dev

if TYPE_CHECKING:
    from compile.graphs.piecewise import PiecewiseBackend


class EmulatedGraph:
    """CPU stand-in for a captured device graph (tests): it keeps the piece, the very input
    tensors of the capture call and that call's outputs; ``replay()`` reruns the piece on those
    inputs and copies the result into the same outputs. Like a real graph it never sees later
    calls' arguments, so a replay after an input moved reads stale values.
    """

    def __init__(self, fn: Callable, args: Sequence[Any]):
        self.fn, self.args = fn, tuple(args)
        self.outputs = fn(*self.args)

    def replay(self) -> None:
        for dst, src in zip(_tensors(self.outputs), _tensors(self.fn(*self.args))):
            dst.copy_(src)


def _tensors(out: Any) -> list[Tensor]:
    """The tensors of a piece's output (a tensor, or a tuple/list of values)."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, Tensor)]


def _capture_in_progress(device: torch.device) -> bool:
    """True while a device graph capture is recording on ``device``'s current stream."""
    fn = getattr(getattr(torch, device.type, None), "is_current_stream_capturing", None)
    return bool(fn()) if fn is not None else False


class PieceRunner:
    """Runs one compiled piece: directly, or captured and replayed per token-count bucket.

    Steps run uncaptured when ``backend.graph_size`` is None or the piece reads a per-step input
    (``uncaptured_reason``, from ``capture_plan``). Otherwise, per bucket ``B``: call 1 runs the
    compiled piece (warm-up); call 2 captures it, records its input addresses and outputs, and
    replays; later calls replay and return the same output tensors (fixed addresses). With
    ``debug`` every replay checks that the input addresses match the capture.

    Attributes:
        uncaptured_reason: None for a capturable piece, else which per-step input it reads.
        graphs: ``B -> (graph, input addresses, outputs)`` of the captures made.
    """

    def __init__(self, index: int, compiled: Callable, backend: "PiecewiseBackend",
                 uncaptured_reason: Optional[str] = None):
        self.index, self.compiled, self.backend = index, compiled, backend
        self.uncaptured_reason = uncaptured_reason
        self.capturable = uncaptured_reason is None
        self.debug = backend.debug
        self.calls: dict[int, int] = {}
        self.graphs: dict[int, tuple[Any, list, Any]] = {}

    def __call__(self, *args):
        size = self.backend.graph_size  # one attribute read: this is the replay hot path
        if size is None or not self.capturable:
            return self.compiled(*args)
        entry = self.graphs.get(size)
        if entry is None:
            return self._warm_up_or_capture(size, args)
        graph, addresses, outputs = entry
        if self.debug:
            self._check_addresses(size, addresses, args)
        graph.replay()
        return outputs

    def _warm_up_or_capture(self, size: int, args):
        self.calls[size] = self.calls.get(size, 0) + 1
        if self.calls[size] == 1:
            return self.compiled(*args)
        backend = self.backend
        if _capture_in_progress(backend.device):
            raise RuntimeError(f"PieceRunner: piece {self.index} was asked to capture bucket "
                               f"{size} while a device graph capture is already recording "
                               "(an outer full-graph runner); graphs cannot nest. Give the "
                               "PiecewiseModel full_graph_steps=<the runner's can_run> (as "
                               "compile.graphs.graph_runner.full_and_piecewise does).")
        if backend.emulate_graphs:
            graph = EmulatedGraph(self.compiled, args)
            outputs = graph.outputs
        else:
            graph = dev.new_graph(backend.device)
            dev.synchronize(backend.device)
            with dev.graph_capture(graph, backend.device, pool=backend.graph_pool()):
                outputs = self.compiled(*args)
        addresses = [a.data_ptr() if isinstance(a, Tensor) else None for a in args]
        self.graphs[size] = (graph, addresses, outputs)
        backend.stats["captures"] += 1
        graph.replay()  # capture records without running; run it once for this call's result
        return outputs

    def _check_addresses(self, size: int, addresses: list, args) -> None:
        for i, (ptr, a) in enumerate(zip(addresses, args)):
            if isinstance(a, Tensor) and a.data_ptr() != ptr:
                raise RuntimeError(f"PieceRunner: input {i} of piece {self.index} moved from "
                                   f"{ptr:#x} to {a.data_ptr():#x} since its capture at bucket "
                                   f"{size}; a replay would read stale memory. Feed inputs "
                                   "through PiecewiseModel's static buffers.")


__all__ = ["EmulatedGraph", "PieceRunner"]
