"""Decode attention on the CPU in a few large ops: the ``reference`` provider's CPU fast path.

A decode step (one query row per request) spends most of the general reference path's time in
op count and copies, not arithmetic: at SmolLM2-135M shapes it issues ~70 small ops per call.
Here the same semantics take ~25 ops and few passes over the keys and values: per cache one
``index_select`` of whole pages and one copy that puts the KV head first (each (head, request)
block is then one matrix), one batched matmul for the scores of the query heads that share a KV
head, a masked log-sum-exp, one batched matmul for the output.

Semantics are the reference's (``xpu_ops/reference/paged_attention.py``): keys ``j <
min(cache_seqlens[r], capacity)`` whose page id is in ``[0, num_pages)`` exist, the window's
left bound ``pos - left`` applies with ``pos = Lk - 1`` (a decode row sees every key up to its
own position, so the right bound never hides a key), ``softcap`` and ``sinks`` as in API.md,
rows with no visible key give 0 and LSE ``-inf`` (the sink logit with sinks), NaN in the slots
that do not exist never reaches the result. ``applies`` says when this path serves a call; it
reads ``cu_seqlens_q``'s values, which costs nothing on the CPU (no device to synchronise with).

Source: scaled dot-product attention (Vaswani et al., 2017) with the LSE-normalised softmax of
FlashAttention-2 (arXiv 2307.08691); paged KV cache from vLLM (arXiv 2309.06180).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import FLOAT_DTYPES


def applies(q: Tensor, k_cache: Tensor, cu_seqlens_q: Tensor, max_seqlen_q: int, *extras
            ) -> bool:
    """True when this path serves the call: CPU tensors, float caches, at least one request,
    one query row per request in order (``cu_seqlens_q == [0, 1, ..., b]``, ``max_seqlen_q == 1``) and every
    tensor of ``extras`` (qv, descales, cache_leftpad, bidirectional_block_ids) None."""
    if (q.device.type != "cpu" or max_seqlen_q != 1 or q.dtype not in FLOAT_DTYPES
            or k_cache.dtype != q.dtype or q.shape[0] == 0):  # no row: the general path
        return False
    if any(t is not None for t in extras):
        return False
    batch = cu_seqlens_q.shape[0] - 1
    return q.shape[0] == batch and torch.equal(
        cu_seqlens_q, torch.arange(batch + 1, dtype=cu_seqlens_q.dtype))


def _gather_heads_first(cache: Tensor, pages: Tensor) -> Tensor:
    """``cache [num_pages, page_size, Hkv, D]`` rows of ``pages [b, P]`` (in range) as a new
    contiguous float32 ``[Hkv, b, P * page_size, D]``, so each (head, request) block is one
    matrix: ``index_select`` copies whole pages, one ``copy_`` puts the KV head first (and
    converts to float32)."""
    b, max_pages = pages.shape
    page_size, num_heads_kv, dim = cache.shape[1:]
    rows = torch.index_select(cache, 0, pages.reshape(-1))        # [b * P, page_size, Hkv, D]
    out = torch.empty((num_heads_kv, b, max_pages * page_size, dim), dtype=torch.float32)
    return out.copy_(rows.view(b, max_pages * page_size, num_heads_kv, dim).permute(2, 0, 1, 3))


def _visible(page_table: Tensor, cache_seqlens: Tensor, num_pages: int, page_size: int,
             window_left: int) -> tuple[Tensor, Tensor]:
    """``(pages [b, P] int64 in range, visible [b, P * page_size] bool)``: the keys that exist
    (``j < min(cache_seqlens, capacity)`` on a page id in ``[0, num_pages)``) inside the
    window's left bound; out-of-range page ids are read as page 0 and hidden."""
    capacity = page_table.shape[1] * page_size
    pages = page_table.long()
    page_ok = (pages >= 0) & (pages < num_pages)                              # [b, P]
    k_lens = cache_seqlens.long().clamp(0, capacity)[:, None]                 # [b, 1]
    positions = torch.arange(capacity)[None, :]
    visible = (positions < k_lens) & page_ok.repeat_interleave(page_size, dim=1)
    if window_left >= 0:
        visible &= positions >= k_lens - 1 - window_left
    return pages.masked_fill_(~page_ok, 0), visible


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                     page_table: Tensor, out: Tensor, *, sinks: Optional[Tensor],
                     softmax_scale: float, window_left: int, softcap: float) -> Tensor:
    """Attention of ``q [b, Hq, D]`` (row ``r`` is request ``r``'s only query) over the paged
    cache; writes ``out [b, Hq, Dv]`` and returns the LSE ``[Hq, b]`` float32 (natural log).

    Args:
        k_cache/v_cache: [num_pages, page_size, Hkv, D|Dv], q's dtype.
        cache_seqlens: [b] int32 keys per request. page_table: [b, max_pages] int32.
        sinks: [Hq] float32 sink logits or None. window_left: -1 unbounded.
        softcap: 0 for none, else ``softcap * tanh(s / softcap)``.
    """
    b, num_heads_q, head_dim = q.shape
    num_pages, page_size, num_heads_kv = k_cache.shape[:3]
    group = num_heads_q // num_heads_kv
    pages, visible = _visible(page_table, cache_seqlens, num_pages, page_size, window_left)
    hidden = ~visible[None, :, None, :]                                       # [1, b, 1, L]
    # Batched over (KV head, request): the G query heads of a KV head share its keys.
    keys = _gather_heads_first(k_cache, pages)                                # [Hkv, b, L, D]
    qg = q.float().view(b, num_heads_kv, group, head_dim).transpose(0, 1)     # [Hkv, b, G, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(softmax_scale)     # [Hkv, b, G, L]
    if softcap > 0:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    scores.masked_fill_(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                     # -inf: no key
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.float().view(num_heads_kv, 1, group))
    probs = scores.sub_(lse.nan_to_num(neginf=0.0)[..., None]).exp_()
    values = _gather_heads_first(v_cache, pages)                              # [Hkv, b, L, Dv]
    values.masked_fill_(~visible[None, :, :, None], 0.0)                      # NaN garbage: 0
    o = torch.matmul(probs, values)                                           # [Hkv, b, G, Dv]
    out.copy_(o.transpose(0, 1).reshape(b, num_heads_q, -1))
    return lse.permute(0, 2, 1).reshape(num_heads_q, b)


__all__ = ["applies", "decode_attention"]
