"""The forward context: how the opaque split op finds its layer and batch in piecewise mode.

In piecewise mode (``compile/graphs/piecewise.py``) attention is one opaque op,
``xpu_ops::unified_attention_with_output(q, k, v, output, layer_id, sinks=None, q_rope=None,
k_rope=None, save_kv_cache=True)`` (``compile/graphs/split_op.py``), whose arguments are plain tensors
(optional ones None), an int and a bool, so the graph pieces around it can be compiled and
captured once per token-count bucket. What attention also needs (the ``PagedAttention`` module
of ``layer_id`` and the step's ``ForwardBatch`` with its metadata) is read from this context
instead. It is the one piece of hidden state the project allows (STYLE.md): it exists only
inside ``set_forward_context`` and reading it anywhere else raises ``RuntimeError``.

>>> from compile.graphs.forward_context import set_forward_context, get_forward_context
>>> with set_forward_context({}, forward_batch=None, num_tokens=3):
...     get_forward_context().num_tokens
3
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Mapping, Optional


@dataclasses.dataclass
class ForwardContext:
    """What the split op and the piece runners read during one model step.

    Attributes:
        layers: ``layer_id -> PagedAttention`` of the model (the split op calls
            ``forward_batch.attn_backend.forward(q, k, v, layers[layer_id], forward_batch,
            save_kv_cache, sinks=..., q_rope=..., k_rope=...)``, extras only when given).
        forward_batch: the step's ``ForwardBatch``, metadata already initialised
            (``attn_backend.init_forward_metadata`` ran on the host before the step).
        num_tokens: real tokens of the step. Inputs may be padded to a larger bucket; the split
            op attends only rows ``[:num_tokens]`` and zeroes the padded tail of ``output``.
        graph_size: the token-count bucket the pieces are padded to and captured at, or None to
            run the compiled pieces without capture (CPU, extend batches, sizes past the largest
            bucket).
    """

    layers: Mapping[int, Any]
    forward_batch: Any
    num_tokens: int
    graph_size: Optional[int] = None


_CONTEXT: Optional[ForwardContext] = None


@contextlib.contextmanager
def set_forward_context(layers: Mapping[int, Any], forward_batch: Any, num_tokens: int,
                        graph_size: Optional[int] = None) -> Iterator[ForwardContext]:
    """Make a ``ForwardContext`` current for the duration of the block (nesting restores).

    Args:
        layers: ``layer_id -> PagedAttention``.
        forward_batch: ``ForwardBatch`` of the step (None is allowed for tests without attention).
        num_tokens: real tokens of the step (before padding).
        graph_size: bucket the step is padded to and replayed at; None runs without capture.
    """
    global _CONTEXT
    previous = _CONTEXT
    _CONTEXT = ForwardContext(layers=layers, forward_batch=forward_batch,
                              num_tokens=int(num_tokens), graph_size=graph_size)
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


__all__ = ["ForwardContext", "set_forward_context", "get_forward_context",
           "has_forward_context"]
