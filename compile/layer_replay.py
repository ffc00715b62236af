"""``LayerReplay``: one split-op attention call, re-run on the host without its Python path.

In a piecewise decode step every layer's attention runs eagerly between captured graph pieces,
and on a fast GPU that host work is the step's bottleneck: the split op's checks, the forward
context, the backend's dispatch on the layer kind, the plan look-ups (``xpu_ops.plan``), for
two kernel launches (the KV store, and attention with its split-KV merge inside). When the step's
metadata lives in fixed buffers across steps (``XPUAttentionBackend.persist_forward_metadata``),
a layer's call is the same from step to step: the same piece outputs (a captured piece returns
the same tensors on every replay), the same KV cache, the same metadata tensors with new values. The split op then records, on the first such
call, the validated plan runs the backend made (``planned_run(..., record=...)``) and replays
them on later calls, after checking that it got the very same tensor objects and token count
and that what else the runs read is unchanged: the layer's KV buffers in the pool and its fp8
scales (``XPUAttentionBackend.replay_state``), compared by identity.

A call is recorded only when the backend served it with plan runs alone (plain MHA pool, no fp8
descale copies, no cascade, no MLA, result written straight into the op's output): the backend
marks any other work with a ``None`` in the record, which makes it unrecordable. What this
assumes beyond those checks is what a captured graph assumes: the tensors the runs read are
updated in place, never resized (``resize_``/``set_`` on the same object). This is the host-side
analogue of FlashInfer's plan/run split (plan once per batch, run per layer), carried across
steps.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import Tensor


def _same_objects(a: tuple, b: tuple) -> bool:
    """``a`` and ``b`` hold the very same objects, position by position."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class LayerReplay:
    """The plan runs of one split-op call, for calls with the same inputs.

    Args:
        inputs: the split op's ``(q, k, v, output, sinks, q_rope, k_rope, save_kv_cache)`` of
            the recorded call (kept: identity is the check).
        num_tokens: the step's real tokens (``forward_context.num_tokens``).
        runs: ``(OpPlan, slot tensors)`` in the order the backend ran them.
        tail: ``output[num_tokens:]`` when the call zeroed a padded tail, else None.
        state: ``XPUAttentionBackend.replay_state(layer)`` when the call was recorded.
    """

    __slots__ = ("inputs", "num_tokens", "runs", "tail", "state")

    def __init__(self, inputs: tuple, num_tokens: int, runs: Sequence[tuple[Any, tuple]],
                 tail: Optional[Tensor], state: tuple):
        self.inputs, self.num_tokens = inputs, num_tokens
        self.runs, self.tail, self.state = tuple(runs), tail, state

    @staticmethod
    def recordable(runs: Optional[list]) -> bool:
        """Whether a record the backend filled holds plan runs only (no ``None`` marker)."""
        return bool(runs) and all(r is not None for r in runs)

    def matches(self, inputs: tuple, num_tokens: int) -> bool:
        """True for the recorded call's very objects (and ``save_kv_cache`` flag) and tokens."""
        return num_tokens == self.num_tokens and _same_objects(inputs, self.inputs)

    def same_state(self, state: tuple) -> bool:
        """True when ``state`` holds the very objects recorded (``replay_state`` now)."""
        return _same_objects(state, self.state)

    def replay(self) -> None:
        """Re-run the recorded plans (and zero the padded tail)."""
        for plan, tensors in self.runs:
            plan.run_matched(tensors)
        if self.tail is not None:
            self.tail.zero_()


__all__ = ["LayerReplay"]
