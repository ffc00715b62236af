"""Float64 oracle for every op, written from the math in shared/API.md.

Independent of ``xpu_ops.reference`` by construction: it imports nothing from ``xpu_ops``, loops
per request, builds each request's keys token by token from the page table (so unused entries and
slots past ``cache_seqlens`` are never touched), and builds each visibility mask element by element
from the rules as API.md states them. Slow on purpose; use it on small shapes only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

F64 = torch.float64


def visible_mask(q_len: int, k_len: int, *, causal: bool, left: int = -1,
                 right: int = -1, k_start: int = 0, q_used: Optional[int] = None,
                 block_ids: Optional[list[int]] = None) -> Tensor:
    """``[q_len, k_len]`` bool: row ``i`` (at ``pos = k_len - q_len + i``) sees key ``j`` when
    ``j <= pos`` if causal, and ``pos - left <= j <= pos + right`` (inclusive, -1 unbounded;
    causal forces ``right = 0``).

    FlashAttention-3 extras: keys ``j < k_start`` (``cache_leftpad``) are invisible; with
    ``q_used`` (``seqused_q``) only rows ``i < q_used`` see keys and ``pos = k_len - q_used + i``;
    with ``block_ids`` (one per row, < 0 none) key ``j`` has the id of row ``j - (k_len -
    q_len)`` and a row sees a same-id key whatever the right bound (``bidirectional_block_ids``).
    """
    if causal:
        right = 0
    used = q_len if q_used is None else q_used
    mask = torch.zeros(q_len, k_len, dtype=torch.bool)
    for i in range(used):
        pos = k_len - used + i
        for j in range(k_start, k_len):
            right_ok = right < 0 or j <= pos + right
            if block_ids is not None and 0 <= j - (k_len - q_len) < q_len:
                key_id = block_ids[j - (k_len - q_len)]
                right_ok = right_ok or (block_ids[i] >= 0 and key_id == block_ids[i])
            mask[i, j] = (left < 0 or j >= pos - left) and right_ok
    return mask


def attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, *, scale: float,
           softcap: float = 0.0, sinks: Optional[Tensor] = None,
           qv: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Attention of one request in float64.

    Args:
        q: [Lq, Hq, D]; k: [Lk, Hkv, D]; v: [Lk, Hkv, Dv]; visible: [Lq, Lk] bool.
        qv: [Lq, Hq, Dv] adds ``qv . v`` to the raw scores. sinks: [Hq] logits.
    Returns:
        ``(out [Lq, Hq, Dv], lse [Hq, Lq])``; a row with nothing in its softmax gives 0, -inf.
    """
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    kh = k.repeat_interleave(group, dim=1)                      # query head h -> KV head h // G
    vh = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kh)
    if qv is not None:
        s = s + torch.einsum("qhd,khd->hqk", qv.to(F64), vh)
    s = s * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible[None], -math.inf)
    logits = s
    if sinks is not None:
        sink = sinks.to(F64)[:, None, None].expand(hq, q.shape[0], 1)
        logits = torch.cat([s, sink], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)                       # [Hq, Lq]
    finite = torch.isfinite(lse)[..., None]
    p = torch.where(finite, torch.exp(s - torch.where(finite, lse[..., None], 0.0)), 0.0)
    out = torch.einsum("hqk,khd->qhd", p, vh)
    return out, lse


