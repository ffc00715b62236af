"""Decode attention on the CPU in a few large ops: the ``reference`` provider's CPU fast path.

A decode step (one query row per request) spends most of the general reference path's time in
op count and copies, not arithmetic: at SmolLM2-135M shapes it issues ~70 small ops per call.
Here the same semantics take few ops and few passes over the keys and values. A call that does
not ask for the LSE (the usual decode layer) gathers each request's key slots (one
``index_select`` per cache of the rows ``_plan`` picks) and runs torch SDPA once, the
query heads of a KV head as its query rows (``_sdpa``);
one that does, or has sinks or a softcap, gathers ``(slot, head)`` rows heads first, computes
the scores of the query heads that share a KV head in one batched matmul, a masked softmax
whose maximum gives the LSE, and one batched matmul for the output.

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
import torch.nn.functional as F
from torch import Tensor

from .._checks import FLOAT_DTYPES
from ..provider_table import empty_lse


def applies(q: Tensor, k_cache: Tensor, page_table: Tensor, cu_seqlens_q: Tensor,
            max_seqlen_q: int, *extras) -> bool:
    """True when this path serves the call: CPU tensors, float caches, at least one request
    and one page-table column, one query row per request in order (``cu_seqlens_q == [0, 1,
    ..., b]``, ``max_seqlen_q == 1``) and every tensor of ``extras`` (qv, descales,
    cache_leftpad, bidirectional_block_ids) None."""
    if (q.device.type != "cpu" or max_seqlen_q != 1 or q.dtype not in FLOAT_DTYPES
            or k_cache.dtype != q.dtype or q.shape[0] == 0  # no row: the general path
            or page_table.shape[1] == 0):                  # no key slot: the general path
        return False
    if any(t is not None for t in extras):
        return False
    batch = cu_seqlens_q.shape[0] - 1
    return q.shape[0] == batch and torch.equal(
        cu_seqlens_q, torch.arange(batch + 1, dtype=cu_seqlens_q.dtype))


def _slots(page_table: Tensor, cache_seqlens: Tensor, num_pages: int, page_size: int,
           window_left: int) -> tuple[Tensor, Tensor, bool]:
    """``(slots [b, L] int64, hidden [b, L] bool, exact)`` for the ``L = P * page_size`` keys
    of each request.

    ``slots`` is the cache slot (``page * page_size + offset``, page ids clamped into range)
    each key is read from; ``hidden`` marks the keys that do not exist (``j >= min(cache_seqlens,
    capacity)`` or on a page id outside ``[0, num_pages)``) or lie left of the window. When
    ``exact`` (no page id that holds a key is out of range, every request has a key), a hidden
    key reads its request's last key instead (always visible), so every slot read holds a key
    the request owns and nothing read needs zeroing; otherwise hidden keys may read garbage
    (NaN). Reading values costs no synchronisation on the CPU.
    """
    b, max_pages = page_table.shape
    capacity = max_pages * page_size
    raw = page_table.long()
    pages = raw.clamp(0, max(num_pages - 1, 0))
    k_lens = cache_seqlens.long().clamp_(0, capacity)[:, None]                # [b, 1]
    positions = torch.arange(capacity)[None, :]
    hidden = positions >= k_lens
    if window_left >= 0:  # a decode row's own key (j = Lk - 1) stays inside the window
        hidden |= positions < k_lens - 1 - window_left
    slots = (pages[:, :, None] * page_size + torch.arange(page_size)).view(b, capacity)
    bad = pages != raw                                                        # [b, P]
    if bool(bad.any()):  # entries past a request's last page are never read: only used ones
        bad &= (torch.arange(max_pages) * page_size)[None, :] < k_lens
        if bool(bad.any()):
            hidden |= bad.repeat_interleave(page_size, dim=1)
            return slots, hidden, False
    if int(k_lens.min()) == 0:
        return slots, hidden, False
    return torch.where(hidden, slots.gather(1, k_lens - 1), slots), hidden, True


def _gather_heads_first(cache: Tensor, slots: Tensor, rows: Tensor) -> Tensor:
    """``cache [num_pages, page_size, Hkv, D]`` at ``slots [b, L]`` as float32 ``[Hkv, b, L,
    D]``, so each (head, request) block is one matrix.

    A contiguous cache takes one ``index_select`` of its ``[slots * Hkv, D]`` rows ``rows``
    (``slot * Hkv + head`` in heads-first order, shared by K and V); any other strides one
    advanced index by (page, offset), then one copy that puts the head first.
    """
    page_size, num_heads_kv, dim = cache.shape[1:]
    b, keys = slots.shape
    if cache.is_contiguous():
        picked = cache.view(-1, dim).index_select(0, rows)
        return picked.view(num_heads_kv, b, keys, dim).float()
    picked = cache[slots // page_size, slots % page_size]                     # [b, L, Hkv, D]
    out = torch.empty((num_heads_kv, b, keys, dim), dtype=torch.float32)
    return out.copy_(picked.permute(2, 0, 1, 3))


def _plan(page_table: Tensor, cache_seqlens: Tensor, num_pages: int, page_size: int,
          window_left: int) -> Optional[tuple[Tensor, Tensor]]:
    """``(rows [b * L] int64, visible [b, 1, 1, L] bool)`` of the ``L = P * page_size`` keys of
    each request, or None when some request has no key or a page that holds one of its keys
    has an id outside ``[0, num_pages)`` (the explicit path then hides it).

    ``rows`` is the cache slot (``page * page_size + offset``) each key is read from; a hidden
    key (at or past ``min(cache_seqlens, capacity)``, or left of the window) reads a key of its
    request that is visible instead (key 0 without a window, else the last key), so every row
    read holds a key (no NaN to zero) and page-table entries past a request's last page are
    never read. A slot is in ``[0, num_pages * page_size)`` exactly when its page id is in
    range, so one ``aminmax`` of the rows checks the pages that hold keys. ``visible`` is
    SDPA's boolean mask. Seven small ops without a window, built on every call.
    """
    b, max_pages = page_table.shape
    capacity = max_pages * page_size
    if int(cache_seqlens.min()) <= 0:
        return None
    positions = torch.arange(capacity)
    slots = torch.add(positions[:page_size], page_table.long()[:, :, None], alpha=page_size)
    slots = slots.view(b, capacity)                                           # [b, L]
    visible = positions < cache_seqlens[:, None]                              # [b, L]
    if window_left < 0:
        filler = slots[:, :1]
    else:  # a decode row's own key (j = Lk - 1) stays inside the window
        last = cache_seqlens.long().clamp(max=capacity)[:, None] - 1
        visible &= positions >= last - window_left
        filler = slots.gather(1, last)
    rows = torch.where(visible, slots, filler).view(-1)
    low, high = torch.aminmax(rows)
    if int(low) < 0 or int(high) >= num_pages * page_size:
        return None
    return rows, visible.view(b, 1, 1, capacity)


def _gather_rows(cache: Tensor, rows: Tensor, page_size: int) -> Tensor:
    """``cache [num_pages, page_size, H, D]`` at slots ``rows [n]`` as contiguous ``[n, H,
    D]``: one ``index_select`` of a contiguous cache's ``[slots, H * D]`` rows (faster than
    that of its 3-D view), else an index by (page, offset)."""
    if cache.is_contiguous():
        flat = cache.view(-1, cache.shape[2] * cache.shape[3]).index_select(0, rows)
        return flat.view(-1, *cache.shape[2:])
    return cache[rows // page_size, rows % page_size]


def _sdpa(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
          page_table: Tensor, out: Tensor, softmax_scale: float, window_left: int) -> bool:
    """``out = softmax(scale * q k^T) v`` over each request's visible keys with one torch SDPA
    call, if every request has a key and the pages that hold keys have ids in range (else
    False, nothing written).

    The keys are gathered slot by slot (``_plan``'s rows, one gather per cache, ``[b, L, Hkv,
    D]``; hidden keys read a visible key of the request, so nothing needs zeroing) and masked; the
    ``G`` query heads of a KV head are ``G`` query rows against that head's keys (``[b, Hkv,
    G, D]``), so no head is repeated.
    """
    b, num_heads_q, head_dim = q.shape
    num_pages, page_size, num_heads_kv = k_cache.shape[:3]
    plan = _plan(page_table, cache_seqlens, num_pages, page_size, window_left)
    if plan is None:
        return False
    rows, visible = plan
    capacity = visible.shape[-1]
    keys = _gather_rows(k_cache, rows, page_size).view(b, capacity, num_heads_kv, head_dim)
    values = _gather_rows(v_cache, rows, page_size).view(b, capacity, num_heads_kv, -1)
    o = F.scaled_dot_product_attention(
        q.reshape(b, num_heads_kv, num_heads_q // num_heads_kv, head_dim),
        keys.transpose(1, 2), values.transpose(1, 2), attn_mask=visible,
        scale=softmax_scale)                                                  # [b, Hkv, G, Dv]
    out.view(b, num_heads_kv, -1, o.shape[-1]).copy_(o)
    return True


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                     page_table: Tensor, out: Tensor, *, sinks: Optional[Tensor],
                     softmax_scale: float, window_left: int, softcap: float,
                     return_lse: bool = True) -> Tensor:
    """Attention of ``q [b, Hq, D]`` (row ``r`` is request ``r``'s only query) over the paged
    cache; writes ``out [b, Hq, Dv]`` and returns the LSE ``[Hq, b]`` float32 (natural log), or
    an empty ``[Hq, 0]`` when not ``return_lse``.

    Without the LSE, sinks and softcap, when every request has a key and every page id is in
    range, the output is one ``torch.nn.functional.scaled_dot_product_attention`` call
    (``_sdpa``). Otherwise the scores are explicit and the LSE comes from the softmax itself: ``lse = s_max
    - log(p_max)`` (``p_max = 1 / sum(exp(s - s_max)) >= 1 / L`` never underflows), one fused
    ``softmax`` and two ``amax`` instead of a ``logsumexp`` and a second pass over the scores.

    Args:
        k_cache/v_cache: [num_pages, page_size, Hkv, D|Dv], q's dtype.
        cache_seqlens: [b] int32 keys per request. page_table: [b, max_pages] int32.
        sinks: [Hq] float32 sink logits or None. window_left: -1 unbounded.
        softcap: 0 for none, else ``softcap * tanh(s / softcap)``.
    """
    if not return_lse and sinks is None and softcap == 0 and _sdpa(
            q, k_cache, v_cache, cache_seqlens, page_table, out, softmax_scale, window_left):
        return empty_lse(q)
    b, num_heads_q, head_dim = q.shape
    num_pages, page_size, num_heads_kv = k_cache.shape[:3]
    group = num_heads_q // num_heads_kv
    slots, hidden, exact = _slots(page_table, cache_seqlens, num_pages, page_size, window_left)
    rows = (slots * num_heads_kv)[None] + torch.arange(num_heads_kv)[:, None, None]
    rows = rows.view(-1)                                          # [Hkv * b * L], heads first
    # Batched over (KV head, request): the G query heads of a KV head share its keys.
    keys = _gather_heads_first(k_cache, slots, rows)                          # [Hkv, b, L, D]
    qg = q.view(b, num_heads_kv, group, head_dim).transpose(0, 1)             # [Hkv, b, G, D]
    if softcap > 0:
        scores = torch.matmul(qg.float(), keys.transpose(-1, -2)).mul_(softmax_scale)
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    else:  # the scale folded into the G query rows (fewer products than the scores)
        scores = torch.matmul(qg.float() * softmax_scale, keys.transpose(-1, -2))
    scores.masked_fill_(hidden[None, :, None, :], float("-inf"))              # [Hkv, b, G, L]
    probs = torch.softmax(scores, dim=-1)
    lse = scores.amax(dim=-1).sub_(probs.amax(dim=-1).log_())                 # [Hkv, b, G]
    values = _gather_heads_first(v_cache, slots, rows)                        # [Hkv, b, L, Dv]
    if not exact:  # hidden keys may have read NaN: 0 * NaN is NaN; rows without keys: NaN
        garbage = hidden.view(-1).nonzero().squeeze(1)
        values.view(num_heads_kv, -1, values.shape[-1]).index_fill_(1, garbage, 0.0)
        probs.nan_to_num_(0.0)
        lse.masked_fill_(hidden.all(dim=1)[None, :, None], float("-inf"))
    if sinks is not None:  # one more logit in the denominator
        total = torch.logaddexp(lse, sinks.float().view(num_heads_kv, 1, group))
        # no key and a -inf sink: -inf - -inf is NaN, the row's weight is 0 (out 0, LSE -inf)
        probs.mul_((lse - total).exp_().nan_to_num_(0.0)[..., None])
        lse = total
    o = torch.matmul(probs, values)                                           # [Hkv, b, G, Dv]
    out.view(b, num_heads_kv, group, -1).copy_(o.transpose(0, 1))
    lse = lse.permute(0, 2, 1).reshape(num_heads_q, b)
    return lse if return_lse else empty_lse(q)


__all__ = ["applies", "decode_attention"]
