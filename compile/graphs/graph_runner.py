"""Full decode graphs: the whole step (attention included) captured per batch-size bucket.

Entry points: ``DecodeGraphRunner(model)`` and ``TargetVerifyGraphRunner(model, draft_token_num)``
are called like the model (``(input_ids, positions, forward_batch) -> logits``) after the host
ran ``attn_backend.init_forward_metadata``; batches they cannot serve (other modes, more
requests than the largest bucket) run ``forward`` directly.

Capture of bucket ``bs`` (first batch that needs it):

1. Allocate static buffers once for ``max_bs`` requests: ``input_ids``, ``positions``,
   ``out_cache_loc`` (``max_bs * q_per_req`` tokens), ``req_pool_indices``, ``seq_lens``; and
   ``attn_backend.init_cuda_graph_state(max_bs, max_num_tokens)`` for the metadata buffers.
2. Fill the bucket's leading slices with the batch, padded rows pointing at request row 0 with
   ``seq_lens = attn_backend.get_cuda_graph_seq_len_fill_value()`` and KV slot 0 (the reserved
   padding slot), and build a ``ForwardBatch`` over those slices.
3. ``init_forward_metadata_out_graph(batch, in_capture=True)`` binds the metadata to slices of
   the backend's buffers; two warm-up runs (Inductor/Triton autotuning happens here).
4. Capture ``init_forward_metadata_in_graph`` + ``forward`` into a device graph (one memory pool
   shared by all buckets, largest first on demand) and keep its output tensor.

Replay: copy the batch into the static slices (tails re-padded), refill the metadata in place
with ``init_forward_metadata_out_graph(batch)``, replay, return rows ``[:tokens]`` of the fixed
output (cloned). Metadata is rebuilt from the whole padded batch every replay, so shrinking or
growing batches never read stale lengths or page-table rows.

On the CPU (or ``capture=False``) the same steps run ``forward`` instead of capture/replay, so the
static-buffer and metadata-refill logic is tested without a GPU. Not done here: draft-decode or
topk > 1 graphs (the backend's graph hooks reject them), capturing extend batches (compose with
piecewise graphs for those: ``full_and_piecewise``).
"""

from __future__ import annotations

import bisect
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from compile.graphs import device as dev
from compile.batch.forward_batch import ForwardBatch, ForwardMode, SpecInfo
from compile.graphs.piecewise import PiecewiseModel

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


