"""Graph hooks of ``XPUAttentionBackend``: metadata written into fixed buffers for captured steps.

A captured graph reads its metadata from the addresses it saw at capture, so every metadata
tensor of a graph-captured batch lives in a buffer allocated once. The graph runner owns those
buffers (``compile/graphs/step_buffers.py``); the backend only sizes and fills them:

1. ``graph_metadata_buffers(max_bs, max_num_tokens)`` allocates them (page tables as wide as
   ``context_len``, local-attention and SWA tables included; the constant ``cu_seqlens_q`` of
   in-graph decode steps, written here once).
2. ``fill_graph_metadata(fb, buffers, bound=None, in_graph=False)`` (host, before each captured
   or replayed step) returns the step's metadata over the buffers and makes it
   ``forward_metadata``, which the captured layers read; addresses never change. Two kinds:

   - in-graph (``in_graph`` and ``fills_in_graph(fb)``: a plain DECODE step, no spec input,
     no encoder, no hybrid SWA pool, no chunked-local layers; MLA included): nothing is built
     or copied on the host. The first step of a descriptor (``bound`` None) binds views of the
     buffers (``decode_graph_metadata``: leading rows, full width); the step's per-step values
     are computed by ``init_forward_metadata_in_graph(fb)``, which the runner calls inside the
     captured step before the layers (``write_decode_metadata``: ``cache_seqlens`` from
     ``seq_lens``, page-table rows gathered from ``req_to_token`` rows ``req_pool_indices``),
     so every replay reads the current step buffers.
   - host (every other step, and sglang's hooks): the batch's metadata is built once
     (``build_metadata``) and written into the buffers: bound to their leading slices when
     ``bound`` is None (a descriptor's first step), else copied into ``bound``'s tensors in
     place; ``init_forward_metadata_in_graph`` then records nothing.

It does not capture anything itself or own ``out_cache_loc``/``seq_lens``: the runner's step
buffers hold those. Supported: DECODE (plain, and draft steps with any topk: the cascade's
expand tables are sized for the bucket's maximum), TARGET_VERIFY (chain and tree, the merged
per-draft SWA tables included), draft extend (DRAFT_EXTEND_V2, or EXTEND with a draft input,
as many tokens per request in every request) and IDLE; other modes raise
``NotImplementedError``. Encoder-decoder models (``model_config.is_encoder_decoder``) capture
their DECODE steps too, with any encoder lengths: cross attention over the encoder columns,
the decoder's self attention through a token-slot table (sglang 0.5.23 runs them eagerly only).

sglang's own graph runners call ``init_cuda_graph_state(max_bs, max_num_tokens)`` and
``init_forward_metadata_out_graph(fb, in_capture)``: thin wrappers over the same two steps
whose buffers the backend holds, bound once per (mode, batch size) at capture, always of the
host kind (their reads of ``seq_lens`` and ``req_to_token`` end before the replay).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

import xpu_ops

from compile.backend.attention_metadata import (AttentionMetadata, PagedAttnMetadata,
                                               slots_to_pages, token_table)
from compile.backend.local_attention import local_chunks_per_request
from compile.backend.spec_metadata import padded_spec_info
from compile.batch import KVWriteLoc

_EXTERNAL = ("write.loc", "write.encoder_loc")  # the runner's step buffers hold these


def _set_path(obj: Any, path: str, value: Tensor) -> None:
    *parents, leaf = path.split(".")
    for name in parents:
        obj = getattr(obj, name)
    setattr(obj, leaf, value)


def metadata_buffers(backend, max_bs: int, max_num_tokens: int) -> dict[str, Tensor]:
    """Fixed buffers for the metadata of ``backend``'s batches up to ``max_bs`` requests and
    ``max_num_tokens`` query tokens, keyed by ``AttentionMetadata.tensors()`` names.

    Page tables are as wide as ``context_len`` (in pages); the SWA table and translated write
    slots exist only for hybrid SWA pools, the local-attention tables only with an
    ``attention_chunk_size``, the MLA workspace only for MLA, the encoder call only for
    encoder-decoder models (whose ``main`` table is then a token-slot table, ``context_len``
    wide: decoder tokens start at any column). The cascade's expand tables hold
    one row per query token (a tree's draft or branch), as wide as a request's tokens; the
    merged rows of trees one row per query token, as wide as ``context_len`` plus a request's
    tokens (sliding-window models) or as the chunk (chunked-local models).
    ``decode.cu_seqlens_q`` is ``arange(max_bs + 1)``, written here once and by nothing else:
    the ``cu_seqlens_q`` of in-graph decode steps (any bucket's leading slice).
    """
    dev, i32 = backend.device, dict(dtype=torch.int32, device=backend.device)
    max_pages = -(-backend.max_context_len // backend.page_size)
    q_per_req = max(1, backend.speculative_num_draft_tokens, -(-max_num_tokens // max_bs))
    # encoder-decoder: the decoder's self attention reads a token-slot table in graphs
    main_width = backend.max_context_len if backend.is_encoder_decoder else max_pages
    buf = {"main.cu_seqlens_q": torch.zeros(max_bs + 1, **i32),
           "main.cache_seqlens": torch.zeros(max_bs, **i32),
           "main.page_table": torch.zeros(max_bs, main_width, **i32),
           "decode.cu_seqlens_q": torch.arange(max_bs + 1, **i32)}
    if backend.is_encoder_decoder:   # cross attention (its cu_seqlens_q is main's)
        buf["encoder.cache_seqlens"] = torch.zeros(max_bs, **i32)
        buf["encoder.page_table"] = torch.zeros(max_bs, max_pages, **i32)
    buf.update(_slot_call_buffers("expand", max_num_tokens, q_per_req, dev))
    if backend.sliding_window_size is not None or backend.is_hybrid_swa:
        buf.update(_slot_call_buffers("swa_spec", max_num_tokens,
                                      backend.max_context_len + q_per_req, dev))
    if backend.attention_chunk_size:
        buf.update(_slot_call_buffers("local_spec", max_num_tokens,
                                      int(backend.attention_chunk_size), dev))
    if hasattr(backend.token_to_kv_pool, "translate_loc_from_full_to_swa"):
        buf["swa.page_table"] = torch.zeros(max_bs, max_pages, **i32)
        buf["write.swa_loc"] = torch.zeros(max_num_tokens, dtype=torch.int64, device=dev)
    if backend.attention_chunk_size:
        chunk = int(backend.attention_chunk_size)
        max_v = max_bs * local_chunks_per_request(q_per_req, chunk)
        buf["local.cu_seqlens_q"] = torch.zeros(max_v + 1, **i32)
        buf["local.cache_seqlens"] = torch.zeros(max_v, **i32)
        buf["local.page_table"] = torch.zeros(max_v, chunk // backend.page_size, **i32)
    if backend.use_mla:
        size = xpu_ops.flash_mla_get_workspace_size(backend.max_context_len, max_bs,
                                                    backend.num_heads or 128)
        buf["mla_workspace"] = torch.empty(size, dtype=torch.uint8, device=dev)
    return buf


def _slot_call_buffers(part: str, rows: int, width: int, device) -> dict[str, Tensor]:
    """Buffers of a one-query-per-row call over a token-slot table ``[rows, width]``."""
    i32 = dict(dtype=torch.int32, device=device)
    return {f"{part}.cu_seqlens_q": torch.zeros(rows + 1, **i32),
            f"{part}.cache_seqlens": torch.zeros(rows, **i32),
            f"{part}.page_table": torch.zeros(rows, width, **i32)}


def bind_metadata(meta, buffers: dict[str, Tensor]):
    """Move every tensor of ``meta`` (but the ``_EXTERNAL`` ones) into a leading slice of its
    buffer, in place, and return ``meta``.

    Raises:
        NotImplementedError: ``meta`` has a tensor without a buffer (a layer kind that cannot
            be kept in fixed buffers).
    """
    seen: dict[int, Tensor] = {}
    for name, t in list(meta.tensors()):
        if name in _EXTERNAL:
            continue
        if id(t) not in seen:
            if name not in buffers:
                raise NotImplementedError(f"XPUAttentionBackend: metadata {name} has no graph "
                                          f"buffer; this layer kind is not graph-capturable.")
            buf = buffers[name]
            bound = buf if name == "mla_workspace" else buf[:t.shape[0]]
            if name != "mla_workspace":
                bound[..., :t.shape[-1] if t.dim() > 1 else None].copy_(t)
            seen[id(t)] = bound
        _set_path(meta, name, seen[id(t)])
    return meta


def refill_metadata(bound, fresh) -> None:
    """Copy ``fresh`` values into ``bound``'s tensors (``bind_metadata``'s result for a batch of
    the same mode and size); columns past the new width keep stale entries, which are never read
    (they lie past ``cache_seqlens``).

    Raises:
        RuntimeError: a fresh tensor does not fit its bound slice.
    """
    fresh_tensors = dict(fresh.tensors())
    for name, b in bound.tensors():
        if name in _EXTERNAL or name == "mla_workspace":
            continue
        f = fresh_tensors[name]
        if f.shape[0] != b.shape[0] or (f.dim() > 1 and f.shape[1] > b.shape[1]):
            raise RuntimeError(f"XPUAttentionBackend: refilled metadata {name} has shape "
                               f"{tuple(f.shape)}; expected it to fit {tuple(b.shape)}.")
        if f.dim() > 1:
            b[..., :f.shape[-1]].copy_(f)
        else:
            b.copy_(f)


def decode_graph_metadata(backend, buffers: dict[str, Tensor], loc: Tensor, batch_size: int
                          ) -> AttentionMetadata:
    """The in-graph metadata of plain DECODE steps of ``batch_size`` requests: views of
    ``buffers`` (``cu_seqlens_q`` the constant ``decode.cu_seqlens_q``; ``cache_seqlens`` and
    the full-width ``page_table`` leading rows, written by ``write_decode_metadata``; the MLA
    workspace whole) and the step's write slots ``loc``. Nothing is copied."""
    b = batch_size
    main = PagedAttnMetadata(cu_seqlens_q=buffers["decode.cu_seqlens_q"][:b + 1],
                             cache_seqlens=buffers["main.cache_seqlens"][:b],
                             page_table=buffers["main.page_table"][:b], max_seqlen_q=1,
                             max_seqlen_k=backend.max_context_len, page_size=backend.page_size)
    meta = AttentionMetadata(main=main, write=KVWriteLoc(loc=loc), in_graph=True)
    if backend.use_mla:
        meta.mla_workspace = buffers["mla_workspace"]
    return meta


def write_decode_metadata(main: PagedAttnMetadata, seq_lens: Tensor, req_pool_indices: Tensor,
                          req_to_token: Tensor) -> None:
    """Write a plain DECODE step's per-step metadata into ``main``'s tensors, in place, as
    ``build_metadata`` computes it; device ops only, fixed shapes (what a graph records).

    Args:
        main: ``decode_graph_metadata``'s call: ``cache_seqlens [b]`` int32 and ``page_table
            [b, W]`` int32 (W pages, or token slots when ``page_size`` is 1).
        seq_lens: [b] tokens per request (the step's keys), any integer dtype.
        req_pool_indices: [b] int64 rows of ``req_to_token``.
        req_to_token: [rows, max_context_len] int32 token slots.
    Writes ``cache_seqlens = seq_lens`` and ``page_table[r, j] = req_to_token[req_pool_indices
    [r], j * page_size] // page_size`` for every column ``j`` that ``req_to_token`` covers
    (columns past ``cache_seqlens`` hold slots of unused positions, never read).
    """
    main.cache_seqlens.copy_(seq_lens)
    p, table = main.page_size, main.page_table
    width = req_to_token.shape[1]
    cols = min(table.shape[1], -(-width // p))
    first_slots = token_table(req_to_token, req_pool_indices, min(cols * p, width), step=p)
    slots_to_pages(first_slots, p, out=table[:, :cols])


class GraphMetadataMixin:
    """Graph hooks; mixed into ``XPUAttentionBackend`` (uses its ``build_metadata``).

    Attributes:
        cuda_graph_buffers: the backend-held buffers of sglang's runners
            (``init_cuda_graph_state``), None before.
        cuda_graph_metadata: ``(mode, speculative, batch size)`` -> the metadata bound to them
            (None before ``init_cuda_graph_state``).
    """

    cuda_graph_buffers: Optional[dict[str, Tensor]] = None
    cuda_graph_metadata: Optional[dict[tuple, Any]] = None

    def graph_metadata_buffers(self, max_bs: int, max_num_tokens: int) -> dict[str, Tensor]:
        """Fixed metadata buffers for batches up to ``max_bs`` requests and ``max_num_tokens``
        query tokens (``metadata_buffers``)."""
        return metadata_buffers(self, max_bs, max_num_tokens)

    def graph_mode_unsupported(self, fb) -> Optional[str]:
        """Why ``fb``'s mode cannot keep its metadata in fixed buffers, or None (DECODE, draft
        decode and TARGET_VERIFY with any topk, draft extend, IDLE)."""
        mode = fb.forward_mode
        if mode.is_decode() or mode.is_target_verify() or mode.is_idle() or fb.is_draft_extend():
            return None
        return (f"graph metadata for mode {mode.name} is not supported; graphs cover DECODE, "
                f"TARGET_VERIFY, draft extend (DRAFT_EXTEND_V2, EXTEND with a draft input) and "
                f"IDLE.")

    def shares_graph_buffers(self, other) -> bool:
        """Whether ``other``'s graph-captured steps may use this backend's metadata buffers:
        the same pool and page table and every fact ``metadata_buffers`` sizes them by (the
        step backends of one ``XPUMultiStepDraftBackend``)."""
        facts = ("device", "page_size", "max_context_len", "attention_chunk_size",
                 "sliding_window_size", "is_hybrid_swa", "use_mla", "num_heads",
                 "speculative_num_draft_tokens", "is_encoder_decoder")
        return other is self or (
            isinstance(other, GraphMetadataMixin)
            and other.token_to_kv_pool is self.token_to_kv_pool
            and other.req_to_token is self.req_to_token
            and all(getattr(other, f) == getattr(self, f) for f in facts))

    def graph_spec_info(self, spec_info, seq_lens: Tensor, batch_size: int):
        """``spec_info`` of a batch padded to ``batch_size`` requests (``padded_spec_info``:
        tree masks as ``[batch_size, D, D]``); ``seq_lens`` are the real requests'."""
        return padded_spec_info(spec_info, seq_lens, batch_size)

    def fills_in_graph(self, fb) -> bool:
        """Whether a captured step of ``fb`` may compute its metadata inside the graph
        (``write_decode_metadata``): a plain DECODE step (no spec input, no encoder) of a
        backend whose decode metadata is the main call alone (no hybrid SWA pool, no
        chunked-local layers, not encoder-decoder; an MLA workspace is a fixed buffer)."""
        return (fb.forward_mode.is_decode() and fb.spec_info is None
                and fb.encoder_lens is None and not self.is_encoder_decoder
                and not self.attention_chunk_size
                and not hasattr(self.token_to_kv_pool, "translate_loc_from_full_to_swa"))

    def fill_graph_metadata(self, forward_batch, buffers: dict[str, Tensor], bound=None, *,
                            in_graph: bool = False):
        """Host side of a captured step; returns its metadata over ``buffers`` (also
        ``forward_metadata``).

        ``in_graph`` and ``fills_in_graph(forward_batch)``: no host work but binding
        ``decode_graph_metadata`` at a descriptor's first step (``bound`` None; else ``bound``
        itself); the caller runs ``init_forward_metadata_in_graph`` inside the captured step.
        Otherwise: build the metadata once, bind it to ``buffers`` (``bound`` None) or refill
        ``bound`` in place.

        Raises:
            NotImplementedError: a mode or layer kind without fixed buffers.
            RuntimeError: more requests than the buffers hold, or ``bound`` of the other kind.
        """
        why = self.graph_mode_unsupported(forward_batch)
        if why is not None:
            raise NotImplementedError(f"XPUAttentionBackend: {why}")
        max_bs = buffers["main.cache_seqlens"].shape[0]
        if forward_batch.batch_size > max_bs:
            raise RuntimeError(f"XPUAttentionBackend: batch size {forward_batch.batch_size} "
                               f"exceeds the graph buffers; expected graph_metadata_buffers("
                               f"max_bs >= {forward_batch.batch_size}), got max_bs={max_bs}.")
        in_graph = in_graph and self.fills_in_graph(forward_batch)
        if bound is not None and bound.in_graph != in_graph:
            raise RuntimeError(f"XPUAttentionBackend.fill_graph_metadata: bound metadata has "
                               f"in_graph={bound.in_graph}; expected in_graph={in_graph}, the "
                               f"kind of this step. Bind one metadata per kind of step.")
        if in_graph:
            self.bidirectional_block_ids = None  # as build_metadata: image blocks are per step
            if bound is None:
                bound = decode_graph_metadata(self, buffers, forward_batch.out_cache_loc,
                                              forward_batch.batch_size)
        else:
            fresh = self.build_metadata(forward_batch, graph=True)
            if bound is None:
                bound = bind_metadata(fresh, buffers)
            else:
                refill_metadata(bound, fresh)
        self.forward_metadata = bound
        return bound

    # sglang 0.5.23's graph-runner hooks (its runners keep no step buffers of their own)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the backend-held graph buffers (``graph_metadata_buffers``)."""
        self.cuda_graph_buffers = self.graph_metadata_buffers(max_bs, max_num_tokens)
        self.cuda_graph_metadata = {}

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Fill the backend-held buffers for a captured (``in_capture``) or replayed step.

        Raises:
            RuntimeError: ``init_cuda_graph_state`` was not called, or a replay of a
                (mode, batch size) that was never captured.
        """
        if self.cuda_graph_buffers is None:
            raise RuntimeError("XPUAttentionBackend.init_forward_metadata_out_graph: no graph "
                               "buffers; expected init_cuda_graph_state(max_bs, max_num_tokens) "
                               "first, got none.")
        fb = forward_batch
        key = (fb.forward_mode, fb.spec_info is not None, fb.batch_size)
        if not in_capture and key not in self.cuda_graph_metadata:
            raise RuntimeError(f"XPUAttentionBackend.init_forward_metadata_out_graph: replay "
                               f"of {key} without a capture; expected in_capture=True first.")
        bound = None if in_capture else self.cuda_graph_metadata[key]
        self.cuda_graph_metadata[key] = self.fill_graph_metadata(fb, self.cuda_graph_buffers,
                                                                 bound)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Graph-recorded metadata work, called inside the captured step before the layers:
        for in-graph metadata (``forward_metadata.in_graph``), ``write_decode_metadata`` from
        ``forward_batch``'s ``seq_lens`` and ``req_pool_indices``; for host-filled metadata
        (every other step, and sglang's hooks) nothing."""
        meta = self.forward_metadata
        if meta is not None and meta.in_graph:
            write_decode_metadata(meta.main, forward_batch.seq_lens,
                                  forward_batch.req_pool_indices, self.req_to_token)


__all__ = ["GraphMetadataMixin", "metadata_buffers", "bind_metadata", "refill_metadata",
           "decode_graph_metadata", "write_decode_metadata"]
