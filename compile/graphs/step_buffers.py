"""``StepBuffers`` and ``TokenBuffers``: the fixed-address inputs of captured steps.

``TokenBuffers`` holds the model's ``input_ids`` and ``positions``, padded to a bucket; the
piecewise model feeds its pieces from one, and ``StepBuffers`` (a runner's whole-step inputs)
holds one beside the batch and metadata buffers.

A device graph reads the addresses it saw at capture, so each input of a captured step lives
in a buffer allocated once, for the largest bucket: the model's ``input_ids`` and ``positions``,
the batch's ``out_cache_loc``, ``req_pool_indices`` and ``seq_lens``, and every attention
metadata tensor (``XPUAttentionBackend.graph_metadata_buffers``). One pipeline fills them per
step (``load``):

1. Copy the batch into the leading slices of its bucket; padded requests point at request row 0
   with ``seq_lens`` = the backend's fill value (1) and KV slot 0 (the reserved padding slot).
   Steps of several tokens per request (verify, draft extend) have the same count in every
   request, padded ones included (a draft extend's ``extend_seq_lens`` are a fixed buffer:
   the model's LM head reads them inside the graph); encoder-decoder steps carry their
   ``encoder_lens`` (0 for padded requests); a tree mask is padded to the bucket
   (``graph_spec_info``: a padded request's drafts see only themselves).
2. Give back the ``ForwardBatch`` over those slices (made once per ``BatchDescriptor``).
3. Give the step its metadata over the metadata buffers (the step's backend's
   ``fill_graph_metadata(..., in_graph=True)``), made that backend's ``forward_metadata``. A
   plain DECODE step (``fills_in_graph``) builds and copies nothing on the host: its
   metadata is bound at the descriptor's first step as views of the buffers, and the captured
   step computes the values from ``seq_lens`` and ``req_pool_indices`` (the runner calls
   ``init_forward_metadata_in_graph`` inside it), so its host work per replay is step 1's
   copies. Every other step's metadata is built once on the host, bound at the descriptor's
   first step and refilled in place after.

The metadata is computed from the whole padded batch every step (in the graph, or on the
host), so shrinking or growing batches never read stale lengths or page-table rows. Source:
sglang's ``CudaGraphRunner`` buffers and its backends' ``init_forward_metadata_*_cuda_graph``
split.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from compile.batch import ForwardBatch
from compile.graphs.forward_context import BatchDescriptor


class TokenBuffers:
    """Fixed ``input_ids`` and ``positions`` [max_tokens] int64 and their leading views.

    Args:
        max_tokens: tokens of the largest bucket. device: where they live.
        dynamic: mark every view of two or more tokens dynamic (``torch._dynamo.mark_dynamic``
            on dim 0), so Dynamo traces one graph for all buckets of a mode.
    """

    def __init__(self, max_tokens: int, device, *, dynamic: bool = False):
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_tokens, **i64)
        self.positions = torch.zeros(max_tokens, **i64)
        self.dynamic = dynamic
        self._views: dict[int, tuple[Tensor, Tensor]] = {}

    def views(self, size: int) -> tuple[Tensor, Tensor]:
        """``(input_ids[:size], positions[:size])``, the same view objects at every call."""
        if size not in self._views:
            ids, pos = self.input_ids[:size], self.positions[:size]
            if self.dynamic and size >= 2:  # 0 and 1 are specialised by Dynamo anyway
                torch._dynamo.mark_dynamic(ids, 0)
                torch._dynamo.mark_dynamic(pos, 0)
            self._views[size] = (ids, pos)
        return self._views[size]

    def load(self, size: int, input_ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Copy the step's tokens into the views of bucket ``size``, padded tail zeroed."""
        ids, pos = self.views(size)
        n = input_ids.shape[0]
        if n == size:
            ids.copy_(input_ids)
            pos.copy_(positions)
            return ids, pos
        ids[:n].copy_(input_ids)
        ids[n:].zero_()
        pos[:n].copy_(positions)
        pos[n:].zero_()
        return ids, pos