class GraphRunner:
    """Captures ``forward`` per batch-size bucket for one forward mode with ``q_per_req`` query
    tokens per request (DECODE: 1; TARGET_VERIFY: ``draft_token_num``).

    Args:
        model: called as ``forward(input_ids [T], positions [T], forward_batch)``.
        mode: ForwardMode.DECODE or ForwardMode.TARGET_VERIFY.
        q_per_req: query tokens per request.
        batch_sizes: captured buckets (a batch of ``b`` requests uses the smallest ``>= b``).
        forward: what is captured (default ``model``; e.g. ``compile_model(model)``).
        capture: capture device graphs (default: when the model's device supports them).
        graph_pool: a ``device.graph_pool_handle`` to share with other graphs (e.g. a
            ``PiecewiseBackend``'s pool); None: a pool of its own, made at the first capture.
    Attributes:
        captures: number of device graphs captured (one per bucket used).
        replays: number of graph replays (or, without capture, static-buffer runs).
    """

    def __init__(self, model, *, mode: ForwardMode, q_per_req: int = 1,
                 batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                 forward: Optional[Callable] = None, capture: Optional[bool] = None,
                 graph_pool=None):
        self.model, self.forward = model, (model if forward is None else forward)
        self.mode, self.q_per_req = mode, int(q_per_req)
        self.batch_sizes = sorted(set(int(b) for b in batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.device = next(model.parameters()).device
        self.capture = dev.supports_graphs(self.device) if capture is None else capture
        self.graphs: dict[int, tuple[object, ForwardBatch, Tensor]] = {}
        self.captures = self.replays = 0
        self._backend = None
        self._pool = graph_pool
        n, i64 = self.max_bs * self.q_per_req, dict(dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.out_cache_loc = torch.zeros(n, **i64)
        self.req_pool_indices = torch.zeros(self.max_bs, **i64)
        self.seq_lens = torch.zeros(self.max_bs, dtype=torch.int32, device=self.device)
        self.seq_lens_cpu = torch.zeros(self.max_bs, dtype=torch.int32)

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """True when ``forward_batch`` has this runner's mode and fits the largest bucket."""
        fb = forward_batch
        if fb.forward_mode != self.mode or not 0 < fb.batch_size <= self.max_bs:
            return False
        if self.mode.is_decode() and fb.spec_info is not None:
            return False  # draft decode: not captured here
        if self.mode.is_target_verify():
            spec = fb.spec_info
            return (spec is not None and max(spec.topk, 1) == 1
                    and spec.draft_token_num == self.q_per_req)
        return True

    def __call__(self, input_ids: Tensor, positions: Tensor, forward_batch: ForwardBatch,
                 **kwargs) -> Tensor:
        if not self.can_run(forward_batch):
            return self.forward(input_ids, positions, forward_batch, **kwargs)
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, forward_batch.batch_size)]
        self._setup(forward_batch.attn_backend)
        static = self._fill(bs, input_ids, positions, forward_batch)
        tokens = input_ids.shape[0]
        if bs not in self.graphs:
            self._capture(bs, static)
            return self.graphs[bs][2][:tokens].clone()
        graph, static, output = self.graphs[bs]
        self._backend.init_forward_metadata_out_graph(static)
        self.replays += 1
        if graph is None:  # no capture: the same static-buffer step, run directly
            return self._run(static)[:tokens].clone()
        graph.replay()
        return output[:tokens].clone()

    def _setup(self, backend) -> None:
        if self._backend is None:
            self._backend = backend
            backend.init_cuda_graph_state(self.max_bs, self.max_bs * self.q_per_req)
        elif backend is not self._backend:
            raise RuntimeError("GraphRunner: the batch's attn_backend differs from the one the "
                               "graphs were captured with; expected one backend per runner.")

    def _fill(self, bs: int, input_ids: Tensor, positions: Tensor,
              fb: ForwardBatch) -> ForwardBatch:
        """Copy the batch into the static slices of bucket ``bs`` (padded) and return a
        ForwardBatch over them (the captured one when ``bs`` was captured)."""
        b, n, q = fb.batch_size, input_ids.shape[0], self.q_per_req
        fill = self._backend.get_cuda_graph_seq_len_fill_value()
        for buf, values, pad, size in ((self.input_ids, input_ids, 0, bs * q),
                                       (self.positions, positions, 0, bs * q),
                                       (self.out_cache_loc, fb.out_cache_loc, 0, bs * q),
                                       (self.req_pool_indices, fb.req_pool_indices, 0, bs),
                                       (self.seq_lens, fb.seq_lens, fill, bs)):
            buf[:values.shape[0]].copy_(values)
            buf[values.shape[0]:size].fill_(pad)
        self.seq_lens_cpu[:b].copy_(fb.seq_lens_cpu)
        self.seq_lens_cpu[b:bs].fill_(fill)
        if bs in self.graphs:
            static = self.graphs[bs][1]
        else:
            spec = None
            if self.mode.is_target_verify():
                spec = SpecInfo(topk=1, draft_token_num=q)
            static = ForwardBatch(
                forward_mode=self.mode, batch_size=bs,
                req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
                seq_lens_cpu=self.seq_lens_cpu[:bs], out_cache_loc=self.out_cache_loc[:bs * q],
                positions=self.positions[:bs * q], spec_info=spec)
            static.attn_backend, static.token_to_kv_pool = fb.attn_backend, fb.token_to_kv_pool
            static.req_to_token_pool = fb.req_to_token_pool
        static.seq_lens_sum = int(self.seq_lens_cpu[:bs].sum())
        assert n <= bs * q, "can_run admits only batches that fit the bucket"
        return static

    def _run(self, static: ForwardBatch) -> Tensor:
        self._backend.init_forward_metadata_in_graph(static)
        n = static.batch_size * self.q_per_req
        return self.forward(self.input_ids[:n], self.positions[:n], static)

    def _capture(self, bs: int, static: ForwardBatch) -> None:
        """Steps 3-4 of the module docstring for bucket ``bs``."""
        self._backend.init_forward_metadata_out_graph(static, in_capture=True)
        if not self.capture:
            self.graphs[bs] = (None, static, self._run(static))
            return
        device = self.device
        for _ in range(2):  # warm-up outside capture: compilation and autotuning happen here
            self._run(static)
        dev.synchronize(device)
        if self._pool is None:
            self._pool = dev.graph_pool_handle(device)
        graph = dev.new_graph(device)
        with dev.graph_capture(graph, device, pool=self._pool):
            output = self._run(static)
        self.graphs[bs] = (graph, static, output)
        self.captures += 1
        graph.replay()  # capture records only; run once for this call's result


class DecodeGraphRunner(GraphRunner):
    """Full graphs of DECODE steps (one token per request), per batch-size bucket.

    >>> # engine = Engine(model, forward=DecodeGraphRunner(model, forward=compile_model(model)))
    """

    def __init__(self, model, **kwargs):
        super().__init__(model, mode=ForwardMode.DECODE, q_per_req=1, **kwargs)


class TargetVerifyGraphRunner(GraphRunner):
    """Full graphs of TARGET_VERIFY steps with topk 1 (``draft_token_num`` tokens/request)."""

    def __init__(self, model, draft_token_num: int, **kwargs):
        super().__init__(model, mode=ForwardMode.TARGET_VERIFY, q_per_req=draft_token_num,
                         **kwargs)


def full_and_piecewise(model, *, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                       capture: Optional[bool] = None, **piecewise_kwargs) -> DecodeGraphRunner:
    """Full graphs for decode steps, piecewise graphs for every other step: one forward.

    Returns ``DecodeGraphRunner(model, forward=PiecewiseModel(model, ...))``; the split of work:

    1. DECODE steps of at most ``max(batch_sizes)`` requests (``runner.can_run``) are padded
       to a request bucket and replayed as one device graph per bucket. That graph was recorded
       through the ``PiecewiseModel``: the pieces ran as compiled code, the split op ran the
       backend on the runner's fixed metadata buffers (all ``bs`` rows, padded rows with
       ``seq_lens`` 1, as the plain graphs mode), so a replay launches the whole step at once
       and runs no Python (nothing reads the forward context then).
    2. Every other step (extend, mixed, draft extend, target verify, draft decode, decode past
       the largest request bucket) runs ``PiecewiseModel.forward``: pieces captured per
       token-count bucket, attention eager between them.
    3. ``full_graph_steps=runner.can_run`` keeps the pieces uncaptured for the steps of 1,
       so no piece warms up or captures inside the runner's warm-up or capture (a nested
       capture also raises in ``PieceRunner``); both share one graph memory pool.

    Why: attention between pieces costs host time per layer (launches plus Python), which
    decode, with little device work per step, cannot hide; extend steps have enough device
    work to hide it and too many shapes to capture whole.

    Source: vLLM's ``CUDAGraphMode.FULL_AND_PIECEWISE`` (one compiled model; uniform decode
    batches replay whole-step graphs, all other batches piecewise graphs); sglang pairs
    piecewise prefill graphs with full decode graphs the same way.

    Args:
        model: as ``PiecewiseModel``'s (its attention layers are switched to the split op).
        batch_sizes: request buckets of the decode graphs.
        capture: capture device graphs, both kinds (default: when the device supports them).
        **piecewise_kwargs: ``PiecewiseModel`` options (``graph_sizes``, ``inductor``, ``debug``,
            ``emulate_graphs``, ``device``).
    Returns:
        a ``DecodeGraphRunner`` whose ``forward`` is the ``PiecewiseModel``.

    >>> # engine = Engine(model, forward=full_and_piecewise(model))
    """
    pw = PiecewiseModel(model, capture=capture, **piecewise_kwargs)
    runner = DecodeGraphRunner(model, batch_sizes=batch_sizes, forward=pw, capture=capture,
                               graph_pool=pw.backend.graph_pool())
    pw.full_graph_steps = runner.can_run
    return runner


__all__ = ["DEFAULT_BATCH_SIZES", "GraphRunner", "DecodeGraphRunner", "TargetVerifyGraphRunner",
           "full_and_piecewise"]
