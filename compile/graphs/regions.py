"""Hierarchical compile of decoder layers: Inductor compiles each kind of layer once.

``torch.compile(model, fullgraph=True)`` of an N-layer decoder inlines N copies of the layer, so
AOTAutograd and Inductor (lowering, fusion, C++/Triton codegen) repeat the same work N times.
``run_layers`` calls each layer inside ``torch.compiler.nested_compile_region`` (one
``invoke_subgraph`` node per layer). Layers whose traced bodies are equal (same shapes and the same
Python constants: window, softcap, RoPE or NoPE) share one subgraph, compiled once; layers that
differ get one subgraph per kind. Each layer still reads and writes its own KV buffers: they are
subgraph inputs, looked up through ``layer_id`` while Dynamo traces that layer.

What it does not do:

1. Alone, regions leave Dynamo tracing every layer: its guard-based trace reuse (torch >= 2.13)
   cannot apply while ``forward_batch`` is a region argument (a plain object) and each layer
   indexes the pool by its own ``layer_id``. Reuse (docs/regions_reuse.md): bind the KV buffers
   on the layers (``pool.bind_layers(model)``; MHA, hybrid SWA and MLA pools) and call the
   model inside ``compile.graphs.forward_context.set_forward_context`` with the step's batch; the
   regions then read the batch from the context and Dynamo traces one layer per kind.
   ``compile.graphs.compiled_model.compile_model`` does all of this per call.
2. Piecewise mode: ``compile.graphs.piecewise`` splits the top-level graph at the split op, which must
   not hide inside a subgraph, so layers that attend through the split op run as plain calls.
3. A region that mutates its inputs (``store_kv_cache`` writes the pool) is functionalized through
   ``FunctionalCallableWithEpilogue``, which in torch <= 2.13 uses C++ ``torch.func.functionalize``
   and rejects mutable custom ops ("Found a custom (non-ATen) operator whose output has alias
   annotations"; pytorch issues 186807 and 189523, fixed upstream by pull request 189543). Where
   that code is found, ``layer_regions`` swaps its ``__call__`` for the upstream approach (Python
   functionalization, which auto-functionalizes custom ops, then ``copy_`` of every mutated
   input) for the duration of its block. Patching torch is why regions are opt-in: without
   ``with layer_regions():`` layers are plain calls.

Measured (30-layer decode step, 2-core CPU, benchmarks/bench_model.py, session 2): cold compile
65-68 s without regions, 33 s with; warm (caches filled) 10.3-10.8 s without, 13-14 s with;
with reuse (``compile_model``): benchmarks/RESULTS.md.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from compile.graphs.forward_context import get_forward_context, has_forward_context
from compile.backend.layer import bound_kv_enabled, kv_is_bound


def _functionalize_with_epilogue(self, *args, **kwargs):
    """``FunctionalCallableWithEpilogue.__call__`` on Python functionalization: run the subgraph
    on functional wrappers, ``copy_`` each mutated input back, return the unwrapped outputs."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    boxed = getattr(self, "_boxed_call", False)
    if boxed:  # callers pass one list (or, some of them, the tensors unpacked)
        args = (args[0] if len(args) == 1 and isinstance(args[0], list) else list(args),)
    leaves, spec = pytree.tree_flatten((args, kwargs))  # before a boxed callee clears its list
    no_functionalize = torch._C._ExcludeDispatchKeyGuard(
        torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize))
    with no_functionalize, FunctionalTensorMode():
        wrapped = [FunctionalTensor.to_functional(x) if isinstance(x, Tensor) else x
                   for x in leaves]
        fargs, fkwargs = pytree.tree_unflatten(wrapped, spec)
        outs = self.orig_callable(*fargs, **fkwargs)
        outs = pytree.tree_map_only(FunctionalTensor, _from_functional, outs)
        updates = []
        for x, fx in zip(leaves, wrapped):
            if isinstance(fx, FunctionalTensor):
                torch._sync(fx)
                if torch._functionalize_has_data_mutation(fx.elem):
                    updates.append((x, _from_functional(fx)))
    for x, new in updates:  # the epilogue: outside the mode, so it is traced as aten.copy_
        x.copy_(new)
    return tuple(outs) if boxed else outs


def _from_functional(t):
    torch._sync(t)
    return torch._from_functional_tensor(t.elem)


