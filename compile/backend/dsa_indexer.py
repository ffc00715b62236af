"""The DSA indexer's attention-side half: store index keys, score the cached keys, pick the
top-k slots (sglang's ``nsa_indexer`` role, after the model's projections).

Given one layer's ``index_q [T, Hi, Di]``, ``index_k [T, Di]`` and ``index_weights [T, Hi]``
(``compile.models.deepseek_v32.Indexer``) and, per query row, its request's page table and its
causal key count (``DSARows``):

1. ``index_k`` is quantised into the index-key cache at the step's write slots
   (``store_index_k_cache``: fp8 plus a per-token scale).
2. ``index_q`` is quantised per (token, head): ``scale = max(amax, 1e-4) / 448``, fp8 values
   ``q / scale``; the scale moves into the head weights (``weights * scale``), so
   ``fp8_paged_mqa_logits`` scores ``sum_h w_h * relu(q_h . k_j)`` over each row's keys
   (``-inf`` past its causal length).
3. ``fast_topk_v2`` keeps each row's ``topk`` best positions (ties to the lower position,
   ``-1`` padding when the row has fewer keys) and the page table turns positions into cache
   slots (``slot = page * page_size + position % page_size``; ``-1`` stays ``-1``).

Device ops only, fixed shapes for a fixed batch: no host sync, capturable.
Source: DeepSeek-V3.2-Exp (``inference/model.py``: ``act_quant``, ``fp8_index``), sglang
``nsa_indexer.py``; DeepGEMM's ``fp8_paged_mqa_logits`` contract.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

import xpu_ops
from xpu_ops.index_k_layout import AMAX_FLOOR, FP8_MAX


@dataclasses.dataclass
class DSARows:
    """Per query row (one new token): its request's page table and its causal key count.

    Attributes:
        page_table: [rows, W] int32 page ids of the row's request (token slots at page size 1).
        cache_seqlens: [rows] int32 keys the row sees (its position + 1).
    """

    page_table: Tensor
    cache_seqlens: Tensor


def rows_of(main, rows: int) -> DSARows:
    """``DSARows`` of a packed call ``main`` (``PagedAttnMetadata``: ``cu_seqlens_q``,
    ``cache_seqlens`` = total keys, bottom-right causal) with ``rows`` query tokens in all."""
    cu = main.cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]                                                   # [b]
    req = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=cu.device), q_lens,
                                  output_size=rows)                             # [rows]
    offset = torch.arange(rows, device=cu.device) - cu[req]
    keys = main.cache_seqlens.long()[req] - q_lens[req] + offset + 1
    return DSARows(page_table=main.page_table[req], cache_seqlens=keys.to(torch.int32))


def quantize_queries(index_q: Tensor, index_weights: Tensor) -> tuple[Tensor, Tensor]:
    """``(q fp8 [T, Hi, Di], weights * scale [T, Hi] float32)``, per (token, head) scales."""
    q = index_q.float()
    scale = q.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / FP8_MAX                # [T, Hi]
    q8 = (q * (1.0 / scale).unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q8, index_weights.float() * scale


def positions_to_slots(pos: Tensor, page_table: Tensor, page_size: int) -> Tensor:
    """``pos [rows, k]`` int32 key positions (-1: none) -> int32 cache slots through each
    row's ``page_table [rows, W]``; -1 stays -1."""
    valid = pos >= 0
    p = pos.clamp_min(0).long()
    pages = page_table.gather(1, torch.div(p, page_size, rounding_mode="floor"))
    slots = pages.long() * page_size + p % page_size
    return torch.where(valid, slots, -1).to(torch.int32)


def topk_slots(index_cache: Tensor, rows: DSARows, index_q: Tensor, index_weights: Tensor,
               topk: int, page_size: int) -> Tensor:
    """Steps 2-3 of the module docstring: ``[T, topk]`` int32 cache slots per query row.

    Args:
        index_cache: uint8 [num_pages, page_size, 1, Di + 4], the layer's index keys.
        rows: ``DSARows`` of the T query rows. index_q: [T, Hi, Di]. index_weights: [T, Hi].
        topk: keys kept per row. page_size: tokens per page of ``rows.page_table``.
    """
    q8, weights = quantize_queries(index_q, index_weights)
    width = rows.page_table.shape[1] * page_size
    logits = xpu_ops.fp8_paged_mqa_logits(q8.unsqueeze(1), index_cache, weights,
                                          rows.cache_seqlens, rows.page_table, None, width)
    pos = xpu_ops.fast_topk_v2(logits, rows.cache_seqlens, topk)                # [T, topk]
    return positions_to_slots(pos, rows.page_table, page_size)


__all__ = ["DSARows", "rows_of", "quantize_queries", "positions_to_slots", "topk_slots"]
