"""``compile_model``: ``torch.compile`` of a zoo model's forward, run inside the forward context.

What ``python -m compile --mode compile`` runs; ``compile.graphs.graph_runner.GraphRunner(model,
forward=compile_model(model))`` captures it per batch bucket. Dynamo traces the whole model
(``fullgraph=True`` holds for every zoo model: tests/compile/graphs/test_compile_model.py) and
Inductor compiles it; compile time comes from Inductor's caches. Each call runs inside
``compile.graphs.forward_context.set_forward_context`` with the step's ``ForwardBatch``, so code
that reads the context (the split op, in piecewise models) finds the same batch as in eager.

What it does not do: split the graph at attention (``compile.graphs.piecewise``), capture device
graphs (``compile.graphs.graph_runner``), or compile identical layers once (the piecewise
backend does that for pieces).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import Tensor, nn

from compile.batch import ForwardMode
from compile.graphs.forward_context import set_forward_context

# How many graphs Dynamo compiles for a zoo model, and the budget that lets all of them compile
# under fullgraph=True (the default recompile limit, 8, is one budget for every mode of the
# model's forward, and a long schedule of three modes passes it). Per forward mode: one graph
# per pattern of which of the step's four varying sizes (requests b, tokens T, page-table
# width, max_seqlen_q) equal 1, since Dynamo specialises size 1 (2**4 at most), plus one whose
# sizes are still static (the mode's first graph, before a recompile turns them dynamic).
# sglang raises the global limit instead (cache_size_limit = 1024);
# tests/compile/graphs/test_recompiles.py checks the count over long random schedules.
GRAPHS_BOUND = (2 ** 4 + 1) * len(ForwardMode)
_RECOMPILE_BUDGET = ({"recompile_limit": GRAPHS_BOUND}
                     if "recompile_limit" in inspect.signature(torch.compile).parameters else {})


def _budget_during_calls():
    """Where ``torch.compile`` takes no ``recompile_limit`` (torch < 2.13), the same budget as
    Dynamo's global limit for the duration of each call (compiles happen inside the call)."""
    if _RECOMPILE_BUDGET:
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(recompile_limit=GRAPHS_BOUND)


class CompiledModel:
    """``torch.compile(model, **compile_kwargs)``, called inside the step's forward context.

    Args:
        model: a zoo model called as ``model(input_ids [T], positions [T], forward_batch,
            **kwargs)``.
        **compile_kwargs: passed to ``torch.compile`` (``backend``, ``fullgraph``, ``dynamic``,
            ``mode``, ``options``); ``recompile_limit`` defaults to ``GRAPHS_BOUND`` (older
            torch without the argument: Dynamo's global limit during each call).
    Attributes:
        model: the model. compiled: the ``torch.compile``d model.
        fixed_table_width: True: ``compile.engine.Engine`` builds its page tables as wide as
            the request pool in every step (``MetadataBuilderMixin.fixed_table_width``), so
            decode steps of one batch size share one graph across page boundaries.
    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """

    fixed_table_width = True

    def __init__(self, model: nn.Module, **compile_kwargs):
        if not isinstance(model, nn.Module):
            raise TypeError(f"compile_model: model must be an nn.Module; expected a zoo model, "
                            f"got {type(model).__name__}. Pass the model, not its forward.")
        self.model = model
        self.compiled = torch.compile(model, **{**_RECOMPILE_BUDGET, **compile_kwargs})

    def __call__(self, input_ids: Tensor, positions: Tensor, forward_batch, **kwargs):
        """The compiled model's output for this step (``model``'s contract)."""
        with _budget_during_calls(), set_forward_context({}, forward_batch, input_ids.shape[0]):
            return self.compiled(input_ids, positions, forward_batch, **kwargs)


def compile_model(model: nn.Module, **compile_kwargs) -> CompiledModel:
    """``CompiledModel(model, **compile_kwargs)``: the compiled forward of ``python -m compile
    --mode compile`` and of the full decode graphs.

    >>> import torch
    >>> from compile.graphs.compiled_model import compile_model
    >>> forward = compile_model(torch.nn.Linear(2, 2), backend="eager", fullgraph=True)
    >>> type(forward.compiled).__name__
    'OptimizedModule'
    """
    return CompiledModel(model, **compile_kwargs)


__all__ = ["CompiledModel", "compile_model", "GRAPHS_BOUND"]
