"""``GraphRunner``: the serving path's step runner. Fixed-shape steps replay whole-step graphs.

Entry points: ``full_and_piecewise(model)`` (what ``python -m compile --mode graphs`` runs) and
``GraphRunner(model, forward=...)``; both are called like the model (``(input_ids,
positions, forward_batch) -> logits``) with the batch's metadata *not* built yet: the runner
makes it, exactly once per step (``builds_metadata``), as sglang's ``ModelRunner.forward``
does (a replayed plain DECODE step computes it inside its graph).

Per step:

1. A step it can capture (``can_run``: DECODE; TARGET_VERIFY ``draft_token_num`` tokens wide
   (``spec_info.num_tokens_per_req``), a chain (topk 1) or a tree (topk > 1: the cascade);
   draft DECODE with topk 1 or ``topk``; draft extend (DRAFT_EXTEND_V2, or EXTEND with a draft
   input) of ``draft_token_num`` tokens in every request; at most ``max(batch_sizes)``
   requests) is padded to the smallest request bucket ``bs``: ``StepBuffers.load`` copies it
   into the runner's fixed buffers and gives it its metadata over them
   (``compile/graphs/step_buffers.py``; a tree mask is padded to the bucket): built on the
   host, except for a plain DECODE step, whose metadata is computed inside the captured step.
2. The forward context gets ``BatchDescriptor(FULL, mode, bs)`` and the step runs through one
   ``GraphWrapper`` (``compile/graphs/graph_wrapper.py``): one warm-up step per descriptor
   (compilation and autotuning), then capture, then replays of the whole step: the backend's
   ``init_forward_metadata_in_graph`` (a plain DECODE step's ``cache_seqlens`` and page
   table from the step buffers; nothing for other steps), then the model, attention
   included. Inside it, a ``PiecewiseModel`` forward neither pads nor captures its pieces
   (they see FULL).
3. Any other step (extend, mixed, ragged draft extend, idle, too many requests) builds its
   metadata with ``init_forward_metadata`` and runs ``forward`` (a ``PiecewiseModel`` then pads
   it to a token bucket and replays its pieces).

Source: vLLM's ``CUDAGraphMode.FULL_AND_PIECEWISE`` (uniform decode batches replay whole-step
graphs, all other batches piecewise graphs; one ``CUDAGraphWrapper`` class for both); sglang's
``CudaGraphRunner`` (request buckets, padded rows with ``seq_lens`` 1).
"""

from __future__ import annotations

import bisect
from typing import Callable, Optional, Sequence

from torch import Tensor

from compile.batch import ForwardBatch
from compile.graphs import device as dev
from compile.graphs.forward_context import (BatchDescriptor, GraphMode, get_forward_context,
                                            set_forward_context)
from compile.graphs.graph_wrapper import GraphWrapper
from compile.graphs.piecewise import PiecewiseModel
from compile.graphs.split_op import layers_by_id
from compile.graphs.step_buffers import StepBuffers, TokenBuffers

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


