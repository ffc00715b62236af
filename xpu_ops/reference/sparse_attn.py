"""Reference vertical-slash sparse attention and its index builders (contract:
``xpu_ops/ops/sparse_attn.py``)."""

from __future__ import annotations

import math

import torch

from .. import provider_table


def _row_keys(block_count, block_offset, column_count, column_index, seqlen_k: int,
              block_size_N: int) -> torch.Tensor:
    """``[b, H, rows, seqlen_k]`` bool: the keys each query block row sees (counts clamped
    into capacity, offsets and columns outside ``[0, seqlen_k)`` ignored)."""
    b, h, rows = block_count.shape
    keys = torch.arange(seqlen_k, device=block_count.device)
    visible = torch.zeros(b, h, rows, seqlen_k, dtype=torch.bool, device=block_count.device)
    blocks = block_count.long().clamp(0, block_offset.shape[3])
    for t in range(block_offset.shape[3]):
        start = block_offset[..., t].long()[..., None]                       # [b, H, rows, 1]
        inside = (keys >= start) & (keys < start + block_size_N)
        visible |= inside & (t < blocks)[..., None]
    columns = column_count.long().clamp(0, column_index.shape[3])
    index = column_index.long()
    used = (torch.arange(index.shape[3], device=index.device) < columns[..., None]) & (
        index >= 0) & (index < seqlen_k)
    spill = torch.zeros(b, h, rows, seqlen_k + 1, dtype=torch.bool, device=index.device)
    spill.scatter_(3, torch.where(used, index, seqlen_k), True)             # column seqlen_k:
    return visible | spill[..., :seqlen_k]                                  # unused entries


@provider_table.register("sparse_attn_func", "reference")
def sparse_attn_func(q, k, v, block_count, block_offset, column_count, column_index, out,
                     softmax_scale, causal, softcap, block_size_M, block_size_N):
    """Reference ``sparse_attn_func``: the visible-key mask of every query row, then masked
    float32 attention; writes ``out``, returns the LSE ``[b, Hq, seqlen_q]``."""
    batch, seqlen_q, num_heads, _ = q.shape
    seqlen_k, group = k.shape[1], num_heads // k.shape[2]
    rows = torch.arange(seqlen_q, device=q.device) // block_size_M
    mask = _row_keys(block_count, block_offset, column_count, column_index, seqlen_k,
                     block_size_N).index_select(2, rows)               # [b, H, seqlen_q, Sk]
    if causal:
        pos = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)
        mask = mask & (torch.arange(seqlen_k, device=q.device) <= pos)
    qf = q.float().transpose(1, 2)                                     # [b, H, Sq, D]
    kf = k.float().transpose(1, 2).repeat_interleave(group, 1)
    vf = v.float().transpose(1, 2).repeat_interleave(group, 1)
    scores = softmax_scale * qf @ kf.transpose(-1, -2)
    if softcap > 0 and softcap != math.inf:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)                              # -inf: no visible key
    weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out.copy_((weights @ vf).transpose(1, 2).to(out.dtype))
    return lse.contiguous()


def _save_blocks(offsets: list, start: int, end: int, block_size_N: int, kv_len: int) -> None:
    """Key blocks ``start, start + BN, ...`` below ``end`` and ``kv_len``."""
    offsets.extend(range(start, min(end, kv_len), block_size_N) if start < min(end, kv_len)
                   else ())


def _convert_row(v_list, s_list, q_len, kv_len, end_m, block_size_M, block_size_N, causal):
    """One query block row: ``(block offsets, columns)`` by the two-pointer merge of the
    contract (slashes descending, verticals ascending)."""
    limit = end_m + kv_len - q_len                       # keys at or past it are in the future
    col_limit = limit - 1

    def conv(s):
        return max(kv_len - q_len + end_m - s, block_size_M) if causal else kv_len + end_m - s

    slashes = [s for s in s_list if not (causal and s >= limit)]
    blocks, columns = [], []
    if not slashes:
        for c in v_list:
            if causal and c >= col_limit:
                break
            if 0 <= c < kv_len:
                columns.append(c)
        return blocks, columns
    end = conv(slashes[0])
    start, pending, v_ptr = end - block_size_M, slashes[1:], 0
    while True:
        if v_ptr < len(v_list) and v_list[v_ptr] < end:
            c = v_list[v_ptr]
            if c < start and not (causal and c >= limit):
                columns.append(c)
            v_ptr += 1
        elif pending:
            nxt = conv(pending.pop(0))
            if nxt > end + block_size_M:                 # a gap: store the range, start anew
                _save_blocks(blocks, start, end, block_size_N, kv_len)
                start, end = nxt - block_size_M, nxt
            elif nxt > end:
                end += block_size_M
        else:
            _save_blocks(blocks, start, end, block_size_N, kv_len)
            for c in v_list[v_ptr:]:
                if causal and c >= col_limit:
                    break
                if c >= end:
                    columns.append(c)
            return blocks, columns


@provider_table.register("convert_vertical_slash_indexes", "reference")
def convert_vertical_slash_indexes(q_seqlens, kv_seqlens, vertical_indexes, slash_indexes,
                                   vertical_indices_count, slash_indices_count, context_size,
                                   block_size_M, block_size_N, causal):
    """Reference index builder (host scan per request, head and query block row)."""
    batch, heads, nnz_s = slash_indexes.shape
    nnz_v = vertical_indexes.shape[2]
    rows = (context_size + block_size_M - 1) // block_size_M
    dtype, device = q_seqlens.dtype, slash_indexes.device
    block_count = torch.zeros(batch, heads, rows, dtype=dtype)
    block_offset = torch.zeros(batch, heads, rows, nnz_s, dtype=dtype)
    column_count = torch.zeros(batch, heads, rows, dtype=dtype)
    column_index = torch.zeros(batch, heads, rows, nnz_v, dtype=dtype)
    q_lens, kv_lens = q_seqlens.tolist(), kv_seqlens.tolist()
    verticals, slashes = vertical_indexes.tolist(), slash_indexes.tolist()
    v_counts = vertical_indices_count.tolist() if vertical_indices_count is not None else None
    s_counts = slash_indices_count.tolist() if slash_indices_count is not None else None
    for b in range(batch):
        for h in range(heads):
            v_list = verticals[b][h][:max(v_counts[h], 0)] if v_counts else verticals[b][h]
            s_list = slashes[b][h][:max(s_counts[h], 0)] if s_counts else slashes[b][h]
            for m in range(rows):
                blocks, columns = _convert_row(v_list, s_list, q_lens[b], kv_lens[b],
                                               (m + 1) * block_size_M, block_size_M,
                                               block_size_N, causal)
                blocks, columns = blocks[:nnz_s], columns[:nnz_v]   # within capacity
                block_count[b, h, m], column_count[b, h, m] = len(blocks), len(columns)
                block_offset[b, h, m, :len(blocks)] = torch.tensor(blocks, dtype=dtype)
                column_index[b, h, m, :len(columns)] = torch.tensor(columns, dtype=dtype)
    return tuple(t.to(device) for t in (block_count, block_offset, column_count, column_index))