def paged_keys(cache: Tensor, page_table: Tensor, r: int, k_len: int) -> Tensor:
    """Request ``r``'s first ``k_len`` tokens, one by one through the page table: [k_len, ...]."""
    page_size = cache.shape[1]
    rows = [cache[int(page_table[r, j // page_size]), j % page_size].to(F64)
            for j in range(k_len)]
    return torch.stack(rows) if rows else cache.new_zeros((0, *cache.shape[2:]), dtype=F64)


def _group_scale(descale: Optional[Tensor], r: int, heads: int) -> Tensor | float:
    """``descale[r]`` [Hkv] broadcast to ``heads`` heads as ``[1, heads, 1]`` (1.0 when None).
    A 1-D descale holds one scale per request (``[b]``) or one for all (``[1]``)."""
    if descale is None:
        return 1.0
    if descale.dim() == 1:
        return float(descale[r if descale.shape[0] > 1 else 0])
    d = descale[r].to(F64)
    return d.repeat_interleave(heads // d.shape[0])[None, :, None]


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out, qv,
                            q_descale, k_descale, v_descale, sinks, cache_leftpad=None,
                            bidirectional_block_ids=None, *, max_seqlen_q, softmax_scale, causal,
                            window_size_left, window_size_right, softcap, num_splits=0,
                            return_softmax_lse=True):
    """Oracle of ``torch.ops.xpu_ops.flash_attn_with_kvcache`` (op arguments; ``out`` unused;
    ``num_splits`` cannot change the math).

    Returns:
        ``(out [total_q, Hq, Dv] float64, lse [Hq, total_q] float64)``; ``lse`` is ``[Hq, 0]``
        when not ``return_softmax_lse`` (the op's empty result).
    """
    hq, hkv = q.shape[1], k_cache.shape[2]
    outs, lses = [], []
    for r in range(cache_seqlens.shape[0]):
        q0, q1 = int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1])
        k_len = int(cache_seqlens[r])
        qr = q[q0:q1].to(F64) * _group_scale(q_descale, r, hq)
        kr = paged_keys(k_cache, page_table, r, k_len) * _group_scale(k_descale, r, hkv)
        vr = paged_keys(v_cache, page_table, r, k_len) * _group_scale(v_descale, r, hkv)
        ids = (None if bidirectional_block_ids is None
               else [int(x) for x in bidirectional_block_ids[q0:q1]])
        k_start = 0 if cache_leftpad is None else min(int(cache_leftpad[r]), k_len)
        kr[:k_start], vr[:k_start] = 0.0, 0.0        # slots before cache_leftpad: never read
        mask = visible_mask(q1 - q0, k_len, causal=causal, left=window_size_left,
                            right=window_size_right, block_ids=ids, k_start=k_start)
        o, lse = attend(qr, kr, vr, mask, scale=softmax_scale, softcap=softcap, sinks=sinks,
                        qv=None if qv is None else qv[q0:q1])
        outs.append(o)
        lses.append(lse)
    dv = v_cache.shape[3]
    out64 = torch.cat(outs) if outs else torch.zeros(0, hq, dv, dtype=F64)
    lse64 = torch.cat(lses, dim=1) if lses else torch.zeros(hq, 0, dtype=F64)
    return out64, lse64 if return_softmax_lse else lse64[:, :0]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal, window_size_left=-1,
                           window_size_right=-1, softmax_scale, softcap=0.0, sinks=None, qv=None,
                           seqused_k=None, q_descale=None, k_descale=None, v_descale=None,
                           seqused_q=None):
    """Oracle of ragged attention: request ``r`` has keys ``k[cu_k[r]:cu_k[r+1]]`` (its first
    ``seqused_k[r]`` when given) and uses its first ``seqused_q[r]`` query rows when given
    (the others: output 0, LSE -inf). Returns ``(out [total_q, Hq, Dv], lse [Hq, total_q])``."""
    hq, hkv = q.shape[1], k.shape[1]
    outs, lses = [], []
    for r in range(cu_seqlens_q.shape[0] - 1):
        q0, q1 = int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1])
        k0, k1 = int(cu_seqlens_k[r]), int(cu_seqlens_k[r + 1])
        if seqused_k is not None:
            k1 = k0 + int(seqused_k[r])
        qr = q[q0:q1].to(F64) * _group_scale(q_descale, r, hq)
        kr = k[k0:k1].to(F64) * _group_scale(k_descale, r, hkv)
        vr = v[k0:k1].to(F64) * _group_scale(v_descale, r, hkv)
        mask = visible_mask(q1 - q0, k1 - k0, causal=causal, left=window_size_left,
                            right=window_size_right,
                            q_used=None if seqused_q is None else int(seqused_q[r]))
        o, lse = attend(qr, kr, vr, mask, scale=softmax_scale, softcap=softcap, sinks=sinks,
                        qv=None if qv is None else qv[q0:q1])
        outs.append(o)
        lses.append(lse)
    out64 = torch.cat(outs) if outs else torch.zeros(0, hq, v.shape[2], dtype=F64)
    lse64 = torch.cat(lses, dim=1) if lses else torch.zeros(hq, 0, dtype=F64)
    return out64, lse64


