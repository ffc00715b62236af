"""Speculative trees as one merged row per query, for the layers a cascade cannot serve.

The cascade (``compile/backend/spec_metadata.py``) splits a tree query's keys by where they
live (the request's prefix, the round's draft slots), not by position, so a layer whose visible
keys depend on the query's position cannot use it: sliding-window layers (keys from ``p - W``)
and chunked-local layers (keys in ``p``'s chunk). For those layers every query of a tree gets a
row of its own: the request's prefix slots, then the slots of the drafts it sees in tree order
(ancestors first, itself last). The query is the row's last key, at position ``len - 1``, so an
ordinary causal call over the token-slot table (page_size 1 view of the cache) applies the
window; for a chunk the row is cut to the query's chunk first (``chunk_call``).

- target verify: one row per draft (``prepare_swa_spec_page_table`` with the tree mask);
- draft decode: one row per branch, its own ``step_id + 1`` drafts (``out_cache_loc`` laid
  out ``(b, topk, num_steps)``).

Rows of sliding-window layers on a hybrid pool are in SWA-pool slots (``pool`` given).
Source: sglang's FlashAttention backend, SWA target verify with topk > 1 (per-draft tables).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import xpu_ops

from compile.backend.attention_metadata import PagedAttnMetadata, token_table, uniform_cu_seqlens


def _slots(pool, *slots: Tensor) -> list[Tensor]:
    """Token slots int32 (new tensors), translated into the SWA pool when ``pool`` has one."""
    if pool is not None and hasattr(pool, "translate_loc_from_full_to_swa"):
        slots = tuple(pool.translate_loc_from_full_to_swa(s) for s in slots)
    return [s.to(torch.int32) for s in slots]


def _max_k(fb) -> int:
    return int(fb.seq_lens_cpu.max()) if fb.batch_size else 0


def verify_rows(fb, req_to_token: Tensor, mask: Tensor, num_draft: int, pool=None
                ) -> tuple[Tensor, Tensor]:
    """Target verify: ``(table [b * D, P + D] int32 slots, lens [b * D] int32)``, row
    ``r * D + i`` the prefix of request ``r`` then the drafts draft ``i`` sees (``mask``
    ``[b, D, D]``)."""
    b = fb.batch_size
    prefix, drafts = _slots(pool, token_table(req_to_token, fb.req_pool_indices, _max_k(fb)),
                            fb.out_cache_loc.view(b, num_draft))
    return xpu_ops.prepare_swa_spec_page_table(prefix, fb.seq_lens.to(torch.int32), drafts,
                                               mask)


def branch_rows(fb, req_to_token: Tensor, topk: int, step_id: int, num_steps: int, pool=None
                ) -> tuple[Tensor, Tensor]:
    """Draft decode: ``(table [b * topk, P + step_id + 1] int32 slots, lens [b * topk])``, row
    ``r * topk + j`` the prefix of request ``r`` then branch ``j``'s drafts ``0 .. step_id``.

    Each branch is a one-chain tree of ``prepare_swa_spec_page_table``; its last draft's row
    is kept.
    """
    b, n = fb.batch_size, step_id + 1
    rows = torch.arange(b, device=fb.seq_lens.device).repeat_interleave(topk)
    prefix, drafts = _slots(pool, token_table(req_to_token, fb.req_pool_indices, _max_k(fb)),
                            fb.out_cache_loc.view(b * topk, num_steps)[:, :n])
    chain = torch.ones(n, n, dtype=torch.bool, device=rows.device).tril()
    table, lens = xpu_ops.prepare_swa_spec_page_table(
        prefix[rows], fb.seq_lens.to(torch.int32)[rows], drafts, chain.expand(b * topk, n, n))
    last = torch.arange(b * topk, device=rows.device) * n + n - 1
    return table[last], lens[last]


def rows_call(table: Tensor, lens: Tensor, chunk: Optional[int] = None) -> PagedAttnMetadata:
    """One causal query per row over its slots; with ``chunk``, only the slots of the query's
    chunk (positions ``(len - 1) // chunk * chunk .. len - 1``), the table ``chunk`` wide."""
    n = table.shape[0]
    if chunk is not None:
        start = (lens.long() - 1).clamp(min=0) // chunk * chunk
        cols = (start[:, None] + torch.arange(chunk, device=table.device)).clamp(
            max=max(table.shape[1] - 1, 0))
        table, lens = table.gather(1, cols), (lens - start).to(torch.int32)
    return PagedAttnMetadata(cu_seqlens_q=uniform_cu_seqlens(n, 1, table.device),
                             cache_seqlens=lens, page_table=table, max_seqlen_q=1,
                             max_seqlen_k=table.shape[1], page_size=1)


def verify_tree_swa(fb, pool, req_to_token: Tensor, mask: Tensor, num_draft: int
                    ) -> PagedAttnMetadata:
    """Target verify topk > 1 on sliding-window layers (``pool``: translate to SWA slots)."""
    return rows_call(*verify_rows(fb, req_to_token, mask, num_draft, pool))


def draft_decode_tree_swa(fb, pool, req_to_token: Tensor, topk: int, step_id: int,
                          num_steps: int) -> PagedAttnMetadata:
    """Draft decode topk > 1 on sliding-window layers (``pool``: translate to SWA slots)."""
    return rows_call(*branch_rows(fb, req_to_token, topk, step_id, num_steps, pool))


def verify_tree_local(fb, req_to_token: Tensor, mask: Tensor, num_draft: int, chunk: int
                      ) -> PagedAttnMetadata:
    """Target verify topk > 1 on chunked-local layers (chunk ``chunk`` tokens)."""
    return rows_call(*verify_rows(fb, req_to_token, mask, num_draft), chunk=chunk)


def draft_decode_tree_local(fb, req_to_token: Tensor, topk: int, step_id: int,
                            num_steps: int, chunk: int) -> PagedAttnMetadata:
    """Draft decode topk > 1 on chunked-local layers (chunk ``chunk`` tokens)."""
    return rows_call(*branch_rows(fb, req_to_token, topk, step_id, num_steps), chunk=chunk)


__all__ = ["verify_rows", "branch_rows", "rows_call", "verify_tree_swa", "draft_decode_tree_swa",
           "verify_tree_local", "draft_decode_tree_local"]
