"""Piecewise graphs: split the FX graph at the attention split op, Inductor per piece, a device
graph per token-count bucket for every piece that reads only fixed-address tensors.

Entry point: ``compile_piecewise(model, ...)`` returns a ``PiecewiseModel`` that is called like
the model (``(input_ids [T], positions [T], forward_batch) -> logits``) once the host has run
``forward_batch.attn_backend.init_forward_metadata(forward_batch)``.

How a step runs (CUDA/XPU, any mode but idle, ``T <= max(graph_sizes)``):

1. ``PiecewiseModel`` copies ``input_ids``/``positions`` into its ``TokenBuffers`` padded to the
   smallest bucket ``B >= T`` (padded tail zeroed) and sets the forward context
   (``num_tokens=T``, ``BatchDescriptor(PIECEWISE, mode, B)``).
2. Dynamo runs the model's graph for the step's mode (token dim dynamic); ``PiecewiseBackend``
   has split it at every ``xpu_ops::unified_attention_with_output`` node into
   ``num_layers + 1`` pieces around ``num_layers`` attention calls, each piece compiled by
   Inductor (structurally identical pieces, i.e. the middle layers, share one compilation).
3. At compile time each piece is marked capturable or not (``capture_plan``): it may be
   captured only if every input has a fixed address and a shape that is a function of the
   bucket, i.e. is a parameter/buffer of the model, a padded static input (``input_ids``,
   ``positions`` and their length), or an output of an earlier captured piece (attention writes
   into such outputs in place). Inputs with any other Dynamo source are per-step
   (``per_step_placeholders``; e.g. ``forward_batch.extend_seq_lens``, shape ``[b]``): a piece
   is cut before its first node that depends on one, and the part after the cut, plus every
   piece reading its outputs, runs uncaptured. For the zoo's Llama this captures every piece of
   decode and target-verify steps, and for extend, mixed and draft-extend steps everything but
   the LM head's pick of each request's last token (``h[cumsum(extend_seq_lens) - 1]``, the
   ``lm_head`` matmul over those ``b`` rows): ``num_layers + 1`` captured pieces and one
   uncaptured.
4. Every piece is a ``GraphWrapper`` (``compile/graphs/graph_wrapper.py``): its first call at a
   descriptor runs the compiled piece (warm-up: Triton autotuning happens here, never during
   capture), the second captures it into a device graph and replays it, later calls only
   replay and return the same output tensors (fixed buffers of the shared graph pool).
5. Attention runs eagerly between pieces with the step's metadata and writes the fixed
   ``output`` in place (rows ``>= T`` zeroed, so padded rows stay zero).

What it does not do: capture attention itself (``compile/graphs/graph_runner.py`` captures whole
steps; ``graph_runner.full_and_piecewise`` composes the two: full graphs for decode, pieces for
the rest; inside a full-graph step the forward context carries a FULL descriptor, so this model
neither pads nor captures), capture steps past the largest bucket or idle steps, share captured
graphs between the Dynamo graphs of different modes (each mode's pieces capture their own graphs
per bucket), or check input addresses on every replay (``debug=True`` does). On the CPU the same split and
Inductor pieces run without capture; ``emulate_graphs=True`` runs the whole bucket, capture and
replay bookkeeping there with stand-in graphs (tests; ``GraphWrapper``'s ``emulate``).
"""

from __future__ import annotations

import bisect
import inspect
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, fx, nn
from torch.utils._pytree import tree_map

from compile.graphs import device as dev
from compile.graphs.forward_context import (BatchDescriptor, GraphMode, current_batch_descriptor,
                                            set_forward_context)
from compile.graphs.graph_split import (SplitItem, call_split_op_kernel, capture_plan, graph_signature,
                          is_split_node, per_step_placeholders, split_graph)
from compile.graphs.graph_wrapper import GraphWrapper, emulation
from compile.graphs.inductor_passes import piece_config_patches
from compile.graphs.split_op import enable_split_op
from compile.graphs.step_buffers import TokenBuffers
from compile.graphs.tape_graph import TapeGraph

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