def merge_state(v_a, s_a, v_b, s_b) -> tuple[Tensor, Tensor]:
    """API.md: ``m = max(s_a, s_b)``, ``w = e^(s - m)``, ``v = (w_a v_a + w_b v_b)/(w_a + w_b)``,
    ``s = m + ln(w_a + w_b)``; a ``-inf`` or ``+inf`` side is empty and contributes nothing; both
    empty give (0, -inf). Element by element over ``[N, H]``."""
    n, h, d = v_a.shape
    v = torch.zeros(n, h, d, dtype=F64)
    s = torch.full((n, h), -math.inf, dtype=F64)
    for i in range(n):
        for j in range(h):
            a, b = float(s_a[i, j]), float(s_b[i, j])
            a_empty, b_empty = math.isinf(a), math.isinf(b)
            if a_empty and b_empty:
                continue
            m = b if a_empty else a if b_empty else max(a, b)
            wa = 0.0 if a_empty else math.exp(a - m)
            wb = 0.0 if b_empty else math.exp(b - m)
            part_a = 0.0 if a_empty else wa * v_a[i, j].to(F64)     # empty: never read
            part_b = 0.0 if b_empty else wb * v_b[i, j].to(F64)
            v[i, j] = (part_a + part_b) / (wa + wb)
            s[i, j] = m + math.log(wa + wb)
    return v, s


def flash_mla_decode(q_nope, q_rope, kv_cache, cache_seqlens, page_table, softmax_scale):
    """Absorbed MLA decode: one query per request, one latent KV head; keys are the whole
    ``[R + r]`` token row, values its first ``R`` entries. Returns ``[b, H, R]`` float64."""
    latent = q_nope.shape[-1]
    cache = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], 1, kv_cache.shape[-1])
    outs = []
    for r in range(q_nope.shape[0]):
        k_len = int(cache_seqlens[r])
        q = torch.cat([q_nope[r], q_rope[r]], dim=-1).to(F64)[None]      # [1, H, R + r]
        k = paged_keys(cache, page_table, r, k_len)                        # [Lk, 1, R + r]
        mask = torch.ones(1, k_len, dtype=torch.bool)
        o, _ = attend(q, k, k[..., :latent], mask, scale=softmax_scale)
        outs.append(o[0])
    return torch.stack(outs) if outs else torch.zeros(0, q_nope.shape[1], latent, dtype=F64)


def flash_mla_prefill(q_nope, q_pe, kv_cache, cu_seqlens_q, seq_lens_k, page_table, *, sm_scale,
                      causal):
    """Absorbed MLA of ragged queries: request ``r``'s rows ``cu_seqlens_q[r]:[r + 1]`` over its
    ``seq_lens_k[r]`` tokens, keys the whole ``[R + r]`` row, values the first ``R`` entries,
    causal bottom-right. Returns ``[total_q, H, R]`` float64."""
    latent = q_nope.shape[-1]
    cache = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], 1, kv_cache.shape[-1])
    outs = []
    for r in range(seq_lens_k.shape[0]):
        q0, q1 = int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1])
        k_len = int(seq_lens_k[r])
        q = torch.cat([q_nope[q0:q1], q_pe[q0:q1]], dim=-1).to(F64)      # [Lq, H, R + r]
        k = paged_keys(cache, page_table, r, k_len)                        # [Lk, 1, R + r]
        mask = visible_mask(q1 - q0, k_len, causal=causal)
        o, _ = attend(q, k, k[..., :latent], mask, scale=sm_scale)
        outs.append(o)
    return torch.cat(outs) if outs else torch.zeros(0, q_nope.shape[1], latent, dtype=F64)


def store_kv(cache: Tensor, loc: Tensor, values: Tensor, scale: Optional[float] = None) -> Tensor:
    """Expected cache after writing ``values[i]`` (divided by ``scale`` for fp8) into flat token
    slot ``loc[i]``: a copy of ``cache`` viewed ``[slots, ...]``, written one slot at a time."""
    flat = cache.reshape(-1, *values.shape[1:]).clone()
    for i in range(loc.shape[0]):
        row = values[i].to(F64)
        if scale is not None:
            row = row / scale
        flat[int(loc[i])] = row.to(torch.float32).to(cache.dtype)
    return flat.view(cache.shape)


