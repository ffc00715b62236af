"""Splitting a Dynamo graph for piecewise execution: where to cut, what may be captured.

``split_graph`` cuts an FX graph at every split-op node (``is_split_node``) and, optionally,
before the first node that depends on a per-step input; ``per_step_placeholders`` finds those
inputs from Dynamo's sources and ``capture_plan`` decides per piece whether it can be captured;
``graph_signature`` identifies structurally identical pieces (compiled once).
``compile/graphs/piecewise.py`` describes the whole flow.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Collection, Optional, Sequence

import torch
from torch import Tensor, fx
from torch.fx.passes.split_module import split_module

from compile.graphs.linear_split_op import linear_attend_into
from compile.graphs.split_op import attend_into

# split op name -> its check-free body (what split graphs call)
_SPLIT_BODIES = {"unified_attention_with_output": attend_into,
                 "unified_linear_attention_with_output": linear_attend_into}


def _split_op_name(node: fx.Node) -> Optional[str]:
    """The split op ``node`` calls (a key of ``_SPLIT_BODIES``), or None."""
    if node.op != "call_function":
        return None
    packet = getattr(node.target, "overloadpacket", node.target)
    for name in _SPLIT_BODIES:
        if packet is getattr(torch.ops.xpu_ops, name, None):
            return name
    return None


def is_split_node(node: fx.Node) -> bool:
    """True for a call of a split op: ``xpu_ops::unified_attention_with_output`` (paged
    layers) or ``xpu_ops::unified_linear_attention_with_output`` (linear-attention layers)."""
    return _split_op_name(node) is not None


def call_split_op_kernel(gm: fx.GraphModule) -> None:
    """Make ``gm``'s split-op nodes call ``split_op.attend_into`` (the op's body without its
    shape checks; ``linear_split_op.linear_attend_into`` for linear layers) directly at run
    time.

    The attention submodules only ever run eagerly on real tensors (pieces were compiled on
    fakes before this, and the fakes ran the checks), so the dispatcher round trip (C++
    dispatch back into Python, version bump of ``output``) and the checks are pure host cost
    on every layer of every step.
    """
    for node in gm.graph.nodes:
        name = _split_op_name(node)
        if name is not None:
            node.target = _SPLIT_BODIES[name]
    gm.recompile()


@dataclasses.dataclass
class SplitItem:
    """One submodule of the split graph: ``submod_<index>``, an attention call or a piece
    (``is_cut``: the tail of a piece, cut off before its first per-step node)."""

    name: str
    index: int
    is_split: bool
    graph: fx.GraphModule
    is_cut: bool = False


def split_graph(gm: fx.GraphModule, per_step: Collection[fx.Node] = ()
                ) -> tuple[fx.GraphModule, list[SplitItem]]:
    """Split ``gm`` at split-op nodes, each in its own submodule, original order kept; a piece
    is also cut before its first node that depends on a ``per_step`` node, so the part before
    the cut can still be captured.

    Args:
        gm: a Dynamo graph.
        per_step: nodes (placeholders, from ``per_step_placeholders``) whose address or shape
            may change between steps of one bucket.
    Returns:
        ``(split_gm, items)``: ``split_gm`` calls ``submod_0, submod_1, ...`` in order; ``items``
        lists them with ``is_split`` True for the attention submodules. A graph with ``L`` split
        ops gives ``2 L + 1`` submodules when no two split ops are adjacent, plus one per cut.
    """
    partition: dict[fx.Node, int] = {}
    tainted, cut_ids = set(per_step), set()
    current, cut = 0, False
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if any(a in tainted for a in node.all_input_nodes):
            tainted.add(node)
        if is_split_node(node):
            current += 1  # a partition of its own
            partition[node] = current
            current, cut = current + 1, False
            continue
        if node in tainted and not cut:
            current, cut = current + 1, True  # the rest of this piece: uncaptured
            cut_ids.add(current)
        partition[node] = current
    split_gm = split_module(gm, None, lambda n: partition[n], keep_original_order=True)
    split_ids = {partition[n] for n in partition if is_split_node(n)}
    items = []
    for name, sub in split_gm.named_children():
        index = int(name.rsplit("_", 1)[1])
        items.append(SplitItem(name, index, index in split_ids, sub, index in cut_ids))
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


_LOCAL = re.compile(r"^L\['(\w+)'\]")


def _source_name(node: fx.Node) -> Optional[str]:
    """Dynamo's source of a placeholder (``L['forward_batch'].extend_seq_lens``), or None."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return None
    name = source.name
    return name() if callable(name) else name


def per_step_placeholders(gm: fx.GraphModule, static_inputs: Sequence[str]
                          ) -> dict[fx.Node, str]:
    """``placeholder -> Dynamo source`` of every input of ``gm`` that may change address or
    shape between steps of one bucket.

    An input is fixed when Dynamo's source for it is rooted at ``L['self']`` (parameters and
    buffers) or at a local named in ``static_inputs`` (the padded static buffers and their
    sizes); every other one (``forward_batch`` fields such as ``extend_seq_lens``, extra kwargs,
    globals, placeholders without a source) is per-step.
    """
    fixed_roots = {"self", *static_inputs}
    per_step = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            name = _source_name(node)
            match = _LOCAL.match(name or "")
            if match is None or match.group(1) not in fixed_roots:
                per_step[node] = name or node.name
    return per_step


def capture_plan(split_gm: fx.GraphModule, pieces: Collection[str],
                 static_inputs: Sequence[str]) -> dict[str, Optional[str]]:
    """Which pieces of ``split_gm`` may be captured: ``piece name -> None`` (capturable) or the
    reason it must run uncaptured.

    A piece reading a per-step input (``per_step_placeholders``) is uncaptured, and so is every
    piece reading an output of an uncaptured piece (its address changes every step). Outputs of
    captured pieces are fixed buffers of their graphs, and attention writes into them in place.
    """
    reasons = {node: f"reads {name}"
               for node, name in per_step_placeholders(split_gm, static_inputs).items()}
    plan: dict[str, Optional[str]] = {}
    for node in split_gm.graph.nodes:
        if node.op == "placeholder":
            continue
        reason = next((reasons[a] for a in node.all_input_nodes if a in reasons), None)
        if node.op == "call_module" and node.target in pieces:
            plan[node.target] = reason
            if reason is not None:
                reason = f"reads uncaptured {node.target}"
        if reason is not None:
            reasons[node] = reason
    return plan


__all__ = ["is_split_node", "call_split_op_kernel", "SplitItem", "split_graph",
           "graph_signature", "per_step_placeholders", "capture_plan"]
