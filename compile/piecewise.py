"""Piecewise graphs: split the FX graph at the attention split op, Inductor per piece, a device
graph per token-count bucket.

Entry point: ``compile_piecewise(model, ...)`` returns a ``PiecewiseModel`` that is called like
the model (``(input_ids [T], positions [T], forward_batch) -> logits``) once the host has run
``forward_batch.attn_backend.init_forward_metadata(forward_batch)``.

How a step runs (CUDA/XPU, decode or target verify, ``T <= max(graph_sizes)``):

1. ``PiecewiseModel`` copies ``input_ids``/``positions`` into static buffers padded to the
   smallest bucket ``B >= T`` (padded tail zeroed) and sets the forward context
   (``num_tokens=T``, ``graph_size=B``).
2. Dynamo runs the model's one graph (token dim dynamic); ``PiecewiseBackend`` has split it at
   every ``xpu_ops::unified_attention_with_output`` node into ``num_layers + 1`` pieces around
   ``num_layers`` attention calls, each piece compiled by Inductor (structurally identical
   pieces, i.e. the middle layers, share one compilation).
3. Each piece is a ``PieceRunner``: its first call at ``B`` runs the compiled piece (warm-up:
   Triton autotuning happens here, never during capture), the second captures it into a device
   graph and replays it, later calls only replay. A piece's inputs are the static buffers of
   step 1, parameters, and outputs of earlier captured pieces or attention, so their addresses
   never change; its outputs (including each attention ``output``) are fixed buffers of the
   graph pool.
4. Attention runs eagerly between pieces with the step's metadata and writes the fixed
   ``output`` in place (rows ``>= T`` zeroed).

What it does not do: capture attention itself (``compile/graph_runner.py`` captures whole decode
steps), capture extend batches (their graphs read per-request tensors; they run the compiled
pieces without capture), or check input addresses on every replay (``debug=True`` does).
On the CPU the same split and Inductor pieces run without capture.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, fx, nn
from torch.fx.passes.split_module import split_module

from . import device as dev
from .forward_context import get_forward_context, has_forward_context, set_forward_context
from .split_op import enable_split_op

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def is_split_node(node: fx.Node) -> bool:
    """True for a call of the split op ``xpu_ops::unified_attention_with_output``."""
    if node.op != "call_function":
        return False
    target = node.target
    packet = getattr(target, "overloadpacket", target)
    return packet is getattr(torch.ops.xpu_ops, "unified_attention_with_output", None)


@dataclasses.dataclass
class SplitItem:
    """One submodule of the split graph: ``submod_<index>``, an attention call or a piece."""

    name: str
    index: int
    is_split: bool
    graph: fx.GraphModule


def split_graph(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[SplitItem]]:
    """Split ``gm`` at split-op nodes, each in its own submodule, original order kept.

    Returns:
        ``(split_gm, items)``: ``split_gm`` calls ``submod_0, submod_1, ...`` in order; ``items``
        lists them with ``is_split`` True for the attention submodules. A graph with ``L`` split
        ops gives ``2 L + 1`` submodules when no two split ops are adjacent.
    """
    partition: dict[fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_split_node(node):
            current += 1  # a partition of its own
            partition[node] = current
            current += 1
        else:
            partition[node] = current
    split_gm = split_module(gm, None, lambda n: partition[n], keep_original_order=True)
    split_ids = {partition[n] for n in partition if is_split_node(n)}
    items = []
    for name, sub in split_gm.named_children():
        index = int(name.rsplit("_", 1)[1])
        items.append(SplitItem(name, index, index in split_ids, sub))
    items.sort(key=lambda item: item.index)
    return split_gm, items


def _meta_str(value: Any) -> str:
    """Shape/dtype/stride/device of a fake tensor (or the repr of a SymInt or constant)."""
    if isinstance(value, Tensor):
        return f"T({tuple(value.shape)},{value.dtype},{value.stride()},{value.device.type})"
    return f"{type(value).__name__}({value})"


def graph_signature(gm: fx.GraphModule, args: Sequence[Any]) -> str:
    """A key equal for two pieces that compute the same function of their positional inputs
    (node names ignored; ``get_attr`` constants keyed by identity)."""
    names: dict[fx.Node, str] = {}
    lines = [",".join(_meta_str(a) for a in args)]
    for i, node in enumerate(gm.graph.nodes):
        names[node] = f"n{i}"
        if node.op == "get_attr":
            target = f"id{id(getattr(gm, node.target))}"
        elif node.op == "placeholder":
            target = ""
        else:
            target = str(node.target)
        mapped = fx.node.map_arg((node.args, node.kwargs), lambda n: names[n])
        lines.append(f"{names[node]}={node.op}:{target}{mapped!r}")
    return "\n".join(lines)


class PieceRunner:
    """Runs one compiled piece: directly, or captured and replayed per token-count bucket.

    Per bucket ``B`` (``forward_context.graph_size``): call 1 runs the compiled piece (warm-up);
    call 2 captures it into a device graph, records its input addresses and outputs, and
    replays; later calls replay and return the same output tensors (fixed addresses). With
    ``debug`` every replay checks that the input addresses match the capture.
    """

    def __init__(self, index: int, compiled: Callable, backend: "PiecewiseBackend"):
        self.index, self.compiled, self.backend = index, compiled, backend
        self.calls: dict[int, int] = {}
        self.graphs: dict[int, tuple[Any, list[int], Any]] = {}

    def __call__(self, *args):
        size = get_forward_context().graph_size if has_forward_context() else None
        if size is None:
            return self.compiled(*args)
        if size in self.graphs:
            graph, addresses, outputs = self.graphs[size]
            if self.backend.debug:
                self._check_addresses(size, addresses, args)
            graph.replay()
            return outputs
        self.calls[size] = self.calls.get(size, 0) + 1
        if self.calls[size] == 1:
            return self.compiled(*args)
        return self._capture(size, args)

    def _capture(self, size: int, args):
        device = self.backend.device
        graph = dev.new_graph(device)
        dev.synchronize(device)
        with dev.graph_capture(graph, device, pool=self.backend.graph_pool()):
            outputs = self.compiled(*args)
        addresses = [a.data_ptr() if isinstance(a, Tensor) else None for a in args]
        self.graphs[size] = (graph, addresses, outputs)
        self.backend.stats["captures"] += 1
        graph.replay()  # capture records without running; run it once for this call's result
        return outputs

    def _check_addresses(self, size: int, addresses: list, args) -> None:
        for i, (ptr, a) in enumerate(zip(addresses, args)):
            if isinstance(a, Tensor) and a.data_ptr() != ptr:
                raise RuntimeError(f"PieceRunner: input {i} of piece {self.index} moved from "
                                   f"{ptr:#x} to {a.data_ptr():#x} since its capture at bucket "
                                   f"{size}; a replay would read stale memory. Feed inputs "
                                   "through PiecewiseModel's static buffers.")


class PiecewiseBackend:
    """A ``torch.compile`` backend: split at split ops, Inductor per piece, ``PieceRunner``s.

    Args:
        device: where the model runs (graphs are captured on CUDA/XPU only).
        debug: check input addresses on every replay.
        inductor: compile pieces with Inductor (False: run the FX pieces as they are, for tests).
    Attributes:
        stats: counters: ``graphs`` (Dynamo graphs received), ``pieces`` (non-attention pieces),
            ``split_ops`` (attention submodules), ``compiles`` (distinct Inductor compilations),
            ``captures`` (device graphs captured).
        split_gms: the split graph of every Dynamo graph received.
    """

    def __init__(self, device: torch.device | str = "cpu", *, debug: bool = False,
                 inductor: bool = True):
        self.device = torch.device(device)
        self.debug, self.inductor = debug, inductor
        self.stats = dict(graphs=0, pieces=0, split_ops=0, compiles=0, captures=0)
        self.split_gms: list[fx.GraphModule] = []
        self._compiled: dict[str, Callable] = {}
        self._pool = None

    def graph_pool(self):
        """One memory pool shared by every captured piece (created on first use)."""
        if self._pool is None:
            self._pool = dev.graph_pool_handle(self.device)
        return self._pool

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        self.stats["graphs"] += 1
        split_gm, items = split_graph(gm)
        self.split_gms.append(split_gm)
        pieces = {item.name for item in items if not item.is_split}
        self.stats["pieces"] += len(pieces)
        self.stats["split_ops"] += len(items) - len(pieces)
        _PieceCompiler(split_gm, pieces, self).run(*example_inputs)
        return split_gm

    def compile_piece(self, gm: fx.GraphModule, fake_args: Sequence[Any]) -> Callable:
        """Inductor-compile ``gm`` for ``fake_args`` (symbolic token dim), reusing an identical
        piece's compilation."""
        key = graph_signature(gm, fake_args)
        if key not in self._compiled:
            self.stats["compiles"] += 1
            if self.inductor:
                from torch._inductor.compile_fx import compile_fx
                self._compiled[key] = compile_fx(gm, list(fake_args))
            else:
                self._compiled[key] = gm
        return self._compiled[key]


