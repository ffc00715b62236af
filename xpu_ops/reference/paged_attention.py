"""Reference ``flash_attn_with_kvcache``: gather pages into padded blocks, then masked softmax."""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import Tensor

from .. import provider_table
from . import cpu_decode
from .attention import attend_packed, dequantize, gather_padded, request_ranges, tight_bound


def paged_lengths(page_table: Tensor, cache_seqlens: Tensor, page_size: int) -> Tensor:
    """``cache_seqlens`` clamped into ``[0, page_table.shape[1] * page_size]`` (the capacity),
    as the Triton kernels clamp inconsistent lengths."""
    return cache_seqlens.long().clamp(0, page_table.shape[1] * page_size)


def request_spans(cu_seqlens_q: Tensor, max_seqlen_q: int, total_q: int, page_table: Tensor,
                  cache_seqlens: Tensor, page_size: int) -> Iterator[tuple[int, int, int, int]]:
    """``(r, lo, hi, pages)`` of each request ``r`` with query rows (``lo < hi``): its rows
    ``[lo, hi)``, clamped as the batched path clamps them (``request_ranges``: into
    ``[0, total_q]``, at most ``max_seqlen_q``), and the number of page-table entries its
    clamped key count covers (``paged_lengths``). For the per-request (batch-invariant)
    reference paths. Last request first: when inconsistent prefix sums make two requests
    describe one row, the earlier request's result is written last and stays, as in the
    batched path (``attention.scatter_packed``)."""
    start, lens = request_ranges(cu_seqlens_q, max_seqlen_q, total_q)
    k_lens = paged_lengths(page_table, cache_seqlens, page_size).tolist()
    spans = list(enumerate(zip(start.tolist(), lens.tolist())))
    for r, (lo, n) in reversed(spans):
        if n > 0:
            yield r, lo, lo + n, -(-k_lens[r] // page_size)


def gather_pages(cache: Tensor, page_table: Tensor, k_lens: Tensor,
                 k_start: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Logical key sequence of each request as float32 ``[b, max_pages * page_size, H, D]``.

    Args:
        cache: [num_pages, page_size, H, D] (any trailing dims after page_size).
        page_table: [b, max_pages] int32; k_lens: [b] tokens per request (``paged_lengths``).
        k_start: [b] first key (``cache_leftpad``), or None.
    Returns:
        ``(keys, valid [b, max_pages * page_size] bool)``: ``valid`` marks the keys that exist,
        those in ``[k_start, k_lens)`` whose page id is in ``[0, num_pages)``. Page-table
        entries past a request's last page may hold any value, and an out-of-range id read with
        value checks off hides its page's keys (never reads another page); invalid keys are
        zeroed (slots at or past ``k_lens`` may hold NaN).
    """
    num_pages, page_size = cache.shape[:2]
    b, max_pages = page_table.shape
    page_ok = (page_table >= 0) & (page_table < num_pages)
    pages = torch.where(page_ok, page_table.long(), 0)
    slots = pages[:, :, None] * page_size + torch.arange(page_size, device=cache.device)
    slots = slots.reshape(b, max_pages * page_size)
    positions = torch.arange(max_pages * page_size, device=cache.device)
    valid = (positions[None, :] < k_lens[:, None]) & page_ok.repeat_interleave(page_size, dim=1)
    if k_start is not None:
        valid = valid & (positions[None, :] >= k_start[:, None])
    keys = gather_padded(cache.reshape(num_pages * page_size, *cache.shape[2:]), slots, valid)
    return keys, valid


@provider_table.register("flash_attn_with_kvcache", "reference")
def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out,
                            qv, q_descale, k_descale, v_descale, sinks, cache_leftpad,
                            bidirectional_block_ids, max_seqlen_q, softmax_scale, causal,
                            window_size_left, window_size_right, softcap, num_splits,
                            return_softmax_lse):
    """Reference ``flash_attn_with_kvcache`` (contract: ``xpu_ops/ops/paged_attention.py``).

    Gathers the paged K/V into padded float32 blocks (``gather_pages``), dequantizes, then runs
    masked softmax attention per request (``attend_packed``); writes ``out`` and returns the LSE
    (an empty ``[Hq, 0]`` unless ``return_softmax_lse``). Always one pass over the keys. Decode
    calls on the CPU take ``cpu_decode``'s path (the same semantics in fewer ops; without the
    LSE, torch SDPA where it applies).

    ``num_splits=1`` (deterministic inference) also makes the result batch invariant: the padded
    blocks are as wide as the batch's longest request, and float32 sums over a wider block can
    round differently, so each request then runs as a batch of its own, over its own pages and
    query rows (``_one_request_at_a_time``): its bits are those it gets alone.
    """
    if num_splits == 1:
        return _one_request_at_a_time(
            q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out, qv, q_descale,
            k_descale, v_descale, sinks, cache_leftpad, bidirectional_block_ids, max_seqlen_q,
            softmax_scale, causal, window_size_left, window_size_right, softcap,
            return_softmax_lse)
    return _attend(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out, qv,
                   q_descale, k_descale, v_descale, sinks, cache_leftpad,
                   bidirectional_block_ids, max_seqlen_q, softmax_scale, causal,
                   window_size_left, window_size_right, softcap, return_softmax_lse)


def _attend(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out, qv, q_descale,
            k_descale, v_descale, sinks, cache_leftpad, bidirectional_block_ids, max_seqlen_q,
            softmax_scale, causal, window_size_left, window_size_right, softcap,
            return_softmax_lse):
    """One batched call (the body of ``flash_attn_with_kvcache``)."""
    max_seqlen_q = tight_bound(cu_seqlens_q, max_seqlen_q, q.shape[0])
    if cpu_decode.applies(q, k_cache, page_table, cu_seqlens_q, max_seqlen_q, qv, q_descale,
                          k_descale, v_descale, cache_leftpad, bidirectional_block_ids):
        return cpu_decode.decode_attention(q, k_cache, v_cache, cache_seqlens, page_table, out,
                                           sinks=sinks, softmax_scale=softmax_scale,
                                           window_left=window_size_left, softcap=softcap,
                                           return_lse=return_softmax_lse)
    k_lens = paged_lengths(page_table, cache_seqlens, k_cache.shape[1])
    k_pad, valid = gather_pages(k_cache, page_table, k_lens, cache_leftpad)
    v_pad, _ = gather_pages(v_cache, page_table, k_lens, cache_leftpad)
    lse = attend_packed(q, cu_seqlens_q, max_seqlen_q, dequantize(k_pad, k_descale),
                        dequantize(v_pad, v_descale), k_lens, out, qv=qv, q_descale=q_descale,
                        sinks=sinks, softmax_scale=softmax_scale,
                        window_size_left=window_size_left, window_size_right=window_size_right,
                        softcap=softcap, k_start=cache_leftpad,
                        block_ids=bidirectional_block_ids, key_valid=valid)
    return lse if return_softmax_lse else provider_table.empty_lse(q)


def _one_request_at_a_time(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out, qv,
                           q_descale, k_descale, v_descale, sinks, cache_leftpad,
                           bidirectional_block_ids, max_seqlen_q, softmax_scale, causal,
                           window_size_left, window_size_right, softcap, return_softmax_lse):
    """``_attend`` once per request ``r``: its query rows, its ``[1, pages_r]`` slice of
    ``page_table`` (``pages_r`` = the pages its clamped key count covers), its descales, left
    pad and block ids, ``max_seqlen_q`` its own row count; ``out`` and LSE rows written in place
    (rows no request describes are left as ``_attend`` leaves them: unwritten)."""
    lse = q.new_empty((q.shape[1], q.shape[0] if return_softmax_lse else 0), dtype=torch.float32)
    for r, lo, hi, pages in request_spans(cu_seqlens_q, max_seqlen_q, q.shape[0], page_table,
                                          cache_seqlens, k_cache.shape[1]):
        rows, one = slice(lo, hi), slice(r, r + 1)
        part = _attend(q[rows], k_cache, v_cache, cache_seqlens[one], page_table[one, :pages],
                       cu_seqlens_q.new_tensor([0, hi - lo]), out[rows], _part(qv, rows),
                       _part(q_descale, one), _part(k_descale, one), _part(v_descale, one),
                       sinks, _part(cache_leftpad, one), _part(bidirectional_block_ids, rows),
                       hi - lo, softmax_scale, causal, window_size_left, window_size_right,
                       softcap, return_softmax_lse)
        if return_softmax_lse:
            lse[:, lo:hi] = part
    return lse


def _part(t: Optional[Tensor], index: slice) -> Optional[Tensor]:
    return None if t is None else t[index]