class GraphRunner:
    """Whole-step graphs per request bucket for the fixed-shape steps; ``forward`` for the rest.

    Args:
        model: called as ``forward(input_ids [T], positions [T], forward_batch)``.
        forward: what runs and is captured (default ``model``; ``PiecewiseModel`` in
            ``full_and_piecewise``; ``compile_model(model)``).
        batch_sizes: request buckets (a batch of ``b`` requests uses the smallest ``>= b``).
        draft_token_num: D of the TARGET_VERIFY and draft-extend steps captured (0: they run
            ``forward``).
        speculative_num_steps: draft steps per round of the draft-decode steps captured (their
            ``out_cache_loc`` holds the whole round, ``topk * num_steps`` slots per request; 0:
            one per branch).
        topk: branches per request of the tree draft-decode steps captured (their
            ``spec_info.topk``; steps with topk 1 are captured too).
        capture: capture device graphs (default: when the model's device supports them).
        emulate_graphs: capture CPU stand-ins (tests; ``GraphWrapper``'s ``emulate``: True,
            ``"tape"`` or ``"rerun"``); implies ``capture``.
        debug: check on every replay that no input moved.
        graph_pool: a ``device.graph_pool_handle`` shared with other graphs (the pieces').
        tokens: the ``TokenBuffers`` the step buffers use (the pieces'), or None for their own.
    Attributes:
        builds_metadata: True (the engine leaves the metadata to the runner).
        buffers: the ``StepBuffers`` (made at the first captured step).
        graph: the ``GraphWrapper`` of the whole step.
        static_steps: steps run through the step buffers (captured, replayed or warm-up).
        retargets: times a batch came with a backend that cannot share the step buffers
            (``shares_graph_buffers``: another engine's, e.g. one runner passed to two
            ``Engine``s): the runner dropped its buffers and whole-step graphs and captures
            again for the new backend (one engine at a time; alternating engines recapture).
    """

    builds_metadata = True

    def __init__(self, model, *, forward: Optional[Callable] = None,
                 batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, draft_token_num: int = 0,
                 speculative_num_steps: int = 0, topk: int = 1, capture: Optional[bool] = None,
                 emulate_graphs: bool | str = False, debug: bool = False, graph_pool=None,
                 tokens: Optional[TokenBuffers] = None):
        self.model, self.forward = model, (model if forward is None else forward)
        self.batch_sizes = sorted(set(int(b) for b in batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.draft_token_num, self.num_steps = int(draft_token_num), int(speculative_num_steps)
        self.topk = max(int(topk), 1)
        self.device = next(model.parameters()).device
        if capture is None:
            capture = emulate_graphs or dev.supports_graphs(self.device)
        self.capture = capture
        self.layers = layers_by_id(model)
        pool = dev.graph_pool_handle(self.device) if graph_pool is None else graph_pool
        self.graph = GraphWrapper(self._step, GraphMode.FULL, self.device, name="the full step",
                                  capture=capture, emulate=emulate_graphs, debug=debug,
                                  pool=pool, warmup_calls=1)
        self.buffers: Optional[StepBuffers] = None
        self.tokens = tokens
        self.static_steps = self.retargets = 0

    @property
    def captures(self) -> int:
        """Whole-step graphs captured (one per descriptor used twice or more)."""
        return self.graph.captures

    @property
    def replays(self) -> int:
        """Whole-step graph replays."""
        return self.graph.replays

    def step_shape(self, fb: ForwardBatch) -> Optional[tuple[int, int]]:
        """``(query tokens, KV slots)`` per request of a step this runner captures, else None."""
        mode, spec = fb.forward_mode, fb.spec_info
        if not 0 < fb.batch_size <= self.max_bs:
            return None
        if mode.is_decode():
            if spec is None:
                return 1, 1
            topk, slots = max(spec.topk, 1), fb.out_cache_loc.shape[0] // fb.batch_size
            if topk not in (1, self.topk) or slots not in (topk, topk * self.num_steps):
                return None
            return topk, slots
        if mode.is_target_verify() and spec is not None and self.draft_token_num:
            d, width = self.draft_token_num, spec.num_tokens_per_req
            width = width if width > 0 else spec.draft_token_num  # sglang 0.5.23's verify width
            return (d, d) if width == d else None
        if fb.is_draft_extend() and self.draft_token_num:
            d = self.draft_token_num
            return (d, d) if all(n == d for n in fb.extend_seq_lens_cpu) else None
        return None

    def can_run(self, fb: ForwardBatch) -> bool:
        """True when ``fb`` replays a whole-step graph (``step_shape`` is not None)."""
        return self.step_shape(fb) is not None

    def __call__(self, input_ids: Tensor, positions: Tensor, forward_batch: ForwardBatch,
                 **kwargs) -> Tensor:
        shape = None if kwargs else self.step_shape(forward_batch)
        if shape is None:
            forward_batch.attn_backend.init_forward_metadata(forward_batch)
            return self.forward(input_ids, positions, forward_batch, **kwargs)
        fb, (q, slots) = forward_batch, shape
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, fb.batch_size)]
        desc = self._descriptor(fb, bs)
        ids, pos, static = self._buffers(fb).load(desc, input_ids, positions, fb, q, slots)
        self.static_steps += 1
        with set_forward_context(self.layers, static, bs * q, desc):
            out = self.graph(ids, pos)
        rows = input_ids.shape[0] if out.shape[0] == bs * q else fb.batch_size  # per token/req
        return out[:rows].clone()

    @staticmethod
    def _descriptor(fb: ForwardBatch, bs: int) -> BatchDescriptor:
        spec, backend = fb.spec_info, fb.attn_backend
        draft = spec is not None and spec.is_draft_input()
        return BatchDescriptor(GraphMode.FULL, fb.forward_mode, bs, draft=draft,
                               topk=0 if spec is None else max(spec.topk, 1),
                               step=backend.speculative_step_id if draft else 0)

    def _step(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """What the wrapper runs and captures: the backend's in-graph metadata work
        (``init_forward_metadata_in_graph``), then ``forward``, over the step buffers."""
        fb = get_forward_context().forward_batch
        fb.attn_backend.init_forward_metadata_in_graph(fb)
        return self.forward(input_ids, positions, fb)

    def _buffers(self, fb: ForwardBatch) -> StepBuffers:
        if self.buffers is not None and not self.buffers.backend.shares_graph_buffers(
                fb.attn_backend):
            self._retarget()
        if self.buffers is None:
            per_req = max(1, self.draft_token_num, self.topk * max(self.num_steps, 1))
            self.buffers = StepBuffers(fb.attn_backend, self.max_bs, self.max_bs * per_req,
                                       self.tokens)
        return self.buffers

    def _retarget(self) -> None:
        """Forget the step buffers and whole-step graphs of the previous backend (another
        engine's: its graphs read that engine's pools and metadata buffers), so the next
        captured step warms up, captures and replays on the new backend's. The compiled
        ``forward`` (pieces included) is kept: it reads no pool itself."""
        self.buffers = None
        self.graph.entries.clear()
        self.graph.calls.clear()
        self.retargets += 1


def full_and_piecewise(model, *, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                       capture: Optional[bool] = None, draft_token_num: int = 0,
                       speculative_num_steps: int = 0, topk: int = 1,
                       **piecewise_kwargs) -> GraphRunner:
    """The serving path: whole-step graphs for fixed-shape steps, pieces for the rest.

    Returns ``GraphRunner(model, forward=PiecewiseModel(model, ...))``: decode, verify, draft
    decode (chains and trees) and uniform draft-extend steps of at most ``max(batch_sizes)``
    requests replay one device graph per request bucket, recorded through the piecewise model
    (its pieces as compiled code, the split op's attention on the step buffers' metadata);
    every other step runs the
    ``PiecewiseModel``: pieces captured per token bucket, attention eager between them. Both
    kinds share one graph memory pool and one pair of padded token buffers.

    Why: attention between pieces costs host time per layer, which decode, with little device
    work per step, cannot hide; extend steps have enough device work to hide it and too many
    shapes to capture whole.

    Args:
        model: as ``PiecewiseModel``'s (its attention layers are switched to the split op).
        batch_sizes, draft_token_num, speculative_num_steps, topk: as ``GraphRunner``'s.
        capture: capture device graphs, both kinds (default: when the device supports them).
        **piecewise_kwargs: ``PiecewiseModel`` options (``graph_sizes``, ``inductor``, ``debug``,
            ``emulate_graphs``, ``device``); ``debug`` and ``emulate_graphs`` apply to both.
    Returns:
        a ``GraphRunner`` whose ``forward`` is the ``PiecewiseModel``.

    >>> # engine = Engine(model, forward=full_and_piecewise(model))
    """
    pw = PiecewiseModel(model, capture=capture, **piecewise_kwargs)
    return GraphRunner(model, forward=pw, batch_sizes=batch_sizes,
                       draft_token_num=draft_token_num,
                       speculative_num_steps=speculative_num_steps, topk=topk, capture=capture,
                       emulate_graphs=piecewise_kwargs.get("emulate_graphs", False),
                       debug=piecewise_kwargs.get("debug", False), graph_pool=pw.backend.pool,
                       tokens=pw.tokens)


__all__ = ["DEFAULT_BATCH_SIZES", "GraphRunner", "full_and_piecewise"]
