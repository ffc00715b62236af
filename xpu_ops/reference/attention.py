"""Reference attention over padded per-request blocks: plain PyTorch, float32 accumulation.

Vectorised over requests (no Python loop over requests or tokens, no host synchronisation): each
request's queries are gathered into ``[b, max_seqlen_q]`` rows and its keys into
``[b, max_seqlen_k]`` columns, one masked softmax runs over ``[b, Hkv, G, max_q, max_k]`` scores,
and the valid rows are gathered back into the packed layout. Sizes come from shapes and the
caller's ``max_seqlen_*`` bounds only, so the code also runs inside CUDA graph capture.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import Tensor


def request_ranges(cu_seqlens: Tensor, max_len: int, total: int) -> tuple[Tensor, Tensor]:
    """``(start [b], lens [b])`` int64 of each request's packed rows, clamped so that even
    inconsistent prefix sums address only rows ``[0, total)``, at most ``max_len`` per request
    (the same clamps as the Triton kernels, so both providers agree on such input)."""
    start = cu_seqlens[:-1].long().clamp(0, total)
    end = torch.maximum(cu_seqlens[1:].long(), start).clamp(max=total)
    return start, (end - start).clamp(max=max_len)


def tight_bound(cu_seqlens: Tensor, max_len: int, total: int) -> int:
    """The caller's bound ``max_len`` of a request's length cut to ``total`` (no request has
    more rows) and, on the CPU, where reading values costs no synchronisation, to the longest
    clamped request (``request_ranges``): a loose bound gives the tight bound's padded blocks
    (and a decode batch the CPU decode path)."""
    max_len = min(max_len, total)
    if cu_seqlens.device.type == "cpu" and cu_seqlens.shape[0] > 1 and max_len > 1:
        max_len = int(request_ranges(cu_seqlens, max_len, total)[1].max())
    return max_len


def request_rows(cu_seqlens: Tensor, max_len: int, total: int) -> tuple[Tensor, Tensor, Tensor]:
    """Packed row index of every (request, slot) pair.

    Args:
        cu_seqlens: [b + 1] int32 prefix sums. max_len: bound of any request's length.
        total: packed rows (``request_ranges`` clamps into them).
    Returns:
        ``(index [b, max_len] int64 in range, valid [b, max_len] bool, lens [b])``.
    """
    start, lens = request_ranges(cu_seqlens, max_len, total)
    slots = torch.arange(max_len, device=cu_seqlens.device)
    valid = slots[None, :] < lens[:, None]
    index = start[:, None] + slots[None, :]
    return index.clamp(max=max(total - 1, 0)), valid, lens


def token_owner(start: Tensor, lens: Tensor, total: int) -> tuple[Tensor, Tensor, Tensor]:
    """For each packed token, ``(request id, row within the request, described)`` (``[total]``):
    the first request whose ``[start, start + lens)`` covers it; ``described`` is False for
    rows none covers (inconsistent metadata only: valid prefix sums cover every row once)."""
    tokens = torch.arange(total, device=start.device)
    covers = (tokens[None, :] >= start[:, None]) & (tokens[None, :] < (start + lens)[:, None])
    owner = covers.to(torch.uint8).argmax(dim=0)                       # first covering request
    return owner, tokens - start[owner], covers.any(dim=0)


def gather_padded(x: Tensor, index: Tensor, valid: Tensor) -> Tensor:
    """``x[index]`` as float32 with invalid slots zeroed (they may hold NaN garbage)."""
    if x.shape[0] == 0:
        return x.new_zeros((*index.shape, *x.shape[1:]), dtype=torch.float32)
    rows = x[index.clamp(max=x.shape[0] - 1)].float()
    return torch.where(valid.view(*valid.shape, *([1] * (rows.dim() - valid.dim()))), rows, 0.0)


def dequantize(x: Tensor, descale: Optional[Tensor]) -> Tensor:
    """Scale a float32 ``[b, L, Hkv, D]`` block by ``descale [b, Hkv]`` when given."""
    return x if descale is None else x * descale[:, None, :, None]


def masked_attention(q: Tensor, k: Tensor, v: Tensor, q_lens: Tensor, k_lens: Tensor, *,
                     qv: Optional[Tensor], softmax_scale: float, window_left: int,
                     window_right: int, softcap: float, sinks: Optional[Tensor],
                     masks: Optional["ExtraMasks"] = None) -> tuple[Tensor, Tensor]:
    """Masked softmax attention of padded blocks, float32 throughout.

    Args:
        q: [b, max_q, Hq, D] float32 queries (padding rows arbitrary but finite).
        k: [b, max_k, Hkv, D], v: [b, max_k, Hkv, Dv] float32 (padding zeroed).
        q_lens/k_lens: [b] valid query rows / keys per request.
        qv: [b, max_q, Hq, Dv] or None, adds ``qv.v`` to the scores.
        window_left/window_right: inclusive window around ``pos = k_len - q_len + i``, -1
            unbounded (causal is ``window_right = 0``).
        masks: the optional FlashAttention-3 masks (``ExtraMasks``), or None.
    Returns:
        ``(out [b, max_q, Hq, Dv], lse [b, Hq, max_q])``; rows with no visible key give 0 and
        ``-inf`` (or the sink logit when ``sinks`` is given).
    """
    b, max_q, num_heads_q, _ = q.shape
    max_k, num_heads_kv = k.shape[1], k.shape[2]
    group = num_heads_q // num_heads_kv
    qg = q.view(b, max_q, num_heads_kv, group, q.shape[-1])
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k)
    if qv is not None:
        scores = scores + torch.einsum("bqhgd,bkhd->bhgqk",
                                       qv.view(b, max_q, num_heads_kv, group, qv.shape[-1]), v)
    scores = scores * softmax_scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    # Visibility: key j of request r is visible to row i when j < k_len and inside the window
    # around the bottom-right aligned position pos = k_len - q_len + i.
    visible = _visible(q_lens, k_lens, max_q, max_k, window_left, window_right, masks)
    scores = torch.where(visible[:, None, None], scores, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True) if max_k > 0 else scores.new_full(
        (*scores.shape[:-1], 1), float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, num_heads_kv, group, 1, 1)
        sink_inf = sink == math.inf            # takes the whole softmax: out 0, LSE +inf
        sink = torch.where(sink_inf, -math.inf, sink)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs / torch.where(denom > 0, denom, 1.0), v)
    lse = row_max + torch.log(denom)                                         # -inf when empty
    if sinks is not None:
        out = torch.where(sink_inf.squeeze(-1).permute(0, 3, 1, 2)[..., None], 0.0, out)
        lse = torch.where(sink_inf, math.inf, lse)
    lse = lse.squeeze(-1)
    return out.reshape(b, max_q, num_heads_q, v.shape[-1]), lse.reshape(b, num_heads_q, max_q)


@dataclasses.dataclass(frozen=True)
class ExtraMasks:
    """FlashAttention-3 masks on top of length, causal and window (each optional).

    Attributes:
        k_start: [b] first visible key (``cache_leftpad``); keys before it are invisible.
        q_used: [b] used query rows (``seqused_q``): alignment ``pos = k_len - q_used + i``,
            rows ``i >= q_used`` see nothing.
        q_block_ids: [b, max_q] block id of each query row (``bidirectional_block_ids``
            gathered, ``-1`` past a request's rows): key ``j`` carries the id of the query at
            the same absolute position, and same-id keys (id >= 0) pass the right bound.
        key_valid: [b, max_k] bool, False for keys that do not exist (their page id is out of
            range, with value checks off).
    """
    k_start: Optional[Tensor] = None
    q_used: Optional[Tensor] = None
    q_block_ids: Optional[Tensor] = None
    key_valid: Optional[Tensor] = None


def _visible(q_lens: Tensor, k_lens: Tensor, max_q: int, max_k: int, window_left: int,
             window_right: int, masks: Optional[ExtraMasks]) -> Tensor:
    """``[b, max_q, max_k]`` (or broadcastable) bool: key ``j`` visible to row ``i``."""
    masks = masks or ExtraMasks()
    device = k_lens.device
    rows = torch.arange(max_q, device=device)
    cols = torch.arange(max_k, device=device)[None, None, :]
    q_align = q_lens if masks.q_used is None else masks.q_used.long()
    pos = ((k_lens - q_align)[:, None] + rows[None, :])[:, :, None]          # [b, max_q, 1]
    visible = cols < k_lens[:, None, None]                                  # [b, 1, max_k]
    if masks.k_start is not None:
        visible = visible & (cols >= masks.k_start.long()[:, None, None])
    if masks.key_valid is not None:
        visible = visible & masks.key_valid[:, None, :]
    if masks.q_used is not None:
        visible = visible & (rows[None, :, None] < q_align[:, None, None])
    if window_left >= 0:
        visible = visible & (cols >= pos - window_left)
    if window_right >= 0:
        right_ok = cols <= pos + window_right
        if masks.q_block_ids is not None:
            right_ok = right_ok | _same_block(masks.q_block_ids, q_lens, k_lens, max_k)
        visible = visible & right_ok
    return visible


def _same_block(q_block_ids: Tensor, q_lens: Tensor, k_lens: Tensor, max_k: int) -> Tensor:
    """``[b, max_q, max_k]``: row ``i`` and key ``j`` share a block id >= 0 (key ``j`` has the
    id of query row ``j - (k_len - q_len)``; keys before the first query row have none)."""
    max_q = q_block_ids.shape[1]
    key_row = torch.arange(max_k, device=k_lens.device)[None, :] - (k_lens - q_lens)[:, None]
    has_row = (key_row >= 0) & (key_row < q_lens[:, None])
    key_ids = torch.gather(q_block_ids, 1, key_row.clamp(0, max(max_q - 1, 0)))
    key_ids = torch.where(has_row, key_ids, -1)                              # [b, max_k]
    return (q_block_ids[:, :, None] >= 0) & (q_block_ids[:, :, None] == key_ids[:, None, :])


def scatter_packed(out_pad: Tensor, lse_pad: Tensor, start: Tensor, lens: Tensor, out: Tensor,
                   lse: Tensor) -> None:
    """Copy padded per-request results back into packed ``out [total_q, Hq, Dv]``, ``lse [Hq,
    total_q]``: each row a request describes (``start``/``lens`` of ``request_ranges``) once;
    rows none describes (inconsistent metadata only) keep their contents."""
    total_q = out.shape[0]
    if total_q == 0 or out_pad.shape[0] == 0 or out_pad.shape[1] == 0:
        return
    owner, row, described = token_owner(start, lens, total_q)
    row = row.clamp(0, out_pad.shape[1] - 1)
    out.copy_(torch.where(described[:, None, None], out_pad[owner, row].to(out.dtype), out))
    lse.copy_(torch.where(described[None, :], lse_pad[owner, :, row].transpose(0, 1), lse))


def attend_packed(q: Tensor, cu_seqlens_q: Tensor, max_seqlen_q: int, k_pad: Tensor,
                  v_pad: Tensor, k_lens: Tensor, out: Tensor, *, qv: Optional[Tensor],
                  q_descale: Optional[Tensor], sinks: Optional[Tensor], softmax_scale: float,
                  window_size_left: int, window_size_right: int, softcap: float,
                  k_start: Optional[Tensor] = None, q_used: Optional[Tensor] = None,
                  block_ids: Optional[Tensor] = None,
                  key_valid: Optional[Tensor] = None) -> Tensor:
    """Attention of packed queries over padded per-request keys; writes ``out``, returns LSE.

    Args:
        q: [total_q, Hq, D] (fp8 with ``q_descale [b, Hkv]`` allowed); cu_seqlens_q: [b + 1].
        k_pad: [b, max_k, Hkv, D], v_pad: [b, max_k, Hkv, Dv] float32, already dequantised.
        k_lens: [b] keys per request (in ``[0, max_k]``). out: [total_q, Hq, Dv], written in
            place (the rows ``cu_seqlens_q`` describes, see ``scatter_packed``).
        k_start, q_used: [b] (``ExtraMasks``); block_ids: [total_q] packed block ids.
        key_valid: [b, max_k] bool or None: keys that exist (``ExtraMasks``).
    Returns:
        softmax_lse [Hq, total_q] float32.
    """
    max_seqlen_q = tight_bound(cu_seqlens_q, max_seqlen_q, q.shape[0])
    q_idx, q_valid, q_lens = request_rows(cu_seqlens_q, max_seqlen_q, q.shape[0])
    q_pad = gather_padded(q, q_idx, q_valid)
    if q_descale is not None:
        group = q.shape[1] // k_pad.shape[2]
        q_pad = q_pad * q_descale.repeat_interleave(group, dim=1)[:, None, :, None]
    qv_pad = None if qv is None else gather_padded(qv, q_idx, q_valid)
    q_block_ids = None
    if block_ids is not None and q.shape[0] > 0:
        q_block_ids = torch.where(q_valid, block_ids[q_idx.clamp(max=max(q.shape[0] - 1, 0))], -1)
    masks = ExtraMasks(k_start=k_start, q_used=q_used, q_block_ids=q_block_ids,
                       key_valid=key_valid)
    out_pad, lse_pad = masked_attention(
        q_pad, k_pad, v_pad, q_lens, k_lens.long(), qv=qv_pad, softmax_scale=softmax_scale,
        window_left=window_size_left, window_right=window_size_right, softcap=softcap,
        sinks=sinks, masks=masks)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    start, _ = request_ranges(cu_seqlens_q, max_seqlen_q, q.shape[0])
    scatter_packed(out_pad, lse_pad, start, q_lens, out, lse)
    return lse