class PiecewiseBackend:
    """A ``torch.compile`` backend: split at split ops, Inductor per piece, ``GraphWrapper``s.

    Args:
        device: where the model runs (graphs are captured on CUDA/XPU only).
        debug: check input addresses on every replay.
        inductor: compile pieces with Inductor (False: run the FX pieces as they are, for tests).
        static_inputs: names of the model's arguments that are fed from fixed buffers in
            bucketed steps (see ``capture_plan``).
        emulate_graphs: capture CPU stand-ins instead of device graphs (tests; True,
            ``"tape"`` or ``"rerun"``: ``GraphWrapper``'s ``emulate``).
        unfuse_addmm: compile pieces with ``inductor_passes.ResidualAddmmPass`` (residual adds
            as ``mm + add``, fused into the next norm, instead of Inductor's ``addmm``: no
            copy of the residual and a ``beta = 0`` GEMM); None: on GPUs.
    Attributes:
        stats: counters: ``graphs`` (Dynamo graphs received), ``pieces`` (pieces around the
            attention calls, ``num_layers + 1`` per graph), ``cuts`` (extra pieces cut off at a
            per-step input), ``split_ops`` (attention submodules), ``compiles`` (distinct
            Inductor compilations), ``uncaptured`` (pieces, cuts included, that read per-step
            inputs), ``captures`` (graphs captured).
        split_gms: the split graph of every Dynamo graph received.
    """

    def __init__(self, device: torch.device | str = "cpu", *, debug: bool = False,
                 inductor: bool = True, static_inputs: Sequence[str] = ("input_ids", "positions"),
                 emulate_graphs: bool | str = False, unfuse_addmm: Optional[bool] = None):
        self.device = torch.device(device)
        self.debug, self.inductor, self.emulate_graphs = debug, inductor, emulate_graphs
        self.config_patches = piece_config_patches(self.device, unfuse_addmm)
        self.static_inputs = tuple(static_inputs)
        self._stats = dict(graphs=0, pieces=0, cuts=0, split_ops=0, compiles=0, uncaptured=0)
        self.split_gms: list[fx.GraphModule] = []
        self.pieces: list[GraphWrapper] = []
        self._compiled: dict[str, Callable] = {}
        self.pool = dev.graph_pool_handle(self.device)

    @property
    def stats(self) -> dict[str, int]:
        """The counters of the class docstring (``captures`` summed over the pieces)."""
        return dict(self._stats, captures=sum(p.captures for p in self.pieces))

    def wrap_piece(self, index: int, compiled: Callable,
                   uncaptured_reason: Optional[str]) -> GraphWrapper:
        """The ``GraphWrapper`` of piece ``index`` (never captured with an
        ``uncaptured_reason``), sharing this backend's memory pool. An Inductor piece is
        emulated by rerunning it: the tape cannot see Inductor's CPU kernels, and compiled code
        holds no host decision a replay could miss (its kernels and sizes are fixed)."""
        emulate = self.emulate_graphs
        if self.inductor and emulation(emulate) is TapeGraph:
            emulate = "rerun"
        piece = GraphWrapper(compiled, GraphMode.PIECEWISE, self.device, name=f"piece {index}",
                             emulate=emulate, debug=self.debug, pool=self.pool,
                             uncaptured_reason=uncaptured_reason)
        self.pieces.append(piece)
        return piece

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        self._stats["graphs"] += 1
        per_step = per_step_placeholders(gm, self.static_inputs)
        split_gm, items = split_graph(gm, per_step)
        self.split_gms.append(split_gm)
        pieces = {item.name for item in items if not item.is_split}
        cuts = sum(item.is_cut for item in items)
        self._stats["pieces"] += len(pieces) - cuts
        self._stats["cuts"] += cuts
        self._stats["split_ops"] += len(items) - len(pieces)
        plan = capture_plan(split_gm, pieces, self.static_inputs)
        self._stats["uncaptured"] += sum(reason is not None for reason in plan.values())
        _PieceCompiler(split_gm, plan, self).run(*example_inputs)
        for item in items:
            if item.is_split:  # its forward itself: nn.Module.__call__ is host cost per layer
                call_split_op_kernel(item.graph)
                split_gm.__dict__[item.name] = item.graph.forward
        return split_gm

    def compile_piece(self, gm: fx.GraphModule, fake_args: Sequence[Any]) -> Callable:
        """Inductor-compile ``gm`` for ``fake_args`` (symbolic token dim), reusing an identical
        piece's compilation."""
        key = graph_signature(gm, fake_args)
        if key not in self._compiled:
            self._stats["compiles"] += 1
            if self.inductor:
                from torch._inductor.compile_fx import compile_fx
                self._compiled[key] = compile_fx(gm, list(fake_args),
                                                 config_patches=self.config_patches)
            else:
                self._compiled[key] = gm
        return self._compiled[key]


