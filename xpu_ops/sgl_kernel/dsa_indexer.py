"""The ``sgl_kernel`` provider of the DSA indexer ops: sgl-kernel-xpu's native
``fp8_paged_mqa_logits`` and ``fast_topk`` (``src/torch_extension_sycl.cc``).

Native contract (read from sgl-kernel-xpu's source, not run here): ``fp8_paged_mqa_logits``
takes uint8 queries ``[b, 1, H, D]`` (``next_n = 1`` only), no schedule metadata, reads every
position below ``seq_lens`` through the block table from a *per-token* cache (each token's D
fp8 bytes, then its float32 scale: ``src/sycl/kernels/nsa/fp8_mqa_logits_kernel.hpp``, not
DeepGEMM's block layout that xpu-ops' ops take), and leaves 0 (not ``-inf``) past it;
``fast_topk`` writes the top ``indices.shape[1]`` (2048) positions of each row in no specified
order, ties at the k-th score broken by the kernel. The glue maps xpu-ops' contract onto it:

* logits: ``context_lens`` clamped to the table's capacity and ``max_context_len`` (the native
  kernel would read past the block table), block ids outside ``[0, num_blocks)`` replaced by 0;
  with blocks of more than one token the pages the table names are copied into per-token rows
  (``index_k_layout.blocks_to_tokens``) and the table renumbered; then every position at or
  past its row's length, or of a hidden block, set to ``-inf``;
* top-k: the native positions sorted ascending (``-1`` last), so a row equals the reference's
  whenever its k-th score is not tied with an unselected one (with such a tie the native
  kernel may keep another of the tied positions); the transform looks the positions up in the
  page table with plain tensor ops (the native fused transform returns slots in kernel order).

Nothing here has run on an Intel GPU: the mapping is tested against the test-only stand-in of
the native library (``tests/ops/native_sgl_kernel.py``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import provider_table
from ..index_k_layout import blocks_to_tokens, positions_to_slots
from . import native

NATIVE_TOPK = 2048


def _available(op: str):
    def available(device_type: str) -> Optional[str]:
        return native.unavailable(op, device_type)
    return available


def _supports_paged(q, kv_cache, weights, context_lens, block_table, max_context_len,
                    clean_logits) -> Optional[str]:
    if q.shape[1] != 1:
        return f"next_n = {q.shape[1]} (the native kernel serves next_n = 1)"
    return None


@provider_table.register("fp8_paged_mqa_logits", "sgl_kernel",
                         available=_available("fp8_paged_mqa_logits"), supports=_supports_paged)
def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len,
                         clean_logits):
    """sgl_kernel ``fp8_paged_mqa_logits`` (contract: ``xpu_ops/ops/dsa_indexer.py``)."""
    num_blocks, block_size = kv_cache.shape[:2]
    capacity = min(block_table.shape[1] * block_size, max_context_len)
    lens = context_lens.reshape(-1).clamp(0, capacity)                             # [b]
    table = torch.where((block_table >= 0) & (block_table < num_blocks), block_table, 0)
    tokens = kv_cache
    if block_size > 1:       # the native kernel reads per-token rows: convert the read pages
        tokens = blocks_to_tokens(kv_cache.index_select(0, table.reshape(-1).long()))
        table = torch.arange(tokens.shape[0], dtype=torch.int32,
                             device=table.device).view(table.shape)
    logits = native.packet("fp8_paged_mqa_logits").default(
        q.contiguous().view(torch.uint8), tokens.contiguous(), weights.contiguous(),
        lens.to(torch.int32).contiguous(), table.contiguous(), None, max_context_len,
        clean_logits)
    pos = torch.arange(max_context_len, device=q.device)
    col = (pos // block_size).clamp(max=max(block_table.shape[1] - 1, 0))
    blk = block_table[:, col] if block_table.shape[1] else block_table.new_full(
        (q.shape[0], max_context_len), -1)
    keep = (pos[None, :] < lens[:, None]) & (blk >= 0) & (blk < num_blocks)
    return torch.where(keep, logits, -math.inf)


def _supports_topk(score, lengths, *args) -> Optional[str]:
    topk = args[-1]
    if topk != NATIVE_TOPK:
        return f"topk = {topk} (the native kernel selects {NATIVE_TOPK})"
    return None


def _native_positions(score, lengths, row_starts, topk):
    """Native ``fast_topk``, its positions sorted ascending with ``-1`` last (int64)."""
    indices = torch.empty((score.shape[0], topk), dtype=torch.int32, device=score.device)
    native.packet("fast_topk").default(score.contiguous(), indices, lengths.contiguous(),
                                       None if row_starts is None else row_starts.contiguous())
    chosen = indices.long()
    chosen = torch.where(chosen >= 0, chosen, score.shape[1] + 1)
    chosen = torch.sort(chosen, dim=1).values
    return torch.where(chosen <= score.shape[1], chosen, -1)


@provider_table.register("fast_topk", "sgl_kernel", available=_available("fast_topk"),
                         supports=_supports_topk)
def fast_topk(score, lengths, row_starts, topk):
    """sgl_kernel ``fast_topk`` (contract: ``xpu_ops/ops/dsa_topk.py``)."""
    return _native_positions(score, lengths, row_starts, topk).to(torch.int32)


@provider_table.register("fast_topk_transform", "sgl_kernel", available=_available("fast_topk"),
                         supports=_supports_topk)
def fast_topk_transform(score, lengths, page_table, cu_seqlens_q, row_starts, topk):
    """sgl_kernel ``fast_topk_transform`` (contract: ``xpu_ops/ops/dsa_topk.py``): native
    ``fast_topk``, then the page-table lookup of the row's request."""
    return positions_to_slots(_native_positions(score, lengths, row_starts, topk), page_table,
                              cu_seqlens_q)
