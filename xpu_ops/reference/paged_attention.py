"""Reference ``flash_attn_with_kvcache``: gather pages into padded blocks, then masked softmax."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import providers
from .attention import attend_packed, dequantize, gather_padded


def gather_pages(cache: Tensor, page_table: Tensor, cache_seqlens: Tensor,
                 k_start: Optional[Tensor] = None) -> Tensor:
    """Logical key sequence of each request as float32 ``[b, max_pages * page_size, H, D]``.

    Args:
        cache: [num_pages, page_size, H, D] (any trailing dims after page_size).
        page_table: [b, max_pages] int32; cache_seqlens: [b] int32 tokens per request.
    Page-table entries past a request's last page may hold any value: they are replaced by page 0
    before indexing, and every slot at or past ``cache_seqlens`` (or before ``k_start [b]``,
    ``cache_leftpad``) is zeroed (it may hold NaN).
    """
    num_pages, page_size = cache.shape[:2]
    b, max_pages = page_table.shape
    pages_used = (cache_seqlens.long() + page_size - 1) // page_size
    page_ok = torch.arange(max_pages, device=cache.device)[None, :] < pages_used[:, None]
    pages = torch.where(page_ok, page_table.long(), 0).clamp(0, max(num_pages - 1, 0))
    slots = pages[:, :, None] * page_size + torch.arange(page_size, device=cache.device)
    slots = slots.reshape(b, max_pages * page_size)
    positions = torch.arange(max_pages * page_size, device=cache.device)
    valid = positions[None, :] < cache_seqlens[:, None]
    if k_start is not None:
        valid = valid & (positions[None, :] >= k_start[:, None])
    return gather_padded(cache.reshape(num_pages * page_size, *cache.shape[2:]), slots, valid)


@providers.register("flash_attn_with_kvcache", "reference")
def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out,
                            qv, q_descale, k_descale, v_descale, sinks, cache_leftpad,
                            bidirectional_block_ids, *, max_seqlen_q, softmax_scale, causal,
                            window_size_left, window_size_right, softcap, num_splits):
    """Reference ``flash_attn_with_kvcache`` (contract: ``xpu_ops/ops/paged_attention.py``).

    Gathers the paged K/V into padded float32 blocks (``gather_pages``), dequantizes, then runs
    masked softmax attention per request (``attend_packed``); writes ``out`` and returns the LSE.
    Always one pass over the keys (``num_splits`` does not apply).
    """
    k_pad = dequantize(gather_pages(k_cache, page_table, cache_seqlens, cache_leftpad), k_descale)
    v_pad = dequantize(gather_pages(v_cache, page_table, cache_seqlens, cache_leftpad), v_descale)
    return attend_packed(q, cu_seqlens_q, max_seqlen_q, k_pad, v_pad, cache_seqlens, out, qv=qv,
                         q_descale=q_descale, sinks=sinks, softmax_scale=softmax_scale,
                         window_size_left=window_size_left, window_size_right=window_size_right,
                         softcap=softcap, k_start=cache_leftpad,
                         block_ids=bidirectional_block_ids)
