"""``XPUMultiStepDraftBackend``: the draft model's backends of one speculative round.

A round of ``speculative_num_steps`` draft steps runs the draft model ``speculative_num_steps -
1`` times in DECODE mode (the first draft token comes from the draft extend); forward ``i`` has
its own ``XPUAttentionBackend`` (``speculative_step_id = i``), because each step attends one
more draft token per branch and writes its K/V into column ``i`` of the round's slots
(``out_cache_loc`` laid out ``(b, topk, num_steps)``). The worker sets
``forward_batch.attn_backend = attn_backends[i]`` before forward ``i``.

Graphs: the step backends share the pool, page table and geometry, so one set of fixed metadata
buffers serves all of them (``shares_graph_buffers``): a ``GraphRunner`` captures one graph per
(bucket, step) and refills the shared buffers from the step's own backend before each replay.
sglang's runners call ``init_cuda_graph_state`` / ``init_forward_metadata_out_graph`` here,
which forward to every step backend (each then holds its own buffers, as sglang's round graph
replays all steps at once).

Source: sglang 0.5.23 ``XPUMultiStepDraftBackend`` (``layers/attention/xpu_backend.py``).
"""

from __future__ import annotations

import dataclasses

from compile.backend.attention_backend import XPUAttentionBackend
from compile.batch import ForwardBatch, ForwardMode


class XPUMultiStepDraftBackend:
    """One ``XPUAttentionBackend`` per draft forward of a round.

    Args:
        model_runner: as ``XPUAttentionBackend``'s.
        topk: branches per request (1: a chain).
        speculative_num_steps: draft steps per round (at least 2: one draft forward or more).
    Attributes:
        attn_backends: ``speculative_num_steps - 1`` backends, ``speculative_step_id`` 0, 1, ...
    Raises:
        ValueError: ``topk`` < 1 or ``speculative_num_steps`` < 2.

    >>> import torch
    >>> from types import SimpleNamespace
    >>> from compile.batch import MHATokenToKVPool, ReqToTokenPool
    >>> runner = SimpleNamespace(
    ...     device="cpu", page_size=16, tp_size=1, kv_cache_dtype=torch.float32,
    ...     model_config=SimpleNamespace(context_len=64, num_attention_heads=4),
    ...     req_to_token_pool=ReqToTokenPool(2, 64, "cpu"),
    ...     token_to_kv_pool=MHATokenToKVPool(64, 16, torch.float32, 2, 8, 1, "cpu"))
    >>> multi = XPUMultiStepDraftBackend(runner, topk=2, speculative_num_steps=3)
    >>> [b.speculative_step_id for b in multi.attn_backends], multi.attn_backends[1].topk
    ([0, 1], 2)
    """

    needs_cpu_seq_lens: bool = False

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        if int(topk) < 1 or int(speculative_num_steps) < 2:
            raise ValueError(f"XPUMultiStepDraftBackend: topk/speculative_num_steps out of "
                             f"range; expected topk >= 1 and speculative_num_steps >= 2, got "
                             f"{topk} and {speculative_num_steps}. One draft step needs no "
                             f"multi-step backend: use XPUAttentionBackend.")
        self.topk, self.speculative_num_steps = int(topk), int(speculative_num_steps)
        self.attn_backends = [
            XPUAttentionBackend(model_runner, skip_prefill=True, speculative_step_id=i,
                                topk=self.topk, speculative_num_steps=self.speculative_num_steps)
            for i in range(self.speculative_num_steps - 1)]
        self.max_context_len = self.attn_backends[0].max_context_len
        self.device = model_runner.device
        self.token_to_kv_pool = model_runner.token_to_kv_pool

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Every step backend builds its metadata of the round's batch."""
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """sglang's hook: every step backend allocates its graph buffers."""
        for backend in self.attn_backends:
            backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch,
                                        in_capture: bool = False) -> None:
        """sglang's hook: every step backend fills its buffers for the round's batch, seen as
        DECODE (a draft round's batch may arrive in IDLE-padded form)."""
        inner = dataclasses.replace(forward_batch, forward_mode=ForwardMode.DECODE)
        for backend in self.attn_backends:
            backend.init_forward_metadata_out_graph(inner, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """sglang's hook: nothing is recorded in the graph (see the step backends)."""
        for backend in self.attn_backends:
            backend.init_forward_metadata_in_graph(forward_batch)


__all__ = ["XPUMultiStepDraftBackend"]
