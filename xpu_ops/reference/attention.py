"""Reference attention over padded per-request blocks: plain PyTorch, float32 accumulation.

Vectorised over requests (no Python loop over requests or tokens, no host synchronisation): each
request's queries are gathered into ``[b, max_seqlen_q]`` rows and its keys into
``[b, max_seqlen_k]`` columns, one masked softmax runs over ``[b, Hkv, G, max_q, max_k]`` scores,
and the valid rows are gathered back into the packed layout. Sizes come from shapes and the
caller's ``max_seqlen_*`` bounds only, so the code also runs inside CUDA graph capture.
"""

from __future__ import annotations

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
    ``described`` is False for rows no request's ``[start, start + lens)`` covers."""
    tokens = torch.arange(total, device=start.device)
    owner = torch.searchsorted(start + lens, tokens, right=True)
    owner = owner.clamp(max=max(start.shape[0] - 1, 0))
    row = tokens - start[owner]
    return owner, row.clamp(min=0), (row >= 0) & (row < lens[owner])


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
                     key_valid: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Masked softmax attention of padded blocks, float32 throughout.

    Args:
        q: [b, max_q, Hq, D] float32 queries (padding rows arbitrary but finite).
        k: [b, max_k, Hkv, D], v: [b, max_k, Hkv, Dv] float32 (padding zeroed).
        q_lens/k_lens: [b] valid query rows / keys per request.
        qv: [b, max_q, Hq, Dv] or None, adds ``qv.v`` to the scores.
        window_left/window_right: inclusive window around ``pos = k_len - q_len + i``, -1
            unbounded (causal is ``window_right = 0``).
        key_valid: [b, max_k] bool or None; False hides a key (a page id out of range).
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
    rows = torch.arange(max_q, device=q.device)
    cols = torch.arange(max_k, device=q.device)
    pos = (k_lens - q_lens)[:, None] + rows[None, :]                        # [b, max_q]
    visible = cols[None, None, :] < k_lens[:, None, None]                   # [b, 1, max_k]
    if key_valid is not None:
        visible = visible & key_valid[:, None, :]
    if window_left >= 0:
        visible = visible & (cols[None, None, :] >= pos[:, :, None] - window_left)
    if window_right >= 0:
        visible = visible & (cols[None, None, :] <= pos[:, :, None] + window_right)
    scores = torch.where(visible[:, None, None], scores, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True) if max_k > 0 else scores.new_full(
        (*scores.shape[:-1], 1), float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, num_heads_kv, group, 1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs / torch.where(denom > 0, denom, 1.0), v)
    lse = (row_max + torch.log(denom)).squeeze(-1)                           # -inf when empty
    return out.reshape(b, max_q, num_heads_q, v.shape[-1]), lse.reshape(b, num_heads_q, max_q)


def scatter_packed(out_pad: Tensor, lse_pad: Tensor, start: Tensor, lens: Tensor, out: Tensor,
                   lse: Tensor) -> None:
    """Copy padded per-request results back into packed ``out [total_q, Hq, Dv]``, ``lse [Hq,
    total_q]``: each row a request describes (``start``/``lens`` of ``request_ranges``) once;
    rows none describes (inconsistent metadata only) keep their contents."""
    total_q = out.shape[0]
    if total_q == 0 or out_pad.shape[0] == 0 or out_pad.shape[1] == 0:
        return
    owner, row, described = token_owner(start, lens, total_q)
    row = row.clamp(max=out_pad.shape[1] - 1)
    out.copy_(torch.where(described[:, None, None], out_pad[owner, row].to(out.dtype), out))
    lse.copy_(torch.where(described[None, :], lse_pad[owner, :, row].transpose(0, 1), lse))


def attend_packed(q: Tensor, cu_seqlens_q: Tensor, max_seqlen_q: int, k_pad: Tensor,
                  v_pad: Tensor, k_lens: Tensor, out: Tensor, *, qv: Optional[Tensor],
                  q_descale: Optional[Tensor], sinks: Optional[Tensor], softmax_scale: float,
                  window_size_left: int, window_size_right: int, softcap: float,
                  key_valid: Optional[Tensor] = None) -> Tensor:
    """Attention of packed queries over padded per-request keys; writes ``out``, returns LSE.

    Args:
        q: [total_q, Hq, D] (fp8 with ``q_descale [b, Hkv]`` allowed); cu_seqlens_q: [b + 1].
        k_pad: [b, max_k, Hkv, D], v_pad: [b, max_k, Hkv, Dv] float32, already dequantised.
        k_lens: [b] keys per request (in ``[0, max_k]``). out: [total_q, Hq, Dv], written in
            place (the rows ``cu_seqlens_q`` describes, see ``scatter_packed``).
        key_valid: [b, max_k] bool or None: keys to hide (``masked_attention``).
    Returns:
        softmax_lse [Hq, total_q] float32.
    """
    q_idx, q_valid, q_lens = request_rows(cu_seqlens_q, max_seqlen_q, q.shape[0])
    q_pad = gather_padded(q, q_idx, q_valid)
    if q_descale is not None:
        group = q.shape[1] // k_pad.shape[2]
        q_pad = q_pad * q_descale.repeat_interleave(group, dim=1)[:, None, :, None]
    qv_pad = None if qv is None else gather_padded(qv, q_idx, q_valid)
    out_pad, lse_pad = masked_attention(
        q_pad, k_pad, v_pad, q_lens, k_lens.long(), qv=qv_pad, softmax_scale=softmax_scale,
        window_left=window_size_left, window_right=window_size_right, softcap=softcap,
        sinks=sinks, key_valid=key_valid)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    start, _ = request_ranges(cu_seqlens_q, max_seqlen_q, q.shape[0])
    scatter_packed(out_pad, lse_pad, start, q_lens, out, lse)
    return lse
