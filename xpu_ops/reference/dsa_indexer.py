"""Reference DSA indexer ops: logits (ragged and paged), top-k, the index-key store and the
Hadamard transform, in plain PyTorch with float32 accumulation (contracts: ``xpu_ops/ops/
dsa_indexer.py``, ``dsa_topk.py``, ``dsa_index_cache.py``, ``hadamard.py``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import provider_table
from ..index_k_layout import (AMAX_FLOOR, FP8_MAX, is_dense_blocks, positions_to_slots,
                              split_blocks)
from .kv_cache import write_slots

_ROWS_PER_CHUNK = 64          # query rows scored at once (bounds the [rows, H, keys] scores)


def _weighted_relu_scores(q: Tensor, k: Tensor, k_scale: Tensor, weights: Tensor) -> Tensor:
    """``sum_h weights[r, h] * relu(k_scale[j] * (q[r, h] . k[r or shared, j]))`` in float32.

    q [rows, H, D], k [keys, D] or [rows, keys, D], k_scale [keys] or [rows, keys],
    weights [rows, H] -> [rows, keys]."""
    if k.dim() == 2:
        dots = torch.einsum("rhd,jd->rhj", q, k) * k_scale
    else:
        dots = torch.einsum("rhd,rjd->rhj", q, k) * k_scale[:, None, :]
    return torch.einsum("rhj,rh->rj", dots.relu(), weights)


@provider_table.register("fp8_mqa_logits", "reference")
def fp8_mqa_logits(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits,
                   max_seqlen_k):
    """Reference ``fp8_mqa_logits``: chunks of query rows against every key, then the
    ``[ks, ke)`` mask (and the compressed gather when ``max_seqlen_k > 0``)."""
    seq_len, seq_len_kv = q.shape[0], k.shape[0]
    width = max_seqlen_k if max_seqlen_k > 0 else seq_len_kv
    out = torch.full((seq_len, width), -math.inf, dtype=torch.float32, device=q.device)
    if seq_len == 0 or seq_len_kv == 0 or width == 0:
        return out
    kf, scale, w = k.float(), k_scale.float(), weights.float()
    ks = cu_seqlen_ks.long().clamp(0, seq_len_kv)
    ke = cu_seqlen_ke.long().clamp(0, seq_len_kv)
    for start in range(0, seq_len, _ROWS_PER_CHUNK):
        rows = slice(start, min(start + _ROWS_PER_CHUNK, seq_len))
        scores = _weighted_relu_scores(q[rows].float(), kf, scale, w[rows])   # [r, kv]
        key = torch.arange(width, device=q.device)[None, :]
        if max_seqlen_k > 0:
            key = key + cu_seqlen_ks[rows].long()[:, None]                   # compressed
        inside = (key >= ks[rows, None]) & (key < ke[rows, None])
        picked = scores.gather(1, key.clamp(0, seq_len_kv - 1).expand(scores.shape[0], -1))
        out[rows] = torch.where(inside, picked, -math.inf)
    return out


def _dense_cache(cache: Tensor) -> Tensor:
    """``cache`` itself when ``split_blocks`` can view it, else a contiguous copy."""
    return cache if is_dense_blocks(cache) else cache.contiguous()


@provider_table.register("fp8_paged_mqa_logits", "reference")
def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len,
                         clean_logits):
    """Reference ``fp8_paged_mqa_logits``: gathers each request's keys position by position
    (through ``block_table``), scores its ``next_n`` queries, masks positions ``>= L``."""
    batch, next_n, heads, dim = q.shape
    num_blocks, block_size = kv_cache.shape[:2]
    out = torch.full((batch * next_n, max_context_len), -math.inf, dtype=torch.float32,
                     device=q.device)
    if batch * next_n == 0 or max_context_len == 0 or num_blocks == 0:
        return out
    values, scales = split_blocks(_dense_cache(kv_cache))
    pos = torch.arange(max_context_len, device=q.device)                        # [W]
    col = (pos // block_size).clamp(max=max(block_table.shape[1] - 1, 0))
    blk = block_table.long()[:, col] if block_table.shape[1] else \
        torch.full((batch, max_context_len), -1, device=q.device, dtype=torch.long)
    ok_blk = (blk >= 0) & (blk < num_blocks) & (pos // block_size < block_table.shape[1])
    blk, row = blk.clamp(0, num_blocks - 1), (pos % block_size)[None, :]
    keys = values[blk, row].view(torch.float8_e4m3fn).float()                   # [b, W, D]
    key_scale = scales[blk, row].float()                                         # [b, W]
    scores = _weighted_relu_scores(q.float().flatten(0, 1),
                                   keys.repeat_interleave(next_n, 0),
                                   key_scale.repeat_interleave(next_n, 0), weights.float())
    visible = _visible_keys(context_lens, next_n, block_table.shape[1] * block_size,
                            max_context_len)                                     # [b*next_n]
    keep = (pos[None, :] < visible[:, None]) & ok_blk.repeat_interleave(next_n, 0)
    return torch.where(keep, scores, out)


def _visible_keys(context_lens: Tensor, next_n: int, capacity: int, width: int) -> Tensor:
    """Keys each query row sees (``L`` of the op's docstring), clamped, as int64 [b*next_n]."""
    lens = context_lens.long()
    if lens.dim() == 1:
        lens = lens[:, None] - next_n + 1 + torch.arange(next_n, device=lens.device)[None, :]
    return lens.flatten().clamp(0, min(capacity, width))


def _ranked_positions(score, lengths, row_starts, topk) -> Tensor:
    """``fast_topk``'s rule (``xpu_ops/ops/dsa_topk.py``): [rows, topk] int64 positions."""
    rows, width = score.shape
    device = score.device
    start = row_starts.long() if row_starts is not None else torch.zeros(rows, dtype=torch.long,
                                                                         device=device)
    start = start.clamp(0, width)
    length = torch.minimum(lengths.long().clamp(min=0), width - start)           # [rows]
    pos = torch.arange(width, device=device)[None, :]
    inside = pos < length[:, None]
    vals = score.gather(1, (start[:, None] + pos).clamp(max=max(width - 1, 0))) \
        if width else score
    vals = torch.where(inside & ~vals.isnan(), vals + 0.0, -math.inf)           # -0.0 -> 0.0
    order = torch.sort(vals, dim=1, descending=True, stable=True).indices       # ties: low first
    chosen = order[:, :topk]
    chosen = torch.where(chosen < length[:, None], chosen, width + 1)            # beyond L: drop
    chosen = torch.sort(chosen, dim=1).values
    chosen = torch.where(chosen <= width, chosen, -1)
    if chosen.shape[1] < topk:
        chosen = torch.cat([chosen, chosen.new_full((rows, topk - chosen.shape[1]), -1)], 1)
    return chosen


@provider_table.register("fast_topk", "reference")
def fast_topk(score, lengths, row_starts, topk):
    """Reference ``fast_topk``: a stable descending sort per row (ties: lower position)."""
    return _ranked_positions(score, lengths, row_starts, topk).to(torch.int32)


@provider_table.register("fast_topk_transform", "reference")
def fast_topk_transform(score, lengths, page_table, cu_seqlens_q, row_starts, topk):
    """Reference ``fast_topk_transform``: ``fast_topk``'s positions looked up in the row's
    request's page-table row (``positions_to_slots``)."""
    return positions_to_slots(_ranked_positions(score, lengths, row_starts, topk), page_table,
                              cu_seqlens_q)


def quantize_rows(index_k: Tensor, ue8m0_scale: bool) -> tuple[Tensor, Tensor]:
    """``(fp8 bytes [N, D] uint8, scales [N] float32)`` of the store's rule."""
    x = index_k.float()
    scale = x.abs().amax(1).clamp(min=AMAX_FLOOR) / FP8_MAX if x.shape[1] else \
        x.new_full((x.shape[0],), AMAX_FLOOR / FP8_MAX)
    if ue8m0_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    values = (x * (1.0 / scale)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.view(torch.uint8), scale


@provider_table.register("store_index_k_cache", "reference")
def store_index_k_cache(index_k_cache, loc, index_k, ue8m0_scale):
    """Reference ``store_index_k_cache``: quantise, then two ``write_slots`` (values, scales)
    into views of the blocks (through a contiguous copy written back for other layouts)."""
    if loc.shape[0] == 0 or index_k_cache.shape[0] * index_k_cache.shape[1] == 0:
        return
    values, scale = quantize_rows(index_k, ue8m0_scale)
    dense = _dense_cache(index_k_cache)
    value_view, scale_view = split_blocks(dense)
    write_slots(value_view, loc, values)
    write_slots(scale_view.view(torch.uint8).unflatten(-1, (-1, 4)), loc,
                scale.view(torch.uint8).view(-1, 4))
    if dense is not index_k_cache:
        index_k_cache.copy_(dense)


@provider_table.register("hadamard_transform", "reference")
def hadamard_transform(x, scale):
    """Reference ``hadamard_transform``: log2(n) butterfly stages in float32 over the padded
    last dimension."""
    d = x.shape[-1]
    if x.numel() == 0:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    n = 1 << max(d - 1, 0).bit_length()
    y = x.float().reshape(-1, d)
    if n != d:
        y = torch.nn.functional.pad(y, (0, n - d))
    h = 1
    while h < n:
        pairs = y.view(-1, n // (2 * h), 2, h)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]),
                        dim=2).view(-1, n)
        h *= 2
    return (y[:, :d] * scale).to(x.dtype).reshape(x.shape)