def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, *,
                     interleaved: bool) -> Tensor:
    """RoFormer rotation of each token's first ``2 * cos.shape[1]`` features, pair by pair:
    ``(a, b) -> (a cos - b sin, a sin + b cos)`` at angle row ``positions[t]``; pairs are
    ``(2i, 2i + 1)`` when ``interleaved``, else ``(i, i + rotary_dim / 2)``. Float64."""
    out = x.to(F64).clone()
    half = cos.shape[1]
    for t in range(x.shape[0]):
        p = int(positions[t])
        for i in range(half):
            a_idx, b_idx = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
            c, s = float(cos[p, i]), float(sin[p, i])
            a, b = x[t, :, a_idx].to(F64), x[t, :, b_idx].to(F64)
            out[t, :, a_idx] = a * c - b * s
            out[t, :, b_idx] = a * s + b * c
    return out


# ---- inconsistent metadata (API.md "Writes": what every provider does with checks off) -------

def _clamped(lo: int, value: int, hi: int) -> int:
    return min(max(value, lo), hi)


def described_rows(cu_seqlens_q, total_q: int, max_seqlen_q: int) -> list[tuple[int, int]]:
    """``(start, q_len)`` of each request's rows: ``[cu[r], cu[r + 1])`` clamped into
    ``[0, total_q]``, at most ``max_seqlen_q`` rows."""
    rows = []
    for r in range(cu_seqlens_q.shape[0] - 1):
        start = _clamped(0, int(cu_seqlens_q[r]), total_q)
        end = _clamped(start, int(cu_seqlens_q[r + 1]), total_q)
        rows.append((start, min(end - start, max_seqlen_q)))
    return rows


def row_owners(rows: list[tuple[int, int]], total_q: int) -> list[int]:
    """How many requests describe each packed row (0: kept as is; > 1: any one of them)."""
    count = [0] * total_q
    for start, q_len in rows:
        for t in range(start, start + q_len):
            count[t] += 1
    return count


def flash_attn_with_kvcache_unchecked(q, k_cache, v_cache, cache_seqlens, page_table,
                                      cu_seqlens_q, *, max_seqlen_q, softmax_scale, causal,
                                      window_size_left=-1, window_size_right=-1, softcap=0.0,
                                      sinks=None) -> tuple[Tensor, Tensor, list[int]]:
    """Paged attention over possibly inconsistent metadata, as API.md's "Writes" states: rows
    by ``described_rows``; keys ``min(max(cache_seqlens[r], 0), page_table.shape[1] *
    page_size)``, each read through its page-table entry, hidden when that page id is outside
    ``[0, num_pages)``.

    Returns:
        ``(out [total_q, Hq, Dv], lse [Hq, total_q], owners)`` float64; rows no request
        describes are NaN, ``owners`` as ``row_owners`` (the last describing request wins here).
    """
    total_q, hq = q.shape[0], q.shape[1]
    num_pages, page_size, hkv = k_cache.shape[:3]
    capacity = page_table.shape[1] * page_size
    out = torch.full((total_q, hq, v_cache.shape[-1]), math.nan, dtype=F64)
    lse = torch.full((hq, total_q), math.nan, dtype=F64)
    rows = described_rows(cu_seqlens_q, total_q, max_seqlen_q)
    for r, (start, q_len) in enumerate(rows):
        k_len = _clamped(0, int(cache_seqlens[r]), capacity)
        pages = [int(page_table[r, j // page_size]) for j in range(k_len)]
        exists = torch.tensor([0 <= p < num_pages for p in pages], dtype=torch.bool)
        keys = [(k_cache[p, j % page_size], v_cache[p, j % page_size]) if 0 <= p < num_pages
                else (k_cache.new_zeros(k_cache.shape[2:]), v_cache.new_zeros(v_cache.shape[2:]))
                for j, p in enumerate(pages)]
        k = torch.stack([kv[0] for kv in keys]) if keys else k_cache.new_zeros((0, hkv, q.shape[2]))
        v = torch.stack([kv[1] for kv in keys]) if keys else v_cache.new_zeros(
            (0, hkv, v_cache.shape[-1]))
        mask = visible_mask(q_len, k_len, causal=causal, left=window_size_left,
                            right=window_size_right) & exists.reshape(1, k_len)
        o, l_ = attend(q[start:start + q_len], k, v, mask, scale=softmax_scale, softcap=softcap,
                       sinks=sinks)
        out[start:start + q_len], lse[:, start:start + q_len] = o, l_
    return out, lse, row_owners(rows, total_q)
