"""Reference ``flash_attn_with_kvcache``: gather pages into padded blocks, then masked softmax."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import providers
from .attention import dequantize, gather_padded, masked_attention, request_rows, scatter_packed


def gather_pages(cache: Tensor, page_table: Tensor, cache_seqlens: Tensor) -> Tensor:
    """Logical key sequence of each request as float32 ``[b, max_pages * page_size, H, D]``.

    Page-table entries past a request's last page may hold any value: they are replaced by page 0
    before indexing, and every slot at or past ``cache_seqlens`` is zeroed (it may hold NaN).
    """
    num_pages, page_size = cache.shape[:2]
    b, max_pages = page_table.shape
    pages_used = (cache_seqlens.long() + page_size - 1) // page_size
    page_ok = torch.arange(max_pages, device=cache.device)[None, :] < pages_used[:, None]
    pages = torch.where(page_ok, page_table.long(), 0).clamp(0, max(num_pages - 1, 0))
    slots = pages[:, :, None] * page_size + torch.arange(page_size, device=cache.device)
    slots = slots.reshape(b, max_pages * page_size)
    valid = torch.arange(max_pages * page_size, device=cache.device)[None, :] < cache_seqlens[:, None]
    return gather_padded(cache.reshape(num_pages * page_size, *cache.shape[2:]), slots, valid)


@providers.register("flash_attn_with_kvcache", "reference")
def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out,
                            qv, q_descale, k_descale, v_descale, sinks, *, max_seqlen_q,
                            softmax_scale, causal, window_size_left, window_size_right, softcap):
    q_idx, q_valid, q_lens = request_rows(cu_seqlens_q, max_seqlen_q)
    q_pad = gather_padded(q, q_idx, q_valid)
    if q_descale is not None:
        group = q.shape[1] // k_cache.shape[2]
        q_pad = q_pad * q_descale.repeat_interleave(group, dim=1)[:, None, :, None]
    qv_pad = None if qv is None else gather_padded(qv, q_idx, q_valid)
    k_pad = dequantize(gather_pages(k_cache, page_table, cache_seqlens), k_descale)
    v_pad = dequantize(gather_pages(v_cache, page_table, cache_seqlens), v_descale)
    out_pad, lse_pad = masked_attention(
        q_pad, k_pad, v_pad, q_lens, cache_seqlens.long(), qv=qv_pad, softmax_scale=softmax_scale,
        window_left=window_size_left, window_right=window_size_right, softcap=softcap, sinks=sinks)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    scatter_packed(out_pad, lse_pad, cu_seqlens_q, out, lse)
    return lse