class StepBuffers:
    """Fixed buffers for captured steps of up to ``max_bs`` requests and ``max_num_tokens``
    query tokens (and KV slots: a draft-decode round writes ``num_steps`` per request).

    Args:
        backend: the ``XPUAttentionBackend`` whose metadata the steps use (steps of backends
            that ``shares_graph_buffers`` with it, e.g. the draft steps of one round, fill the
            same buffers: each step refills them before its replay).
        max_bs: requests of the largest bucket.
        max_num_tokens: query tokens (and ``out_cache_loc`` slots) of the largest bucket.
        tokens: a ``TokenBuffers`` of at least ``max_num_tokens`` to use (a ``PiecewiseModel``'s:
            a step is either captured whole or piecewise, so one pair of buffers serves both),
            or None to make one.
    Attributes:
        tokens: ``TokenBuffers`` of ``input_ids`` and ``positions`` (>= max_num_tokens).
        out_cache_loc: [max_num_tokens] int64.
        req_pool_indices: [max_bs] int64. seq_lens: [max_bs] int32 (``seq_lens_cpu`` its host
            twin).
        encoder_lens: [max_bs] int32 (encoder-decoder steps; padded requests 0).
        metadata: ``AttentionMetadata.tensors()`` name -> buffer.
        bound: ``BatchDescriptor`` -> the ``AttentionMetadata`` bound to ``metadata``.
    """

    def __init__(self, backend, max_bs: int, max_num_tokens: int,
                 tokens: Optional[TokenBuffers] = None):
        self.backend, self.max_bs, self.max_num_tokens = backend, max_bs, max_num_tokens
        i64 = dict(dtype=torch.int64, device=backend.device)
        if tokens is None or tokens.input_ids.shape[0] < max_num_tokens:
            tokens = TokenBuffers(max_num_tokens, backend.device)
        self.tokens = tokens
        self.out_cache_loc = torch.zeros(max_num_tokens, **i64)
        self.req_pool_indices = torch.zeros(max_bs, **i64)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=backend.device)
        self.seq_lens_cpu = torch.zeros(max_bs, dtype=torch.int32)
        self.extend_seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=backend.device)
        self.encoder_lens = torch.zeros(max_bs, dtype=torch.int32, device=backend.device)
        self.metadata = backend.graph_metadata_buffers(max_bs, max_num_tokens)
        self.bound: dict[BatchDescriptor, Any] = {}
        self._batches: dict[BatchDescriptor, ForwardBatch] = {}

    def load(self, desc: BatchDescriptor, input_ids: Tensor, positions: Tensor,
             fb: ForwardBatch, tokens_per_req: int, slots_per_req: int
             ) -> tuple[Tensor, Tensor, ForwardBatch]:
        """Steps 1-3 of the module docstring for a batch of bucket ``desc.bucket``.

        Returns:
            ``(input_ids, positions, forward_batch)`` over the buffers' leading slices.
        """
        bs, fill = desc.bucket, self.backend.get_cuda_graph_seq_len_fill_value()
        n = bs * tokens_per_req
        ids, pos = self.tokens.load(n, input_ids, positions)
        for buf, values, pad, size in ((self.out_cache_loc, fb.out_cache_loc, 0,
                                        bs * slots_per_req),
                                       (self.req_pool_indices, fb.req_pool_indices, 0, bs),
                                       (self.seq_lens, fb.seq_lens, fill, bs),
                                       (self.seq_lens_cpu, fb.seq_lens_cpu, fill, bs)):
            buf[:values.shape[0]].copy_(values)
            if values.shape[0] < size:  # padded requests (an empty fill still dispatches)
                buf[values.shape[0]:size].fill_(pad)
        static = self._batch(desc, fb, pos, tokens_per_req, slots_per_req)
        if fb.encoder_lens is not None:  # encoder-decoder: padded requests have no encoder
            b = fb.encoder_lens.shape[0]
            self.encoder_lens[:b].copy_(fb.encoder_lens)
            self.encoder_lens[b:bs].zero_()
            static.encoder_lens = self.encoder_lens[:bs]
            static.encoder_lens_cpu = list(fb.encoder_lens_cpu) + [0] * (bs - b)
        if static.extend_seq_lens is not None:
            self.extend_seq_lens[:bs].fill_(tokens_per_req)
        pad_rows = bs - fb.seq_lens.shape[0]
        static.seq_lens_sum = fb.seq_lens_sum + fill * pad_rows  # no host reduction
        # host-side facts (topk, draft count, steps; a tree mask padded to the bucket)
        static.spec_info = self.backend.graph_spec_info(fb.spec_info, fb.seq_lens, bs)
        self.bound[desc] = static.attn_backend.fill_graph_metadata(
            static, self.metadata, self.bound.get(desc), in_graph=True)
        return ids, pos, static

    def _batch(self, desc: BatchDescriptor, fb: ForwardBatch, positions: Tensor,
               tokens_per_req: int, slots_per_req: int) -> ForwardBatch:
        """The ``ForwardBatch`` over the buffers for ``desc`` (made at its first step). An
        extend-kind step (draft extend) has ``tokens_per_req`` new tokens in every request,
        padded ones included, so its ``extend_seq_lens`` are constant."""
        static: Optional[ForwardBatch] = self._batches.get(desc)
        if static is None:
            bs = desc.bucket
            extend = {}
            if fb.extend_seq_lens is not None:
                extend = dict(extend_seq_lens=self.extend_seq_lens[:bs],
                              extend_seq_lens_cpu=[tokens_per_req] * bs)
            static = ForwardBatch(
                forward_mode=fb.forward_mode, batch_size=bs,
                req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
                seq_lens_cpu=self.seq_lens_cpu[:bs],
                out_cache_loc=self.out_cache_loc[:bs * slots_per_req], positions=positions,
                spec_info=fb.spec_info, **extend)
            static.attn_backend, static.token_to_kv_pool = fb.attn_backend, fb.token_to_kv_pool
            static.req_to_token_pool = fb.req_to_token_pool
            self._batches[desc] = static
        return static


__all__ = ["TokenBuffers", "StepBuffers"]