def _epilogue_class():
    """torch's ``FunctionalCallableWithEpilogue`` when it still uses the C++ path, else None."""
    try:
        from torch._higher_order_ops.auto_functionalize import FunctionalCallableWithEpilogue
    except ImportError:
        return None
    names = getattr(getattr(FunctionalCallableWithEpilogue.__call__, "__code__", None),
                    "co_names", ())
    needs_backport = "func" in names and "functionalize" in names
    return FunctionalCallableWithEpilogue if needs_backport else None


def _alias_replaced_symbols(tx, match) -> None:
    """Bind, in the tracer that stamps out a region, each symbolic size the region's first trace
    lifted under an expression the tracer only knows under its original symbol.

    Dynamo wraps a batch-sized metadata tensor with a fresh size symbol ``u`` and binds ``u``;
    the ops' shape checks then prove ``u == s + 1`` (``cu_seqlens_q`` is ``[b + 1]`` when
    ``cache_seqlens`` is ``[b]``) and the shape environment replaces ``u`` by ``s + 1``. The
    first trace records the lifted size as ``s + 1``, and torch 2.13's ``stamp_out_subgraph``
    looks that expression up among the bound symbols (``KeyError: s1 + 1``, on the first
    dynamic-shape recompile), or under a symbol replaced since (``s5 + 1`` with ``s5 = s28``,
    hybrid SWA pools). Any bound proxy whose value has the same canonical form
    (``shape_env.replace``) computes exactly that value, so it is bound under the recorded
    expression too.
    """
    from torch._dynamo.output_graph import LazyProxy
    from torch._dynamo.variables.invoke_subgraph import LiftedBoundSymbol

    bound = tx.output.current_tracer.bound_symbols
    replace = tx.output.shape_env.replace  # an expression in today's canonical symbols
    missing: dict = {}  # canonical form -> the expressions the first trace recorded
    for m in match.subgraph_input_mapping:
        if isinstance(m, LiftedBoundSymbol) and m.expr not in bound:
            missing.setdefault(replace(m.expr), []).append(m.expr)
    if not missing:
        return
    for proxy in list(bound.values()):
        value = (proxy.args[0] if isinstance(proxy, LazyProxy)
                 else proxy.node.meta.get("example_value"))
        if isinstance(value, torch.SymInt):
            for expr in missing.get(replace(value.node.expr), ()):
                bound[expr] = proxy


def _stamp_out_patch():
    """``(module, patched stamp_out_subgraph)`` for torch's region trace reuse, or None."""
    try:
        from torch._dynamo.variables import invoke_subgraph
        from torch._dynamo.variables.invoke_subgraph import LiftedBoundSymbol  # noqa: F401
        original = invoke_subgraph.stamp_out_subgraph
    except (ImportError, AttributeError):
        return None

    def stamp_out_subgraph(tx, fingerprint, match):
        _alias_replaced_symbols(tx, match)
        return original(tx, fingerprint, match)

    return invoke_subgraph, stamp_out_subgraph


def supported() -> bool:
    """Whether this torch can run layer regions (``nested_compile_region`` and the
    functionalization class exist; the backport is installed by ``layer_regions`` if needed)."""
    if not hasattr(torch.compiler, "nested_compile_region"):
        return False
    try:
        from torch._higher_order_ops.auto_functionalize import (  # noqa: F401
            FunctionalCallableWithEpilogue)
    except ImportError:
        return False
    return True


#: Whether ``run_layers`` wraps layers in nested compile regions (off unless ``layer_regions``).
LAYER_REGIONS: bool = False


