"""Call the graph Dynamo chose for a bucketed step again without going through Dynamo.

Every call of a ``torch.compile``d model enters Dynamo: the frame's guards are evaluated and
its transformed bytecode loads every graph input (each parameter through a chain of module
attribute lookups) before the graph runs. For a 16-layer model on the H200 host that was close
to 1 ms per decode step, which a piecewise step pays on top of its attention calls while a
whole-step device graph pays nothing. vLLM skips it the same way (its compiled models dispatch
to the compiled code directly once compiled); here the rule is conservative:

- ``GraphCall`` wraps the split graph that ``PiecewiseBackend`` hands to Dynamo and remembers
  each call's arguments and result.
- ``DirectDispatch`` keys steps by a fingerprint (bucket size, forward mode, whether the batch
  has ``spec_info`` / ``encoder_lens``, the ``forward_batch`` type, grad and inference mode).
  After Dynamo has run a key ``warm_calls`` times (warm-up, capture, replay), a key qualifies
  when its graph has no per-step input at all (every input is a parameter, buffer, padded static
  ``input_ids``/``positions`` view or the bucket size: ``per_step_placeholders`` finds none, so
  extend, mixed and draft-extend steps, which read ``extend_seq_lens``, never qualify), the last
  two calls passed the very same argument objects to the same graph, and the graph's result was
  the model's output (a one-element tuple holding it). Later steps of that key call the graph
  directly with those arguments.

What it assumes, as vLLM does: the model's traced ``forward`` has no Python side effects and
reads nothing from ``forward_batch`` that is not a graph input or covered by the fingerprint.
Parameters must be updated in place, never replaced by new tensor objects, but that holds for
any captured piece already (a device graph keeps reading the old addresses).
``PiecewiseModel(..., direct_dispatch=False)`` keeps every step in Dynamo.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Optional

import torch
from torch import fx


class GraphCall:
    """The callable ``PiecewiseBackend`` returns to Dynamo: runs ``split_gm`` and records the
    arguments and result of the latest call in ``recorder.last``. ``per_step``: the graph has
    inputs whose Dynamo source may change from step to step (``per_step_placeholders``, e.g.
    ``forward_batch.extend_seq_lens``); such a graph is never dispatched directly."""

    __slots__ = ("split_gm", "recorder", "per_step")

    def __init__(self, split_gm: fx.GraphModule, recorder: "DirectDispatch",
                 per_step: bool = False):
        self.split_gm, self.recorder, self.per_step = split_gm, recorder, per_step

    def __call__(self, *args):
        result = self.split_gm(*args)
        self.recorder.last = (self, args, result)
        return result


class DirectDispatch:
    """Fingerprint -> (graph, arguments) of steps that may skip Dynamo (see the module doc).

    Args:
        warm_calls: Dynamo calls of a fingerprint before it may be dispatched directly.
    """

    def __init__(self, warm_calls: int = 3):
        self.warm_calls = warm_calls
        self.last: Optional[tuple] = None
        self._seen: dict[Hashable, tuple[int, Optional[tuple]]] = {}
        self._direct: dict[Hashable, tuple[Callable, tuple]] = {}

    @staticmethod
    def fingerprint(size: int, forward_batch, kwargs: dict) -> Optional[Hashable]:
        """The key of a bucketed step, or None when it must go through Dynamo (keyword
        arguments, or a batch without ``forward_mode``)."""
        mode = getattr(forward_batch, "forward_mode", None)
        if kwargs or mode is None:
            return None
        return (size, mode, getattr(forward_batch, "spec_info", None) is None,
                getattr(forward_batch, "encoder_lens", None) is None, type(forward_batch),
                torch.is_grad_enabled(), torch.is_inference_mode_enabled())

    def lookup(self, key: Hashable) -> Optional[tuple[Callable, tuple]]:
        """``(graph, arguments)`` to call for ``key``, or None."""
        return self._direct.get(key)

    def record(self, key: Hashable, output: Any) -> None:
        """After Dynamo ran a step of ``key`` that returned ``output``: count it and enable the
        direct path when the conditions of the module docstring hold."""
        last, self.last = self.last, None
        count, previous = self._seen.get(key, (0, None))
        if last is None:
            self._seen[key] = (count + 1, None)
            return
        graph, args, result = last
        self._seen[key] = (count + 1, (graph, args))
        same = (previous is not None and previous[0] is graph and len(previous[1]) == len(args)
                and all(a is b or (type(a) is int and a == b)
                        for a, b in zip(previous[1], args)))
        single = isinstance(result, (tuple, list)) and len(result) == 1 and result[0] is output
        if count + 1 >= self.warm_calls and same and single and not graph.per_step:
            self._direct[key] = (graph.split_gm, args)

    def clear(self) -> None:
        """Forget every direct entry: the next steps of every key go through Dynamo again."""
        self._seen.clear()
        self._direct.clear()
        self.last = None


__all__ = ["GraphCall", "DirectDispatch"]
