"""Host metadata builders of ``XPUAttentionBackend``, one per forward mode (the plan step).

``build_metadata(fb)`` turns a ``ForwardBatch`` into ``AttentionMetadata`` once per step, on the
host, before any layer runs (eagerly, or into graph buffers through ``backend_graph``):

- DECODE: 1 query/request, ``cache_seqlens = seq_lens``. With ``spec_info`` (a draft step):
  topk 1 adds ``speculative_step_id + 1``; topk > 1 is a cascade (prefix pass, non-causal, plus
  each branch's own draft slots).
- EXTEND / MIXED / DRAFT_EXTEND_V2 (and EXTEND with a draft input): ``extend_seq_lens`` causal
  queries over ``seq_lens`` keys; decoder tokens after an encoder read from column
  ``encoder_lens[r]`` (a token-slot table when that is not a page boundary).
- TARGET_VERIFY: ``num_tokens_per_req`` queries; topk 1: causal over ``seq_lens + width``;
  topk > 1: cascade with the tree mask (sliding-window layers: one merged row per draft).
- IDLE: empty.

Then the per-layer-kind variants: the SWA-pool twin, chunked-local virtual batches, the
encoder call of cross attention and the MLA workspace.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import xpu_ops

from compile.backend import spec_metadata, spec_rows
from compile.backend.attention_metadata import (AttentionMetadata, PagedAttnMetadata, cu_seqlens,
                                                paged_metadata, slot_metadata, swa_metadata,
                                                uniform_cu_seqlens)
from compile.backend.local_attention import (local_chunks_per_request,
                                             make_local_attention_virtual_batches)
from compile.batch import ForwardBatch, KVWriteLoc


class MetadataBuilderMixin:
    """``build_metadata`` and its per-mode helpers; mixed into ``XPUAttentionBackend`` (reads
    its ``req_to_token``, ``page_size``, pools and speculative settings).

    Attributes:
        fixed_table_width: False (default): the page tables of plain DECODE/EXTEND batches are
            as wide as the batch's longest request needs (``ceil(max_seqlen_k / page_size)``
            columns), so their width grows step by step. True: they are zero-padded on the
            right to the width of the request pool, ``ceil(max_context_len / page_size)``
            columns (``max_context_len`` for token-slot tables), as the graph buffers are
            (``backend_graph.metadata_buffers``): a shape that never changes between steps,
            so a ``torch.compile``d forward does not recompile when a request crosses a page
            boundary. The padding lies past every ``cache_seqlens`` and is never read; the
            outputs are the same either way. ``compile.engine.Engine`` sets it from its
            forward's ``fixed_table_width`` (``CompiledModel``, ``PiecewiseModel``).
    """

    fixed_table_width: bool = False

    def _topk(self, fb: ForwardBatch) -> int:
        spec_topk = getattr(fb.spec_info, "topk", 0) if fb.spec_info is not None else 0
        return max(self.topk or spec_topk or 1, 1)

    def _num_steps(self, fb: ForwardBatch) -> int:
        return max(self.speculative_num_steps or getattr(fb.spec_info, "spec_steps", 0) or 1, 1)

    def build_metadata(self, fb: ForwardBatch, graph: bool = False) -> AttentionMetadata:
        """Metadata of ``fb`` (``graph=True`` pads local virtual batches to a fixed count)."""
        mode = fb.forward_mode
        self.bidirectional_block_ids = None        # the model sets it again for image steps
        if fb.encoder_lens is not None and not (
                mode.is_decode() or mode.is_extend(include_draft_extend_v2=True)):
            raise NotImplementedError(f"XPUAttentionBackend: encoder-decoder batches in mode "
                                      f"{mode.name} are not supported.")
        if graph and fb.encoder_lens is not None and not self.is_encoder_decoder:
            raise NotImplementedError(
                "XPUAttentionBackend: a captured encoder-decoder step needs the encoder graph "
                "buffers, which only a backend built for an encoder-decoder model holds; "
                "expected model_runner.model_config.is_encoder_decoder True, got False.")
        if graph and fb.encoder_lens is not None and (self.is_hybrid_swa
                                                      or self.attention_chunk_size):
            raise NotImplementedError(
                "XPUAttentionBackend: captured encoder-decoder steps with sliding-window pools "
                "or chunked-local layers are not supported; run them eagerly.")
        plain = False  # main's lengths are the batch's own (host copies in fb)
        if mode.is_idle():
            meta = self._idle_metadata()
        elif mode.is_target_verify():
            meta = self._verify_metadata(fb)
        elif mode.is_decode() and fb.spec_info is not None:
            meta = self._draft_decode_metadata(fb)
        else:
            meta, plain = self._decode_or_extend_metadata(fb, graph), True
        self._add_layer_variants(fb, meta, graph, plain)
        if plain and self.fixed_table_width and not graph:
            self._pad_tables(meta)
        return meta

    def _pad_tables(self, meta: AttentionMetadata) -> None:
        """Zero-pad the main, SWA and encoder page tables of ``meta`` on the right to the
        request pool's width (``fixed_table_width``); a wider table (more tokens than
        ``max_context_len``) is left as it is."""
        for part in ("main", "swa", "encoder"):
            call = getattr(meta, part)
            if call is None:
                continue
            width = -(-self.max_context_len // call.page_size)
            extra = width - call.page_table.shape[1]
            if extra > 0:
                setattr(meta, part, call.with_table(
                    torch.nn.functional.pad(call.page_table, (0, extra))))

    def _idle_metadata(self) -> AttentionMetadata:
        z = torch.zeros(0, dtype=torch.int32, device=self.device)
        main = PagedAttnMetadata(cu_seqlens_q=torch.zeros(1, dtype=torch.int32,
                                                          device=self.device),
                                 cache_seqlens=z, page_table=z.view(0, 0), max_seqlen_q=0,
                                 max_seqlen_k=0, page_size=self.page_size)
        return AttentionMetadata(main=main, write=KVWriteLoc(
            loc=torch.zeros(0, dtype=torch.int64, device=self.device)))

    def _decode_or_extend_metadata(self, fb: ForwardBatch, graph: bool = False
                                   ) -> AttentionMetadata:
        """DECODE (1 query/request) or EXTEND/MIXED/DRAFT_EXTEND_V2 (``extend_seq_lens``).
        Encoder-decoder batches read the decoder tokens through a token-slot table when an
        encoder length is not a page multiple, and always in graphs (``graph``: one table
        form for every step a graph replays, whatever its encoder lengths)."""
        b = fb.batch_size
        if fb.forward_mode.is_decode():
            cu_q, max_q = uniform_cu_seqlens(b, 1, self.device), 1
        else:
            cu_q = cu_seqlens(fb.extend_seq_lens.to(torch.int32))
            max_q = max(fb.extend_seq_lens_cpu) if b else 0
        max_k = int(fb.seq_lens_cpu.max()) if b else 0
        rows = fb.req_pool_indices
        if self._decoder_unaligned(fb) or (graph and fb.encoder_lens is not None):
            main = slot_metadata(self.req_to_token, rows, cu_q, fb.seq_lens, max_q, max_k,
                                 col_offset=fb.encoder_lens)
        else:
            main = paged_metadata(self.req_to_token, rows, cu_q, fb.seq_lens, max_q, max_k,
                                  self.page_size, col_offset=fb.encoder_lens)
        return AttentionMetadata(main=main, write=KVWriteLoc(loc=fb.out_cache_loc))

    def _decoder_unaligned(self, fb: ForwardBatch) -> bool:
        """Encoder-decoder batch whose decoder tokens (``req_to_token`` columns from
        ``encoder_lens[r]``) do not start on a page boundary: the decoder's self attention then
        reads a token-slot table (``slot_metadata``) instead of page ids."""
        return fb.encoder_lens is not None and any(n % self.page_size
                                                   for n in fb.encoder_lens_cpu)

    def _verify_metadata(self, fb: ForwardBatch) -> AttentionMetadata:
        """TARGET_VERIFY: chain (topk 1) or tree cascade (topk > 1).

        A chain is ``spec_info.num_tokens_per_req`` tokens wide per request (sglang 0.5.23:
        DSpark's draft block reuses TARGET_VERIFY with its own width), ``draft_token_num`` when
        the spec input sets none; a tree is ``draft_token_num`` wide (its mask's size).

        Raises:
            NotImplementedError: a tree whose ``num_tokens_per_req`` is not its width.
        """
        spec = fb.spec_info
        d = spec.draft_token_num or self.speculative_num_draft_tokens
        write = KVWriteLoc(loc=fb.out_cache_loc)
        if self._topk(fb) <= 1:
            width = spec.num_tokens_per_req if spec.num_tokens_per_req > 0 else d
            main = spec_metadata.verify_chain(fb, self.req_to_token, self.page_size, width)
            return AttentionMetadata(main=main, write=write)
        if 0 < spec.num_tokens_per_req != d:
            raise NotImplementedError(
                f"XPUAttentionBackend: a tree target verify (topk > 1) is draft_token_num = {d} "
                f"tokens wide per request; expected spec_info.num_tokens_per_req {d}, got "
                f"{spec.num_tokens_per_req}.")
        prefix, expand, mask = spec_metadata.verify_tree(fb, self.req_to_token, self.page_size, d)
        meta = AttentionMetadata(main=prefix, write=write, causal=False, cascade=True,
                                 expand=expand)
        if self.sliding_window_size is not None or self.is_hybrid_swa:
            meta.swa_spec = spec_rows.verify_tree_swa(fb, self.token_to_kv_pool,
                                                      self.req_to_token, mask, d)
        if self.attention_chunk_size:
            meta.local_spec = spec_rows.verify_tree_local(fb, self.req_to_token, mask, d,
                                                          int(self.attention_chunk_size))
        return meta

    def _draft_decode_metadata(self, fb: ForwardBatch) -> AttentionMetadata:
        """DECODE with ``spec_info``: draft step ``speculative_step_id``."""
        topk, steps, step = self._topk(fb), self._num_steps(fb), self.speculative_step_id
        rows = fb.batch_size * topk
        write = KVWriteLoc(loc=spec_metadata.draft_write_loc(fb.out_cache_loc, rows, steps, step))
        if topk <= 1:
            main = spec_metadata.draft_decode_chain(fb, self.req_to_token, self.page_size, step)
            return AttentionMetadata(main=main, write=write)
        prefix, expand = spec_metadata.draft_decode_tree(fb, self.req_to_token, self.page_size,
                                                         topk, step, steps)
        meta = AttentionMetadata(main=prefix, write=write, causal=False, cascade=True,
                                 expand=expand)
        if self.sliding_window_size is not None or self.is_hybrid_swa:
            meta.swa_spec = spec_rows.draft_decode_tree_swa(fb, self.token_to_kv_pool,
                                                            self.req_to_token, topk, step, steps)
        if self.attention_chunk_size:
            meta.local_spec = spec_rows.draft_decode_tree_local(
                fb, self.req_to_token, topk, step, steps, int(self.attention_chunk_size))
        return meta

    def _add_layer_variants(self, fb: ForwardBatch, meta: AttentionMetadata, graph: bool,
                            plain: bool = False) -> None:
        """SWA tables, local virtual batches, encoder metadata and the MLA workspace
        (``plain``: ``meta`` is ``_decode_or_extend_metadata``'s, its lengths are on the host)."""
        pool, main = self.token_to_kv_pool, meta.main
        offset = None if fb.encoder_lens is None else fb.encoder_lens
        if hasattr(pool, "translate_loc_from_full_to_swa"):
            meta.swa = swa_metadata(pool, self.req_to_token, fb.req_pool_indices, main, offset)
            meta.write.swa_loc = pool.translate_loc_from_full_to_swa(meta.write.loc)
        if self.attention_chunk_size and not meta.cascade and main.batch_size:
            meta.local = self._local_metadata(main, graph, fb if plain else None)
        if fb.encoder_lens is not None:
            meta.encoder = self._encoder_metadata(fb, main)
            meta.write.encoder_loc = fb.encoder_out_cache_loc
        if self.use_mla and not meta.cascade:
            meta.mla_workspace = self._mla_workspace(fb, main, graph)

    def _mla_workspace(self, fb: ForwardBatch, main: PagedAttnMetadata, graph: bool) -> Tensor:
        """Scratch of ``flash_mla_decode`` (plain DECODE) or ``flash_mla_prefill`` (every other
        absorbed call of ``main``)."""
        max_k = self.max_context_len if graph else main.max_seqlen_k
        heads = self.num_heads or 128
        if fb.forward_mode.is_decode() and fb.spec_info is None:
            size = xpu_ops.flash_mla_decode_get_workspace_size(
                max_k, main.batch_size, heads, num_kv_splits=self.num_kv_splits)
        else:
            size = xpu_ops.flash_mla_prefill_get_workspace_size(
                max_k, main.batch_size, heads, num_kv_splits=self.num_kv_splits)
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def _local_metadata(self, main: PagedAttnMetadata, graph: bool,
                        fb: Optional[ForwardBatch] = None) -> PagedAttnMetadata:
        """Chunked-local virtual batch of ``main``; its lengths come from ``fb``'s host copies
        when given (DECODE/EXTEND: ``main`` is built from them), else from the device (a sync)."""
        chunk = int(self.attention_chunk_size)
        pad_to = None
        if graph:
            pad_to = main.batch_size * local_chunks_per_request(main.max_seqlen_q, chunk)
        if fb is None:
            cu_q, k_lens = main.cu_seqlens_q.cpu(), main.cache_seqlens.cpu()
        elif fb.forward_mode.is_decode():
            cu_q, k_lens = uniform_cu_seqlens(fb.batch_size, 1, "cpu"), fb.seq_lens_cpu
        else:
            q_lens = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int32)
            cu_q, k_lens = cu_seqlens(q_lens), fb.seq_lens_cpu
        local = make_local_attention_virtual_batches(chunk, cu_q, k_lens, main.page_table,
                                                     self.page_size, pad_to=pad_to)
        max_q = main.max_seqlen_q if graph else local.max_seqlen_q
        return PagedAttnMetadata(cu_seqlens_q=local.cu_seqlens_q,
                                 cache_seqlens=local.cache_seqlens, page_table=local.page_table,
                                 max_seqlen_q=max_q, max_seqlen_k=chunk,
                                 page_size=self.page_size)

    def _encoder_metadata(self, fb: ForwardBatch, main: PagedAttnMetadata) -> PagedAttnMetadata:
        """Cross attention: ``main``'s queries over the encoder tokens (req_to_token columns
        ``0 .. encoder_lens[r] - 1``), non-causal."""
        max_enc = max(fb.encoder_lens_cpu) if fb.encoder_lens_cpu else 0
        return paged_metadata(self.req_to_token, fb.req_pool_indices, main.cu_seqlens_q,
                              fb.encoder_lens, main.max_seqlen_q, max_enc, self.page_size)


__all__ = ["MetadataBuilderMixin"]