class _PieceCompiler(fx.Interpreter):
    """Runs the split graph on fake inputs; compiles each piece with its fake arguments and
    swaps the submodule for a ``PieceRunner``."""

    def __init__(self, split_gm: fx.GraphModule, pieces: set[str], backend: PiecewiseBackend):
        super().__init__(split_gm)
        self.pieces, self.backend = pieces, backend

    def run(self, *args):
        """Run the split graph on fake copies of ``args`` (compiling pieces on the way)."""
        from torch._guards import detect_fake_mode
        fake_mode = detect_fake_mode(args)
        if fake_mode is None:
            from torch._subclasses.fake_tensor import FakeTensorMode
            fake_mode = FakeTensorMode()
        fake = [fake_mode.from_tensor(a) if isinstance(a, Tensor) and
                not isinstance(a, torch._subclasses.FakeTensor) else a for a in args]
        with fake_mode:
            return super().run(*fake)

    def call_module(self, target, args, kwargs):
        """Run submodule ``target``; if it is a piece, compile it for these fake ``args`` and
        replace it with a ``PieceRunner``.
        """
        out = super().call_module(target, args, kwargs)
        if target in self.pieces:
            submod = self.fetch_attr(target)
            compiled = self.backend.compile_piece(submod, args)
            index = int(target.rsplit("_", 1)[1])
            self.module.__dict__[target] = PieceRunner(index, compiled, self.backend)
        return out


