"""``compile_model``: ``torch.compile`` of a zoo model, traced once per layer kind.

``torch.compile(model)`` works on every zoo model (tests/compile/test_compile_model.py), but
Dynamo traces all N decoder layers and Inductor compiles N copies of the same code: a 30-layer
model takes ~60 s cold and ~10 s warm on a 2-core CPU. ``compile_model(model)`` returns a
``CompiledModel``: the same ``torch.compile``, called so that Dynamo traces one layer per kind
and stamps out the others (docs/regions_reuse.md):

1. each step runs inside ``compile.regions.layer_regions()`` (one nested compile region per
   decoder layer) and ``compile.forward_context.set_forward_context`` holding the step's
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

import importlib.util
from typing import Any, Optional

import torch
from torch import Tensor, nn

from .forward_context import set_forward_context
from .layer import attention_layers, reading_bound_kv
from .regions import layer_regions, supported as regions_supported


def reusable_regions_supported() -> bool:
    """Whether this torch can trace a nested compile region once and stamp out the layers after
    it (Dynamo's ``invoke_subgraph`` trace reuse, torch >= 2.13), besides running regions at
    all (``compile.regions.supported``)."""
    if not regions_supported():
        return False
    return importlib.util.find_spec("torch._dynamo.variables.invoke_subgraph") is not None


def _specialize_floats():
    return torch._dynamo.config.patch(specialize_float=True)


def _pool_of(forward_batch) -> Any:
    pool = getattr(forward_batch, "token_to_kv_pool", None)
    if pool is None:
        pool = getattr(getattr(forward_batch, "attn_backend", None), "token_to_kv_pool", None)
    return pool


class CompiledModel:
    """``torch.compile(model, **compile_kwargs)`` with reusable layer regions.

    Args:
        model: a zoo model called as ``model(input_ids [T], positions [T], forward_batch,
            **kwargs)`` whose decoder layers run through ``compile.regions.run_layers``.
        regions: trace one layer per kind (see the module docstring). None (default): when
            ``reusable_regions_supported()``. True on a torch without reuse raises.
        **compile_kwargs: passed to ``torch.compile`` (``backend``, ``fullgraph``, ``dynamic``,
            ``mode``, ``options``).
    Attributes:
        model: the model. compiled: the ``torch.compile``d model. regions: whether steps run
            with reusable regions. binds: how many times the layers were (re)bound to a pool.
            The model's ``PagedAttention`` modules are listed once, here: per-step binding
            checks (``pool.is_bound(model, layers)``) do not walk the model.
    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        RuntimeError: ``regions=True`` and this torch cannot reuse region traces.

    Steps run without regions (a plain ``torch.compile`` call) when the ``forward_batch`` has
    no pool with ``bind_layers`` or grad mode is on (regions mutate the KV cache inside
    ``invoke_subgraph``, which autograd cannot train through; serving runs under
    ``torch.inference_mode``). The binding stays on the layers after a call but is read only
    inside ``CompiledModel`` calls (``compile.layer.reading_bound_kv``), so other compiled
    functions of the same model keep their pool look-ups. Calls with regions patch two torch
    functions for their duration (``compile.regions.layer_regions`` says which and why).

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
        self.compiled = torch.compile(model, **compile_kwargs)
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
        # through: with grad enabled this is a plain torch.compile.
        if not (self.regions and not torch.is_grad_enabled() and self._bind(forward_batch)):
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


__all__ = ["CompiledModel", "compile_model", "reusable_regions_supported"]
