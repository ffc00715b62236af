"""Graph hooks of ``XPUAttentionBackend``: metadata written into fixed buffers for captured steps.

A captured graph reads its metadata from the addresses it saw at capture, so every metadata
tensor of a graph-captured batch lives in a buffer allocated once. The graph runner owns those
buffers (``compile/graphs/step_buffers.py``); the backend only sizes and fills them:

1. ``graph_metadata_buffers(max_bs, max_num_tokens)`` allocates them (page tables as wide as
   ``context_len``, local-attention and SWA tables included).
2. ``fill_graph_metadata(fb, buffers, bound=None)`` (host, before each captured or replayed
   step) builds the batch's metadata once and writes it into the buffers: bound to their
   leading slices when ``bound`` is None (a descriptor's first step), else copied into
   ``bound``'s tensors in place; addresses never change. It returns that metadata and makes it
   ``forward_metadata``, which the captured layers read.

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
whose buffers the backend holds, bound once per (mode, batch size) at capture.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

import xpu_ops

from compile.backend.local_attention import local_chunks_per_request
from compile.backend.spec_metadata import padded_spec_info

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
    """
    dev, i32 = backend.device, dict(dtype=torch.int32, device=backend.device)
    max_pages = -(-backend.max_context_len // backend.page_size)
    q_per_req = max(1, backend.speculative_num_draft_tokens, -(-max_num_tokens // max_bs))
    # encoder-decoder: the decoder's self attention reads a token-slot table in graphs
    main_width = backend.max_context_len if backend.is_encoder_decoder else max_pages
    buf = {"main.cu_seqlens_q": torch.zeros(max_bs + 1, **i32),
           "main.cache_seqlens": torch.zeros(max_bs, **i32),
           "main.page_table": torch.zeros(max_bs, main_width, **i32)}
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


def bind_metadata(meta, buffers: dict[str, Tensor], external: tuple[str, ...] = _EXTERNAL):
    """Move every tensor of ``meta`` (but the ``external`` ones) into a leading slice of its
    buffer, in place, and return ``meta``.

    Raises:
        NotImplementedError: ``meta`` has a tensor without a buffer (a layer kind that cannot
            be kept in fixed buffers).
    """
    seen: dict[int, Tensor] = {}
    for name, t in list(meta.tensors()):
        if name in external:
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


def refill_metadata(bound, fresh, external: tuple[str, ...] = _EXTERNAL) -> None:
    """Copy ``fresh`` values into ``bound``'s tensors (``bind_metadata``'s result for a batch of
    the same mode and size); columns past the new width keep stale entries, which are never read
    (they lie past ``cache_seqlens``).

    Raises:
        RuntimeError: a fresh tensor does not fit its bound slice.
    """
    fresh_tensors = dict(fresh.tensors())
    for name, b in bound.tensors():
        if name in external or name == "mla_workspace":
            continue
        f = fresh_tensors[name]
        if f.shape[0] != b.shape[0] or (f.dim() > 1 and f.shape[1] > b.shape[1]):
            raise RuntimeError(f"XPUAttentionBackend: refilled metadata {name} has shape "
                               f"{tuple(f.shape)}; expected it to fit {tuple(b.shape)}.")
        if f.dim() > 1:
            b[..., :f.shape[-1]].copy_(f)
        else:
            b.copy_(f)


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

    def fill_graph_metadata(self, forward_batch, buffers: dict[str, Tensor], bound=None):
        """Host side of a captured step: build the metadata once, bind it to ``buffers``
        (``bound`` None) or refill ``bound`` in place; returns it (also ``forward_metadata``).

        Raises:
            NotImplementedError: a mode or layer kind without fixed buffers.
            RuntimeError: more requests than the buffers hold.
        """
        why = self.graph_mode_unsupported(forward_batch)
        if why is not None:
            raise NotImplementedError(f"XPUAttentionBackend: {why}")
        max_bs = buffers["main.cache_seqlens"].shape[0]
        if forward_batch.batch_size > max_bs:
            raise RuntimeError(f"XPUAttentionBackend: batch size {forward_batch.batch_size} "
                               f"exceeds the graph buffers; expected graph_metadata_buffers("
                               f"max_bs >= {forward_batch.batch_size}), got max_bs={max_bs}.")
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
        """Graph-recorded metadata work: none (all of it is host-side, out of the graph)."""


__all__ = ["GraphMetadataMixin", "metadata_buffers", "bind_metadata", "refill_metadata"]