class _PieceCompiler(fx.Interpreter):
    """Runs the split graph on fake inputs; compiles each piece with its fake arguments and
    swaps the submodule for its ``GraphWrapper`` (capturable or not, per ``plan``)."""

    def __init__(self, split_gm: fx.GraphModule, plan: dict[str, Optional[str]],
                 backend: PiecewiseBackend):
        super().__init__(split_gm)
        self.plan, self.backend = plan, backend

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
        replace it with its ``GraphWrapper``.
        """
        out = super().call_module(target, args, kwargs)
        if target in self.plan:
            submod = self.fetch_attr(target)
            compiled = self.backend.compile_piece(submod, args)
            index = int(target.rsplit("_", 1)[1])
            self.module.__dict__[target] = self.backend.wrap_piece(index, compiled,
                                                                   self.plan[target])
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
        emulate_graphs: capture CPU stand-ins (``GraphWrapper``'s ``emulate``; implies
            ``capture``): the bucket, capture and replay bookkeeping on the CPU, for tests.
        unfuse_addmm: as ``PiecewiseBackend``'s (None: on GPUs).
    Attributes:
        backend: the ``PiecewiseBackend`` (its ``stats`` count graphs, pieces, compiles,
            captures).
        fixed_table_width: True: ``compile.engine.Engine`` builds its page tables as wide as
            the request pool in every step (``MetadataBuilderMixin.fixed_table_width``): the
            Dynamo graph does not recompile when a request crosses a page boundary.
    Returns (forward):
        the model's output; for bucketed steps rows ``[:T]`` of every padded output tensor
        (a tensor, or tensors inside tuples, lists or dicts), cloned.

    The model's attention layers are switched to the split op for good (``enable_split_op``):
    give ``PiecewiseModel`` its own model instance, not one that is also run eagerly or by
    another runner.
    """

    fixed_table_width = True

    def __init__(self, model: nn.Module, *, graph_sizes: Sequence[int] = DEFAULT_GRAPH_SIZES,
                 capture: Optional[bool] = None, debug: bool = False, inductor: bool = True,
                 device: torch.device | str | None = None, emulate_graphs: bool | str = False,
                 unfuse_addmm: Optional[bool] = None):
        super().__init__()
        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)
        self.model = model
        self.layers = enable_split_op(model)
        # one layer and its split op, checked per step
        self._split_layer = next(iter(self.layers.values()), None)
        self._split_fn = None if self._split_layer is None else self._split_layer.split_op
        self.graph_sizes = sorted(set(int(s) for s in graph_sizes))
        if capture is None:
            capture = emulate_graphs or dev.supports_graphs(self.device)
        self.capture = capture
        self.backend = PiecewiseBackend(self.device, debug=debug, inductor=inductor,
                                        static_inputs=_first_two_args(model),
                                        emulate_graphs=emulate_graphs, unfuse_addmm=unfuse_addmm)
        # Not a submodule (it would list the model's parameters twice).
        self.__dict__["compiled"] = torch.compile(model, backend=self.backend, fullgraph=True,
                                                  **_OWN_RECOMPILE_BUDGET, **_guard_options())
        n = self.graph_sizes[-1] if self.graph_sizes else 0
        self.max_graph_size = n
        self.tokens = TokenBuffers(n, self.device, dynamic=True)
        # Per step: one table lookup for the bucket, views made (and marked dynamic) once.
        self._bucket = [None] + [self.graph_sizes[bisect.bisect_left(self.graph_sizes, t)]
                                 for t in range(1, n + 1)]

    def compiled_pieces(self) -> list[GraphWrapper]:
        """The ``GraphWrapper`` of every piece compiled so far, in graph order."""
        return list(self.backend.pieces)

    def graph_size_for(self, num_tokens: int, forward_batch) -> Optional[int]:
        """The bucket a step of ``num_tokens`` is padded to and captured at, or None (run
        uncaptured: capture off, idle, or more tokens than the largest bucket). Every other
        mode is bucketed; which pieces capture is ``capture_plan``'s decision."""
        if not self.capture or num_tokens > self.max_graph_size:
            return None
        mode = getattr(forward_batch, "forward_mode", None)
        if mode is None or mode.is_idle():
            return None
        return self._bucket[num_tokens]

    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch, **kwargs):
        """``input_ids [T]``, ``positions [T]`` -> the model's output for the ``T`` tokens.

        Steps that fit a graph bucket are padded into static buffers; the output is then cut back
        to ``T`` rows and cloned. Inside a full-graph step (the forward context's descriptor is
        FULL: ``GraphRunner`` pads and captures it whole) the pieces run as they are.

        Raises:
            RuntimeError: the model's layers no longer attend through the split op (something
                ran ``enable_split_op(model, False)`` after this model was made).
        """
        if self._split_layer is not None and self._split_layer.split_op is not self._split_fn:
            raise RuntimeError("PiecewiseModel: the model's attention layers no longer attend "
                               "through the split op (enable_split_op(model, False) ran after "
                               "this PiecewiseModel was made, e.g. by making another forward "
                               "over the same model); expected the split ops. Give each "
                               "forward its own model, or finish with this one first.")
        outer = current_batch_descriptor()
        if outer is not None and outer.graph_mode is GraphMode.FULL:
            # The runner's context (its layers, batch, FULL descriptor) and buffers stay.
            return self.compiled(input_ids, positions, forward_batch, **kwargs)
        n = input_ids.shape[0]
        size = self.graph_size_for(n, forward_batch)
        desc = None
        if size is not None:
            input_ids, positions = self.tokens.load(size, input_ids, positions)
            desc = BatchDescriptor(GraphMode.PIECEWISE, forward_batch.forward_mode, size)
        elif n >= 2:  # one graph for every uncaptured size (0 and 1 are specialised anyway)
            # marked on fresh aliases: a mark on the caller's tensors would follow them into
            # any other compiled function they are passed to
            input_ids, positions = input_ids.view(input_ids.shape), positions.view(positions.shape)
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        with set_forward_context(self.layers, forward_batch, n, desc):
            out = self.compiled(input_ids, positions, forward_batch, **kwargs)
        if size is None:
            return out
        # Rows [:T] of every padded output (a tensor, or tensors in a tuple/list/dict), cloned.
        def cut(t: Tensor) -> Tensor:
            return (t[:n] if t.dim() and t.shape[0] == size else t).clone()
        if isinstance(out, Tensor):  # the zoo's logits: no tree walk
            return cut(out)
        return tree_map(lambda t: cut(t) if isinstance(t, Tensor) else t, out)


