"""Attention metadata: what ``XPUAttentionBackend.init_forward_metadata`` builds once per batch.

One ``PagedAttnMetadata`` describes one ``flash_attn_with_kvcache`` call (its packed queries,
key lengths and page table); ``AttentionMetadata`` groups the calls a batch may need per layer
kind: the main call, its sliding-window twin (same lengths, SWA-pool page table), the cascade
"expand" call of speculative trees, the merged per-draft SWA call, chunked-local virtual batches,
cross attention over the encoder, and the K/V write locations.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

import torch
from torch import Tensor

from compile.backend.local_attention import LocalAttentionMetadata
from compile.batch import KVWriteLoc


@dataclasses.dataclass
class PagedAttnMetadata:
    """Arguments of one paged attention call over ``b`` (possibly virtual) requests.

    Attributes:
        cu_seqlens_q: [b + 1] int32 prefix sums of query tokens.
        cache_seqlens: [b] int32 total keys per request, in tokens.
        page_table: [b, max_pages] int32 page ids (token slots when ``page_size == 1``).
        max_seqlen_q / max_seqlen_k: bounds of one request's queries / keys (int).
        page_size: tokens per page of the cache view this table indexes (1 for slot tables).
    """

    cu_seqlens_q: Tensor
    cache_seqlens: Tensor
    page_table: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    page_size: int

    @property
    def batch_size(self) -> int:
        """Number of (possibly virtual) requests ``b`` (``cache_seqlens.shape[0]``)."""
        return self.cache_seqlens.shape[0]

    def with_table(self, page_table: Tensor) -> "PagedAttnMetadata":
        """The same call over another page table (e.g. the SWA pool's)."""
        return dataclasses.replace(self, page_table=page_table)


@dataclasses.dataclass
class AttentionMetadata:
    """All metadata of one batch (host-built; only device tensors and ints inside).

    Attributes:
        main: the call for ordinary layers. Decode: 1 query per request, keys = seq_lens.
            Extend/mixed/draft extend: ``extend_seq_lens`` queries, keys = seq_lens, causal.
            Target verify: D queries, keys = seq_lens + D (topk 1, causal) or seq_lens (topk > 1,
            the cascade prefix pass, non-causal). Draft decode topk > 1: topk queries per request
            over the prefix (non-causal).
        swa: ``main`` with the page table translated into the SWA pool (hybrid SWA models).
        expand: cascade pass of speculative trees, one query per request-branch/draft over a
            token-slot table (``page_size 1``), non-causal, merged with ``main`` by LSE.
        swa_spec: a tree (topk > 1) on sliding-window layers: one row per draft (verify) or
            branch (draft decode), the prefix plus the drafts it sees, causal, slot table
            (``compile/backend/spec_rows.py``).
        local_spec: the same rows on chunked-local layers, cut to each query's chunk.
        local: chunked-local (iRoPE) virtual batch of ``main``.
        encoder: cross attention: ``main``'s queries over ``encoder_lens`` keys, non-causal.
        write: slots for the new K/V of this batch.
        causal: whether ``main`` is causal (False for the cascade prefix pass).
        cascade: True when ``expand`` must be merged into ``main``'s result.
        mla_workspace: uint8 scratch of ``flash_mla_decode`` (MLA decode only).
        in_graph: True when ``main``'s ``cache_seqlens`` and ``page_table`` are written by
            ``init_forward_metadata_in_graph`` inside the captured step, from the batch's
            ``seq_lens`` and ``req_pool_indices`` (a plain DECODE step of the graph runner:
            ``backend_graph.write_decode_metadata``); False when the host filled every value.
    """

    main: PagedAttnMetadata
    write: KVWriteLoc
    causal: bool = True
    cascade: bool = False
    swa: Optional[PagedAttnMetadata] = None
    expand: Optional[PagedAttnMetadata] = None
    swa_spec: Optional[PagedAttnMetadata] = None
    local_spec: Optional[PagedAttnMetadata] = None
    local: Optional[LocalAttentionMetadata] = None
    encoder: Optional[PagedAttnMetadata] = None
    mla_workspace: Optional[Tensor] = None
    in_graph: bool = False

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every tensor field as ``("part.field", tensor)`` (graph buffers bind these)."""
        yield from _tensor_fields("", self)


def _tensor_fields(prefix: str, obj) -> Iterator[tuple[str, Tensor]]:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, Tensor):
            yield prefix + f.name, value
        elif dataclasses.is_dataclass(value):
            yield from _tensor_fields(f"{prefix}{f.name}.", value)


def cu_seqlens(lens: Tensor) -> Tensor:
    """[b] lengths -> [b + 1] int32 prefix sums starting at 0 (same device)."""
    out = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    torch.cumsum(lens, 0, out=out[1:])
    return out


def uniform_cu_seqlens(b: int, n: int, device: torch.device) -> Tensor:
    """``cu_seqlens`` of ``b`` lengths that all equal ``n``: ``[0, n, 2n, ..., b * n]`` int32,
    one op (``cu_seqlens(torch.full((b,), n))`` takes three)."""
    if n == 0:
        return torch.zeros(b + 1, dtype=torch.int32, device=device)
    return torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=device)


def token_table(req_to_token: Tensor, req_pool_indices: Tensor, max_len: int,
                col_offset: Optional[Tensor] = None, step: int = 1) -> Tensor:
    """Token slots ``[b, ceil(max_len / step)]`` of each request (``req_to_token``'s dtype): the
    columns ``0, step, 2 * step, ... < max_len``, optionally from column ``col_offset[r]``.

    Columns past the table's width are read as 0 (the padding slot). The result is a new tensor.
    """
    width = req_to_token.shape[1]
    if col_offset is None and max_len <= width:
        # Whole rows: one row gather of a strided view, no [b, max_len] index tensor.
        return req_to_token[:, :max_len:step].index_select(0, req_pool_indices)
    rows = req_pool_indices.long()
    cols = torch.arange(0, max_len, step, device=req_to_token.device)[None, :]
    if col_offset is not None:
        cols = cols + col_offset.long()[:, None].to(req_to_token.device)
    table = req_to_token[rows[:, None], cols.clamp(max=width - 1)]
    return torch.where(cols < width, table, 0)


def _int32(t: Tensor) -> Tensor:
    """``t.to(torch.int32)`` without its call overhead when ``t`` already is int32."""
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def slots_to_pages(slots: Tensor, page_size: int, out: Optional[Tensor] = None) -> Tensor:
    """Page ids int32 of token slots: a new tensor, or written into ``out`` (int32, ``slots``'
    shape) when given, which is then returned (what a captured step records: no allocation)."""
    if out is None:
        if (page_size & (page_size - 1)) == 0:  # a power of two: a shift, cheaper than a division
            return _int32(slots >> (page_size.bit_length() - 1))
        return _int32(slots // page_size)
    if page_size == 1:
        return out.copy_(slots)
    if (page_size & (page_size - 1)) == 0:
        return torch.bitwise_right_shift(slots, page_size.bit_length() - 1, out=out)
    return torch.floor_divide(slots, page_size, out=out)


def page_table_from_tokens(tokens: Tensor, page_size: int) -> Tensor:
    """Token-granular ``[b, L]`` slots -> page ids ``[b, ceil(L / page_size)]`` int32."""
    return slots_to_pages(tokens[:, ::page_size], page_size)


def paged_metadata(req_to_token: Tensor, req_pool_indices: Tensor, cu_seqlens_q: Tensor,
                   cache_seqlens: Tensor, max_seqlen_q: int, max_seqlen_k: int, page_size: int,
                   col_offset: Optional[Tensor] = None) -> PagedAttnMetadata:
    """A call's metadata with ``page_table = req_to_token[rows, :max_k][:, ::page_size] //
    page_size`` (DESIGN.md; only the first slot of each page is gathered)."""
    first_slots = token_table(req_to_token, req_pool_indices, max_seqlen_k, col_offset,
                              step=page_size)
    return PagedAttnMetadata(cu_seqlens_q=cu_seqlens_q,
                             cache_seqlens=_int32(cache_seqlens),
                             page_table=slots_to_pages(first_slots, page_size),
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                             page_size=page_size)


def slot_metadata(req_to_token: Tensor, req_pool_indices: Tensor, cu_seqlens_q: Tensor,
                  cache_seqlens: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                  col_offset: Tensor) -> PagedAttnMetadata:
    """A call over a token-slot table (``page_size`` 1): request ``r``'s keys are the slots in
    ``req_to_token`` columns ``col_offset[r] ...``, wherever they fall in their pages (decoder
    tokens after an encoder whose length is not a page multiple)."""
    slots = token_table(req_to_token, req_pool_indices, max_seqlen_k, col_offset)
    return PagedAttnMetadata(cu_seqlens_q=cu_seqlens_q, cache_seqlens=_int32(cache_seqlens),
                             page_table=_int32(slots), max_seqlen_q=max_seqlen_q,
                             max_seqlen_k=max_seqlen_k, page_size=1)


def query_block_ids(block_ids: Tensor, main: PagedAttnMetadata, total_q: int) -> Tensor:
    """Per-query ``bidirectional_block_ids [total_q]`` int32 of ids given over whole sequences.

    Args:
        block_ids: [sum(cache_seqlens)] ids over each request's cached prefix then its new
            tokens, requests packed (sglang 0.5.23's Gemma-3 layout; -1: no block).
        main: the extend call (``cu_seqlens_q`` new tokens over ``cache_seqlens`` keys).
        total_q: new tokens in the batch (``q.shape[0]``; no host sync).
    Returns:
        The ids of the new tokens only, in query order (the op's layout: a cached key never
        needs an id, it precedes every query of its request).
    """
    cu_q, k_lens = main.cu_seqlens_q, main.cache_seqlens.long()
    q_lens = (cu_q[1:] - cu_q[:-1]).long()
    first_new = torch.cumsum(k_lens, 0) - q_lens          # whole-sequence row of each first query
    shift = torch.repeat_interleave(first_new - cu_q[:-1], q_lens, output_size=total_q)
    return block_ids[torch.arange(total_q, device=block_ids.device) + shift].to(torch.int32)


def swa_metadata(pool, req_to_token: Tensor, req_pool_indices: Tensor,
                 main: PagedAttnMetadata, col_offset: Optional[Tensor] = None
                 ) -> PagedAttnMetadata:
    """``main`` over the SWA pool: token slots translated full -> SWA, then paged (the
    translation is per slot, so only the first slot of each page is gathered and translated)."""
    first_slots = token_table(req_to_token, req_pool_indices, main.max_seqlen_k, col_offset,
                              step=main.page_size)
    swa_slots = pool.translate_loc_from_full_to_swa(first_slots)
    return main.with_table(slots_to_pages(swa_slots, main.page_size))


__all__ = ["PagedAttnMetadata", "AttentionMetadata", "cu_seqlens", "uniform_cu_seqlens",
           "token_table", "page_table_from_tokens", "paged_metadata", "slot_metadata",
           "query_block_ids", "swa_metadata", "slots_to_pages"]
