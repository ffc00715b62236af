"""The DSA index-key cache layout (DeepGEMM's paged fp8 layout), shared by the ops and providers.

DeepSeek-V3.2's lightning indexer keeps one fp8 key of ``D`` features per token (``D = 128``
in the model: its ``index_head_dim``, also its quantisation block) with one float32 scale. The
cache is ``uint8 [num_blocks, block_size, 1, D + 4]``, but the bytes of block ``p`` are not
per-token rows: in the block's logical byte order (its last three dimensions flattened) come
first the ``block_size * D`` fp8 values of its tokens, token after token, then the
``block_size`` float32 scales. This is what DeepGEMM's ``fp8_paged_mqa_logits`` reads and what
sglang's DSA index buffer (``index_k_with_scale_buffer``, ``page_size * (D + 4)`` bytes per
page) holds. Token slot ``s`` is block ``s // block_size``, row ``s % block_size``.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Bytes of one token's scale (float32) after the block's fp8 values.
SCALE_BYTES = 4
#: Largest finite ``float8_e4m3fn``: a token's scale is ``amax / FP8_MAX``.
FP8_MAX = 448.0
#: Lower bound of ``amax`` before dividing (DeepSeek's ``act_quant`` and DeepGEMM's tests).
AMAX_FLOOR = 1e-4


def head_dim(cache: Tensor) -> int:
    """``D`` of a cache ``[num_blocks, block_size, 1, D + 4]``."""
    return cache.shape[-1] - SCALE_BYTES


def is_dense_blocks(cache: Tensor) -> bool:
    """True when each block's bytes are contiguous and its scales 4-byte aligned (any block
    stride that is a multiple of 4): ``split_blocks`` can view it."""
    _, block_size, heads, width = cache.shape
    return ((cache.stride(3) == 1 or width <= 1) and (cache.stride(2) == width or heads <= 1)
            and (cache.stride(1) == heads * width or block_size <= 1)
            and cache.stride(0) % SCALE_BYTES == 0 and cache.storage_offset() % SCALE_BYTES == 0)


def split_blocks(cache: Tensor) -> tuple[Tensor, Tensor]:
    """Views ``(values [num_blocks, block_size, D] uint8, scales [num_blocks, block_size]
    float32)`` of a cache whose blocks are dense (``is_dense_blocks``)."""
    num_blocks, block_size, _, width = cache.shape
    dim = width - SCALE_BYTES
    flat = cache.as_strided((num_blocks, block_size * width), (cache.stride(0), 1))
    values = flat[:, :block_size * dim].unflatten(1, (block_size, dim))
    scales = flat[:, block_size * dim:].unflatten(1, (block_size, SCALE_BYTES))
    return values, scales.view(torch.float32).squeeze(-1)


def request_of_rows(cu_seqlens_q: Tensor, rows: int, batch: int) -> Tensor:
    """int64 [rows]: the request ``r`` with ``cu_seqlens_q[r] <= i < cu_seqlens_q[r + 1]`` of
    each row ``i``, or -1 when none covers it (one ``searchsorted``, no host sync)."""
    row_ids = torch.arange(rows, device=cu_seqlens_q.device)
    cu = cu_seqlens_q.long().contiguous()
    request = torch.searchsorted(cu, row_ids, right=True) - 1
    covered = (request >= 0) & (request < batch) & (row_ids < cu[-1:])
    return torch.where(covered, request, -1)


def positions_to_slots(positions: Tensor, page_table: Tensor, cu_seqlens_q: Tensor) -> Tensor:
    """``fast_topk_transform``'s lookup: int32 ``page_table[r(i), p]`` for each selected
    position ``p >= 0`` of row ``i`` (``request_of_rows``), -1 for padding, positions past the
    table and rows no request covers."""
    batch, width = page_table.shape
    if batch == 0 or width == 0:
        return torch.full_like(positions, -1, dtype=torch.int32)
    request = request_of_rows(cu_seqlens_q, positions.shape[0], batch)
    lookup = page_table[request.clamp(min=0)[:, None], positions.clamp(0, width - 1)]
    keep = (positions >= 0) & (positions < width) & (request >= 0)[:, None]
    return torch.where(keep, lookup, -1).to(torch.int32)


def tokens_to_blocks(cache: Tensor) -> Tensor:
    """A copy, in this layout, of a *per-token* cache ``[P, block_size, 1, D + 4]`` (each
    token's D fp8 bytes, then its float32 scale: sgl-kernel-xpu's ``fp8_paged_mqa_logits``
    layout); uint8."""
    pages, block_size, _, width = cache.shape
    tokens = cache.view(torch.uint8).reshape(pages, block_size, width)
    dim = width - SCALE_BYTES
    return torch.cat([tokens[..., :dim].reshape(pages, block_size * dim),
                      tokens[..., dim:].reshape(pages, block_size * SCALE_BYTES)],
                     dim=1).view(pages, block_size, 1, width)


def blocks_to_tokens(cache: Tensor) -> Tensor:
    """The inverse of ``tokens_to_blocks``: a per-token copy of a cache in this layout; uint8."""
    pages, block_size, _, width = cache.shape
    flat = cache.view(torch.uint8).reshape(pages, block_size * width)
    dim = width - SCALE_BYTES
    return torch.cat([flat[:, :block_size * dim].reshape(pages, block_size, dim),
                      flat[:, block_size * dim:].reshape(pages, block_size, SCALE_BYTES)],
                     dim=2).view(pages, block_size, 1, width)


__all__ = ["SCALE_BYTES", "FP8_MAX", "AMAX_FLOOR", "head_dim", "is_dense_blocks", "split_blocks",
           "request_of_rows", "positions_to_slots", "tokens_to_blocks", "blocks_to_tokens"]