# Each PiecewiseModel has its own backend, so Dynamo cannot reuse one model's graphs for another
# (a BACKEND_MATCH guard fails); all of them add cache entries to the model class's ``forward``
# code object, and by default those count against one recompile limit: the ninth model of a
# process failed with FailOnRecompileLimitHit (fullgraph) however few steps each ran.
# ``isolate_recompiles`` (pytorch/pytorch pull request 178351) gives every torch.compile call
# its own budget; on a torch without it the models share the limit, as before.
_OWN_RECOMPILE_BUDGET = ({"isolate_recompiles": True}
                         if "isolate_recompiles" in inspect.signature(torch.compile).parameters
                         else {})


# Dynamo evaluates its guards on every step's entry, and nearly all of them check the model's
# modules: hooks dicts, attribute constants (heads, window, softcap), types, parameter metadata.
# The public filter torch.compiler.skip_guard_on_all_nn_modules_unsafe drops those, which a
# piecewise model does not need: its model is fixed once it is wrapped. Captured pieces read
# the parameters at the addresses of their capture (replacing one breaks the replays whatever
# the guards say; loading weights in place needs no guard), the zoo's module attributes are
# configuration set at construction, and the one attribute that does change, each layer's split
# op, is checked on every step (``PiecewiseModel.forward``). Not supported after the first
# step, as in vLLM (which drops every guard): switching the model between train and eval,
# adding hooks, or replacing its modules. The guards on the step's inputs (forward mode, batch
# fields, sizes) and on global state stay, so every mode and size class still gets its own
# graph.
_GUARD_FILTER = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)


def _guard_options() -> dict:
    """``torch.compile``'s ``options`` with the guard filter (a new dict per call:
    ``torch.compile`` pops the filter out of the dict it is given)."""
    return {"options": {"guard_filter_fn": _GUARD_FILTER}} if _GUARD_FILTER else {}


def _first_two_args(model: nn.Module) -> tuple[str, ...]:
    """Names of ``model.forward``'s first two parameters (``input_ids``, ``positions``), the
    arguments ``PiecewiseModel`` feeds from its static buffers."""
    params = list(inspect.signature(model.forward).parameters)
    return tuple(params[:2])


def compile_piecewise(model: nn.Module, **kwargs) -> PiecewiseModel:
    """``PiecewiseModel(model, **kwargs)``: the piecewise entry point for ``python -m compile``.

    >>> # engine = Engine(model, forward=compile_piecewise(model))   # extend and decode captured
    """
    return PiecewiseModel(model, **kwargs)


__all__ = ["DEFAULT_GRAPH_SIZES", "is_split_node", "SplitItem", "split_graph",
           "graph_signature", "per_step_placeholders", "capture_plan", "PiecewiseBackend",
           "PiecewiseModel", "compile_piecewise"]
