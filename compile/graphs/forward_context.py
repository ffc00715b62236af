"""The forward context: the one piece of hidden state of a step (vLLM's ``ForwardContext``).

It tells two readers what the current step is:

- the split op ``xpu_ops::unified_attention_with_output`` (``compile/graphs/split_op.py``), whose
  arguments are plain tensors, an int and a bool, reads the ``PagedAttention`` of its
  ``layer_id`` and the step's ``ForwardBatch`` here;
- every ``GraphWrapper`` (``compile/graphs/graph_wrapper.py``) reads the step's
  ``BatchDescriptor``: whether this step is captured whole (``GraphMode.FULL``), piece by piece
  (``GraphMode.PIECEWISE``) or not at all (None), and at which bucket.

It exists only inside ``set_forward_context``; reading it anywhere else raises ``RuntimeError``
(STYLE.md allows this one channel and no other).

>>> from compile.graphs.forward_context import set_forward_context, get_forward_context
>>> with set_forward_context({}, forward_batch=None, num_tokens=3):
...     get_forward_context().num_tokens
3
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import Any, Iterator, Mapping, Optional


class GraphMode(enum.Enum):
    """How a step is captured (vLLM's ``CUDAGraphMode`` without NONE: no descriptor is NONE)."""

    PIECEWISE = "piecewise"  # the compiled pieces between attention calls, per token bucket
    FULL = "full"  # the whole step, attention included, per request bucket


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    """The key of one captured graph.

    Attributes:
        graph_mode: which kind of ``GraphWrapper`` captures this step (the others run their
            callable uncaptured).
        forward_mode: the batch's ``ForwardMode``; ``draft``: a draft-model step (its
            ``spec_info`` is a draft input: draft decode or draft extend).
        bucket: what the step is padded to: requests for ``FULL``, tokens for ``PIECEWISE``.
        topk: branches per request of a speculative step (0: none; above 1: a cascade).
        step: the draft step (``speculative_step_id``) of a draft-decode step.
    """

    graph_mode: GraphMode
    forward_mode: Any
    bucket: int
    draft: bool = False
    topk: int = 0
    step: int = 0


@dataclasses.dataclass
class ForwardContext:
    """What the split op and the graph wrappers read during one model step.

    Attributes:
        layers: ``layer_id -> PagedAttention`` of the model (the split op calls
            ``layers[layer_id].attend(q, k, v, forward_batch, ...)``).
        forward_batch: the step's ``ForwardBatch``, metadata already built.
        num_tokens: tokens the split op attends; rows past it are padding (zeroed outputs).
            A full-graph step attends every padded row (its padded requests have
            ``seq_lens`` 1), so there it is the padded count.
        batch_descriptor: how this step is captured, or None (nothing is captured).
    """

    layers: Mapping[int, Any]
    forward_batch: Any
    num_tokens: int
    batch_descriptor: Optional[BatchDescriptor] = None


_CONTEXT: Optional[ForwardContext] = None


@contextlib.contextmanager
def set_forward_context(layers: Mapping[int, Any], forward_batch: Any, num_tokens: int,
                        batch_descriptor: Optional[BatchDescriptor] = None
                        ) -> Iterator[ForwardContext]:
    """Make a ``ForwardContext`` current for the duration of the block (nesting restores).

    Args:
        layers: ``layer_id -> PagedAttention``.
        forward_batch: ``ForwardBatch`` of the step (None is allowed for tests without attention).
        num_tokens: tokens the split op attends (see ``ForwardContext``).
        batch_descriptor: how the step is captured; None runs every wrapper uncaptured.
    """
    global _CONTEXT
    previous = _CONTEXT
    _CONTEXT = ForwardContext(layers=layers, forward_batch=forward_batch,
                              num_tokens=int(num_tokens), batch_descriptor=batch_descriptor)
    try:
        yield _CONTEXT
    finally:
        _CONTEXT = previous


def get_forward_context() -> ForwardContext:
    """The current ``ForwardContext``.

    Raises:
        RuntimeError: called outside ``set_forward_context`` (e.g. a model in piecewise mode run
            directly instead of through ``compile.graphs.piecewise.PiecewiseModel``).
    """
    if _CONTEXT is None:
        raise RuntimeError("get_forward_context: no forward context is set; the split op "
                           "xpu_ops::unified_attention_with_output reads its layer and "
                           "ForwardBatch from it. Run the step inside "
                           "compile.graphs.forward_context.set_forward_context(...) or through "
                           "compile.graphs.piecewise.PiecewiseModel.")
    return _CONTEXT


def has_forward_context() -> bool:
    """True inside ``set_forward_context``."""
    return _CONTEXT is not None


def current_batch_descriptor() -> Optional[BatchDescriptor]:
    """The current step's ``BatchDescriptor``; None outside any context or for an uncaptured
    step."""
    return None if _CONTEXT is None else _CONTEXT.batch_descriptor


__all__ = ["GraphMode", "BatchDescriptor", "ForwardContext", "set_forward_context",
           "get_forward_context", "has_forward_context", "current_batch_descriptor"]
