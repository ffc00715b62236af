"""Chunked local attention (Llama 4 iRoPE layers) as a batch of "virtual" requests.

A chunked-local layer lets the token at position ``p`` see keys ``c*C .. p`` where
``c = p // C`` and ``C`` is ``attention_chunk_size``. Splitting every request at chunk
boundaries turns that into ordinary causal attention: each (request, chunk touched by its new
tokens) pair becomes a virtual request whose keys start at the chunk's first token and whose
queries are the request's new tokens inside the chunk. The last query of a virtual request is its
last key, so FlashAttention's bottom-right causal alignment holds unchanged.

The virtual page table is a window of the request's page-granular table starting at page
``c*C / page_size``, so ``C`` must be a multiple of ``page_size``. Built on the host from the
``*_cpu`` lengths, once per batch.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor


@dataclasses.dataclass
class LocalAttentionMetadata:
    """Virtual batch for chunked local attention (``v`` virtual requests).

    Attributes:
        cu_seqlens_q: [v + 1] int32 prefix sums of queries per virtual request (same packed
            query order as the real batch).
        cache_seqlens: [v] int32 keys per virtual request (tokens from the chunk start).
        page_table: [v, C // page_size] int32 page ids, the request's pages from its chunk on.
        max_seqlen_q: most queries in one virtual request (int).
        max_seqlen_k: most keys in one virtual request (int, <= C).
    """

    cu_seqlens_q: Tensor
    cache_seqlens: Tensor
    page_table: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def _virtual_counts(q_lens: Tensor, k_lens: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """First chunk index touched by each request's queries and the number of chunks touched."""
    q_start = k_lens - q_lens
    first = q_start // chunk
    last = (k_lens - 1).clamp(min=0) // chunk
    counts = torch.where(q_lens > 0, last - first + 1, 0)
    return first, counts


def make_local_attention_virtual_batches(attn_chunk_size: int, cu_seqlens_q_cpu: Tensor,
                                         seq_lens_k_cpu: Tensor, page_table: Tensor,
                                         page_size: int, pad_to: Optional[int] = None
                                         ) -> LocalAttentionMetadata:
    """Split a batch into chunk-local virtual requests.

    Args:
        attn_chunk_size: C, tokens per local-attention chunk (multiple of ``page_size``).
        cu_seqlens_q_cpu: [b + 1] int prefix sums of new tokens per request (host).
        seq_lens_k_cpu: [b] int total keys per request, new tokens included (host).
        page_table: [b, max_pages] int32 page ids on the device.
        page_size: tokens per page.
        pad_to: pad with empty virtual requests (0 queries, 0 keys) up to this count, so
            graph buffers keep a fixed size.
    Returns:
        LocalAttentionMetadata on ``page_table``'s device.
    Raises:
        NotImplementedError: C is not a multiple of page_size.
        ValueError: more virtual requests than ``pad_to``.
    """
    chunk = int(attn_chunk_size)
    if chunk <= 0 or chunk % page_size:
        raise NotImplementedError(
            f"make_local_attention_virtual_batches: attention_chunk_size {chunk} with page_size "
            f"{page_size} is not supported; expected a positive multiple of page_size.")
    cu_q = cu_seqlens_q_cpu.long().cpu()
    q_lens, k_lens = cu_q[1:] - cu_q[:-1], seq_lens_k_cpu.long().cpu()
    first, counts = _virtual_counts(q_lens, k_lens, chunk)
    req = torch.repeat_interleave(torch.arange(q_lens.shape[0]), counts)
    offsets = torch.cumsum(counts, 0) - counts
    chunk_idx = first[req] + torch.arange(req.shape[0]) - offsets[req]
    start = chunk_idx * chunk
    end = torch.minimum(start + chunk, k_lens[req])
    vq_len = end - torch.maximum(k_lens[req] - q_lens[req], start)
    vk_len = end - start
    pages_per_chunk = chunk // page_size
    cols = (start // page_size)[:, None] + torch.arange(pages_per_chunk)
    cols = cols.clamp(max=max(page_table.shape[1] - 1, 0))
    dev = page_table.device
    if page_table.shape[1] == 0:
        table = torch.zeros((req.shape[0], pages_per_chunk), dtype=torch.int32, device=dev)
    else:
        table = page_table[req.to(dev)[:, None], cols.to(dev)]
    return _pack(table, vq_len, vk_len, pad_to)


def _pack(table: Tensor, vq_len: Tensor, vk_len: Tensor, pad_to: Optional[int]
          ) -> LocalAttentionMetadata:
    """Pad to ``pad_to`` empty virtual requests and move the lengths to the table's device."""
    num_virtual, dev = table.shape[0], table.device
    pad = 0 if pad_to is None else pad_to - num_virtual
    if pad < 0:
        raise ValueError(f"make_local_attention_virtual_batches: pad_to is too small; expected "
                         f">= {num_virtual} virtual requests, got {pad_to}.")
    table = torch.cat([table, table.new_zeros((pad, table.shape[1]))])
    vq_len = torch.cat([vq_len, vq_len.new_zeros(pad)])
    vk_len = torch.cat([vk_len, vk_len.new_zeros(pad)])
    cu = torch.zeros(num_virtual + pad + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(vq_len, 0)
    return LocalAttentionMetadata(
        cu_seqlens_q=cu.to(dev), cache_seqlens=vk_len.to(torch.int32).to(dev),
        page_table=table.to(torch.int32),
        max_seqlen_q=int(vq_len.max()) if vq_len.numel() else 0,
        max_seqlen_k=int(vk_len.max()) if vk_len.numel() else 0)


def local_chunks_per_request(num_queries: int, attn_chunk_size: int) -> int:
    """Most chunks that ``num_queries`` consecutive tokens can touch (graph buffer sizing)."""
    return 1 + (max(num_queries, 1) - 1 + attn_chunk_size - 1) // attn_chunk_size


__all__ = ["LocalAttentionMetadata", "make_local_attention_virtual_batches",
           "local_chunks_per_request"]