@contextlib.contextmanager
def layer_regions(enabled: bool = True) -> Iterator[None]:
    """Opt in to one nested compile region per decoder layer inside the ``with`` block.

    Compile (call the ``torch.compile``d model for the first time) inside the block. On torch
    versions whose input-mutating regions go through C++ functionalization (pytorch issues 186807
    and 189523), the block also swaps ``FunctionalCallableWithEpilogue.__call__`` for the Python
    functionalization of pull request 189543, and where Dynamo reuses region traces it wraps
    ``stamp_out_subgraph`` so a size the shape checks replaced by an expression is found
    (``_alias_replaced_symbols``); both process-wide, both put back on exit. Patching torch is
    why this is an explicit opt-in (``compile.graphs.compiled_model`` opts in per call).

    Raises:
        RuntimeError: ``enabled`` and this torch has no ``nested_compile_region`` or no
            ``FunctionalCallableWithEpilogue``.
    """
    global LAYER_REGIONS
    if enabled and not supported():
        raise RuntimeError(f"layer_regions: torch {torch.__version__} has no usable "
                           "torch.compiler.nested_compile_region; expected torch >= 2.8 with "
                           "torch._higher_order_ops.auto_functionalize."
                           "FunctionalCallableWithEpilogue.")
    patches = []  # (owner, attribute, replacement), put back in reverse order on exit
    cls = _epilogue_class() if enabled else None
    if cls is not None:
        patches.append((cls, "__call__", _functionalize_with_epilogue))
    stamp_out = _stamp_out_patch() if enabled else None
    if stamp_out is not None:
        patches.append((stamp_out[0], "stamp_out_subgraph", stamp_out[1]))
    originals = [getattr(owner, name) for owner, name, _ in patches]
    previous = LAYER_REGIONS
    for owner, name, new in patches:
        setattr(owner, name, new)
    LAYER_REGIONS = enabled
    try:
        yield
    finally:
        LAYER_REGIONS = previous
        for (owner, name, _), original in reversed(list(zip(patches, originals))):
            setattr(owner, name, original)


def _call_layer(layer: nn.Module, positions: Tensor, h: Tensor, forward_batch) -> Tensor:
    return layer(positions, h, forward_batch)


def _call_layer_from_context(layer: nn.Module, positions: Tensor, h: Tensor) -> Tensor:
    # The batch is read from the forward context, not passed in: a region argument that is a
    # plain object (ForwardBatch) turns Dynamo's region reuse off (docs/regions_reuse.md).
    return layer(positions, h, get_forward_context().forward_batch)


def _region(fn):
    return (torch.compiler.nested_compile_region(fn)
            if hasattr(torch.compiler, "nested_compile_region") else fn)


_region_call = _region(_call_layer)
_reusable_region_call = _region(_call_layer_from_context)


def _kv_bound(layers: nn.ModuleList) -> bool:
    return all(kv_is_bound(layer.self_attn.attn) for layer in layers)


def run_layers(layers: nn.ModuleList, positions: Tensor, h: Tensor, forward_batch) -> Tensor:
    """``h [T, hidden]`` through every decoder layer, each one a nested compile region.

    Args:
        layers: decoder layers called as ``layer(positions, h, forward_batch)``, each with its
            ``PagedAttention`` at ``layer.self_attn.attn``.
        positions: [T] int64. h: [T, hidden]. forward_batch: ForwardBatch.
    Returns:
        [T, hidden]. Plain calls (the same math) when ``LAYER_REGIONS`` is False or a layer
        attends through the piecewise split op (a Python bool: Dynamo guards on it).

    Regions Dynamo can reuse (trace one layer per kind, docs/regions_reuse.md) when, in
    addition, the model runs inside ``compile.graphs.forward_context.set_forward_context`` with this
    step's ``forward_batch`` (the regions read it from there; the caller must pass the same
    batch), every layer's KV buffers are bound (``pool.bind_layers(model)`` of an
    ``MHATokenToKVPool``, ``SWAKVPool`` or ``MLATokenToKVPool``; ``pool.is_bound(model)``
    tells whether the binding still matches the pool) and the call is inside
    ``compile.backend.layer.reading_bound_kv()``. ``compile.graphs.compiled_model.CompiledModel`` does all
    three per call.
    """
    split = any(layer.self_attn.attn.split_op is not None for layer in layers)
    if not LAYER_REGIONS or split:
        for layer in layers:
            h = _call_layer(layer, positions, h, forward_batch)
        return h
    if has_forward_context() and bound_kv_enabled() and _kv_bound(layers):
        # Reusable: Dynamo traces one layer per kind and stamps out the others.
        if get_forward_context().forward_batch is not forward_batch:
            raise ValueError("run_layers: the forward context holds another ForwardBatch than "
                             "the one passed to the model; expected the model called inside "
                             "set_forward_context(..., forward_batch=<that batch>, ...) (the "
                             "reusable layer regions read the batch from the context).")
        for layer in layers:
            h = _reusable_region_call(layer, positions, h)
        return h
    for layer in layers:
        h = _region_call(layer, positions, h, forward_batch)
    return h


__all__ = ["LAYER_REGIONS", "layer_regions", "run_layers", "supported"]
