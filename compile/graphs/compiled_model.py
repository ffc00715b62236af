"""``compile_model``: ``torch.compile`` of a zoo model, traced once per layer kind.

``torch.compile(model)`` works on every zoo model (tests/compile/test_compile_model.py), but
Dynamo traces all N decoder layers and Inductor compiles N copies of the same code: a 30-layer
model takes ~60 s cold and ~10 s warm on a 2-core CPU. ``compile_model(model)`` returns a
``CompiledModel``: the same ``torch.compile``, called so that for decode, verify and draft-decode
steps Dynamo traces one layer per kind and stamps out the others (docs/regions_reuse.md; extend
steps, whose query lengths vary, trace every layer: see ``CompiledModel``):

1. each step runs inside ``compile.graphs.regions.layer_regions()`` (one nested compile region per
   decoder layer) and ``compile.graphs.forward_context.set_forward_context`` holding the step's
   ``ForwardBatch`` (the regions read it from there, so it is not a region argument);
2. before the first step, and again whenever the pool's buffers are no longer the ones bound,
   every ``PagedAttention`` gets its KV buffers bound (``pool.bind_layers(model)``), so traced
   attention does not index the pool by ``layer_id``.

Where this torch cannot reuse region traces (``reusable_regions_supported`` False: torch
< 2.13, e.g. the 2.11 of the GPU machine), the batch has no pool that can bind layers, or grad
mode is on, ``CompiledModel`` is exactly ``torch.compile(model, ...)``: the regions only pay
off with reuse (without it warm compiles get slower, regions.py measures both).

Measured (30-layer decode step, 2-core CPU, ``benchmarks/bench_model.py --compile-only``): see
benchmarks/RESULTS.md, "Issue 5, session 4".
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
from typing import Any, Optional

import torch
from torch import Tensor, nn

from compile.batch.forward_batch import ForwardMode
from compile.graphs.forward_context import set_forward_context
from compile.backend.layer import attention_layers, reading_bound_kv
from compile.graphs.regions import layer_regions, supported as regions_supported


def reusable_regions_supported() -> bool:
    """Whether this torch can trace a nested compile region once and stamp out the layers after
    it (Dynamo's ``invoke_subgraph`` trace reuse, torch >= 2.13), besides running regions at
    all (``compile.graphs.regions.supported``)."""
    if not regions_supported():
        return False
    return importlib.util.find_spec("torch._dynamo.variables.invoke_subgraph") is not None


def _specialize_floats():
    return torch._dynamo.config.patch(specialize_float=True)


# How many graphs Dynamo compiles for a zoo model, and the budget that lets all of them compile
# under fullgraph=True (the default recompile limit, 8, is one budget for every mode of the
# model's forward, and a long schedule of three modes passes it). Per forward mode: one graph
# per pattern of which of the step's four varying sizes (requests b, tokens T, page-table
# width, max_seqlen_q) equal 1, since Dynamo specialises size 1 (2**4 at most), plus one whose
# sizes are still static (the mode's first graph, before a recompile turns them dynamic).
# sglang raises the global limit instead (cache_size_limit = 1024); tests/compile/
# test_recompiles.py checks the count over long random schedules.
GRAPHS_BOUND = (2 ** 4 + 1) * len(ForwardMode)
_RECOMPILE_BUDGET = ({"recompile_limit": GRAPHS_BOUND}
                     if "recompile_limit" in inspect.signature(torch.compile).parameters else {})


def _budget_during_calls():
    """Where ``torch.compile`` takes no ``recompile_limit`` (torch < 2.13), the same budget as
    Dynamo's global limit for the duration of each call (compiles happen inside the call)."""
    if _RECOMPILE_BUDGET:
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(recompile_limit=GRAPHS_BOUND)


def _fixed_query_lengths(forward_batch) -> bool:
    """Whether the step's mode fixes ``max_seqlen_q`` (decode: 1; verify and draft decode: the
    draft length). Reusable regions read the batch's metadata through the forward context, a
    global to Dynamo, and Dynamo specialises every int it reads from a global: an extend, mixed
    or draft-extend step (a new ``max_seqlen_q`` almost every step) would compile again for
    each value until the recompile limit fails it. Those steps run as a plain
    ``torch.compile``, where the batch is an argument and such ints turn dynamic after one
    recompile."""
    mode = getattr(forward_batch, "forward_mode", None)
    return mode is not None and not mode.is_extend_or_draft_extend_or_mixed()


def _pool_of(forward_batch) -> Any:
    pool = getattr(forward_batch, "token_to_kv_pool", None)
    if pool is None:
        pool = getattr(getattr(forward_batch, "attn_backend", None), "token_to_kv_pool", None)
    return pool


class CompiledModel:
    """``torch.compile(model, **compile_kwargs)`` with reusable layer regions.

    Args:
        model: a zoo model called as ``model(input_ids [T], positions [T], forward_batch,
            **kwargs)`` whose decoder layers run through ``compile.graphs.regions.run_layers``.
        regions: trace one layer per kind (see the module docstring). None (default): when
            ``reusable_regions_supported()``. True on a torch without reuse raises.
        **compile_kwargs: passed to ``torch.compile`` (``backend``, ``fullgraph``, ``dynamic``,
            ``mode``, ``options``); ``recompile_limit`` defaults to ``GRAPHS_BOUND`` (older
            torch without the argument: Dynamo's global limit during each call).
    Attributes:
        model: the model. compiled: the ``torch.compile``d model. regions: whether steps run
            with reusable regions. binds: how many times the layers were (re)bound to a pool.
            The model's ``PagedAttention`` modules are listed once, here: per-step binding
            checks (``pool.is_bound(model, layers)``) do not walk the model.
    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        RuntimeError: ``regions=True`` and this torch cannot reuse region traces.

    Steps run without regions (a plain ``torch.compile`` call) when the ``forward_batch`` has
    no pool with ``bind_layers``, when grad mode is on (regions mutate the KV cache inside
    ``invoke_subgraph``, which autograd cannot train through; serving runs under
    ``torch.inference_mode``) and for extend, mixed and draft-extend steps, whose query lengths
    change from step to step (``_fixed_query_lengths``): compiles stay bounded, at the price of
    tracing every layer for those steps. The binding stays on the layers after a call but is
    read only inside ``CompiledModel`` calls (``compile.backend.layer.reading_bound_kv``), so other compiled
    functions of the same model keep their pool look-ups. Calls with regions patch two torch
    functions for their duration (``compile.graphs.regions.layer_regions`` says which and why).

    >>> # engine = Engine(model, forward=compile_model(model))
    """

    def __init__(self, model: nn.Module, *, regions: Optional[bool] = None, **compile_kwargs):
        if not isinstance(model, nn.Module):
            raise TypeError(f"compile_model: model must be an nn.Module, got "
                            f"{type(model).__name__}.")
        if regions and not reusable_regions_supported():
            raise RuntimeError(f"compile_model: regions=True needs Dynamo's region trace reuse "
                               f"(torch >= 2.13); this is torch {torch.__version__}. Pass "
                               f"regions=None to fall back to a plain torch.compile.")
        self.model = model
        self.regions = reusable_regions_supported() if regions is None else bool(regions)
        self.compiled = torch.compile(model, **{**_RECOMPILE_BUDGET, **compile_kwargs})
        self.binds = 0
        self._layers = attention_layers(model)  # per-step binding checks skip the module walk

    def _bind(self, forward_batch) -> bool:
        """Bind the layers to the batch's pool if they are not bound to its current buffers;
        False when the pool cannot bind layers."""
        pool = _pool_of(forward_batch)
        if pool is None or not hasattr(pool, "bind_layers"):
            return False
        if not pool.is_bound(self.model, self._layers):  # False for another pool's binding too
            pool.bind_layers(self.model)
            self.binds += 1
        return True

    def __call__(self, input_ids: Tensor, positions: Tensor, forward_batch, **kwargs):
        """The compiled model's output for this step (``model``'s contract)."""
        # Regions mutate the KV cache inside invoke_subgraph, which autograd cannot train
        # through: with grad enabled this is a plain torch.compile. So is a step whose query
        # lengths vary (see _fixed_query_lengths).
        if not (self.regions and not torch.is_grad_enabled()
                and _fixed_query_lengths(forward_batch) and self._bind(forward_batch)):
            with _budget_during_calls():
                return self.compiled(input_ids, positions, forward_batch, **kwargs)
        # specialize_float: layer regions are shared code, so a float module attribute that
        # differs between models (softmax scale of another head_dim) would otherwise turn into
        # a SymFloat the ops' float arguments reject.
        with layer_regions(), reading_bound_kv(), _specialize_floats(), set_forward_context(
                {}, forward_batch, input_ids.shape[0]):
            return self.compiled(input_ids, positions, forward_batch, **kwargs)


def compile_model(model: nn.Module, *, regions: Optional[bool] = None,
                  **compile_kwargs) -> CompiledModel:
    """``CompiledModel(model, regions=regions, **compile_kwargs)``: the compiled forward of
    ``python -m compile --mode compile`` and of the full decode graphs.

    >>> # forward = compile_model(model, fullgraph=True); logits = forward(ids, pos, batch)
    """
    return CompiledModel(model, regions=regions, **compile_kwargs)


__all__ = ["CompiledModel", "compile_model", "reusable_regions_supported", "GRAPHS_BOUND"]