class PiecewiseModel(nn.Module):
    """``model`` in piecewise mode: split-op attention, Inductor pieces, graphs per bucket.

    Args:
        model: called as ``model(input_ids [T], positions [T], forward_batch, **kwargs)``; its
            attention layers (PagedAttention) are switched to the split op.
        graph_sizes: token-count buckets captured on CUDA/XPU (sorted; ``max_num_tokens`` is
            their maximum). Steps with more tokens run the compiled pieces uncaptured.
        capture: capture graphs (default: when ``device`` supports them).
        debug: check input addresses on every replay.
        inductor: False runs the FX pieces without Inductor (fast tests).
    Attributes:
        backend: the ``PiecewiseBackend`` (its ``stats`` count graphs, pieces, compiles,
            captures).
    Returns (forward):
        the model's output; for captured steps rows ``[:T]`` of the padded result, cloned.
    """

    def __init__(self, model: nn.Module, *, graph_sizes: Sequence[int] = DEFAULT_GRAPH_SIZES,
                 capture: Optional[bool] = None, debug: bool = False, inductor: bool = True,
                 device: torch.device | str | None = None):
        super().__init__()
        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)
        self.model = model
        self.layers = enable_split_op(model)
        self.graph_sizes = sorted(set(int(s) for s in graph_sizes))
        self.capture = dev.supports_graphs(self.device) if capture is None else capture
        self.backend = PiecewiseBackend(self.device, debug=debug, inductor=inductor)
        # Not a submodule (it would list the model's parameters twice).
        self.__dict__["compiled"] = torch.compile(model, backend=self.backend, fullgraph=True)
        n = self.graph_sizes[-1] if self.graph_sizes else 0
        self.register_buffer("static_input_ids", torch.zeros(n, dtype=torch.long,
                                                             device=self.device),
                             persistent=False)
        self.register_buffer("static_positions", torch.zeros(n, dtype=torch.long,
                                                             device=self.device),
                             persistent=False)

    def compiled_pieces(self) -> list[PieceRunner]:
        """The ``PieceRunner``s of every Dynamo graph compiled so far, in graph order."""
        return [runner for gm in self.backend.split_gms for runner in gm.__dict__.values()
                if isinstance(runner, PieceRunner)]

    def graph_size_for(self, num_tokens: int, forward_batch) -> Optional[int]:
        """The bucket a step of ``num_tokens`` is captured at, or None (run uncaptured)."""
        mode = getattr(forward_batch, "forward_mode", None)
        if not self.capture or mode is None or not mode.is_cuda_graph() or mode.is_idle():
            return None
        i = bisect.bisect_left(self.graph_sizes, num_tokens)
        return self.graph_sizes[i] if i < len(self.graph_sizes) else None

    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch, **kwargs):
        """``input_ids [T]``, ``positions [T]`` -> the model's output for the ``T`` tokens.

        Steps that fit a graph bucket are padded into static buffers; the output is then cut back
        to ``T`` rows and cloned.
        """
        n = input_ids.shape[0]
        size = self.graph_size_for(n, forward_batch)
        if size is not None:
            input_ids = _pad_into(self.static_input_ids, input_ids, size)
            positions = _pad_into(self.static_positions, positions, size)
        if input_ids.shape[0] >= 2:  # 0 and 1 are specialised by Dynamo anyway
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        with set_forward_context(self.layers, forward_batch, n, size):
            out = self.compiled(input_ids, positions, forward_batch, **kwargs)
        if size is None:
            return out
        return (out[:n] if out.shape[0] == size else out).clone()


def _pad_into(buffer: Tensor, values: Tensor, size: int) -> Tensor:
    """``buffer[:size]`` holding ``values`` then zeros (same address for every call)."""
    n = values.shape[0]
    buffer[:n].copy_(values)
    buffer[n:size].zero_()
    return buffer[:size]


def compile_piecewise(model: nn.Module, **kwargs) -> PiecewiseModel:
    """``PiecewiseModel(model, **kwargs)``: the piecewise entry point for ``python -m compile``.

    >>> # engine = Engine(model, forward=compile_piecewise(model))   # decode steps captured
    """
    return PiecewiseModel(model, **kwargs)


__all__ = ["DEFAULT_GRAPH_SIZES", "is_split_node", "SplitItem", "split_graph",
           "graph_signature", "PieceRunner", "PiecewiseBackend", "PiecewiseModel",
           "compile_piecewise"]
