"""Reference FlashMLA surface: ``flash_mla_with_kvcache`` (dense and sparse) and
``flash_mla_sparse_fwd``, plain PyTorch with float32 accumulation.

Both gather the keys each query row reads into a padded float32 block (invalid keys zeroed, as
they may hold NaN garbage), then run one masked softmax (``attend``). Sparse rows gather their
own top-k slots (fp8 pages are dequantized per gathered token); dense requests gather their
pages once and mask per row.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import provider_table
from ..mla_fp8_layout import (FP8_TILE, MODEL1_NOPE, MODEL1_SCALE_BYTES, MODEL1_TILE,
                              MODEL1_TOKEN_DATA, MODEL1_VIEW_BYTES, fp8_rope_offset,
                              fp8_scale_offset, is_model1)
from .paged_attention import gather_pages, paged_lengths


def dequantize_fp8_tokens(tokens: Tensor, head_dim_v: int) -> Tensor:
    """FlashMLA fp8 tokens ``[..., token_bytes]`` (fp8 or uint8) as float32 ``[..., D]``:
    latent ``fp8 * tile scale``, then the bfloat16 rope part (``xpu_ops.mla_fp8_layout``)."""
    raw = tokens.view(torch.uint8)
    scale_at, rope_at = fp8_scale_offset(head_dim_v), fp8_rope_offset(head_dim_v)
    latent = raw[..., :head_dim_v].view(torch.float8_e4m3fn).float()
    scales = raw[..., scale_at:rope_at].contiguous().view(torch.float32)   # [..., Dv / 128]
    latent = latent.unflatten(-1, (-1, FP8_TILE)) * scales[..., None]
    rope = raw[..., rope_at:].contiguous().view(torch.bfloat16).float()
    return torch.cat([latent.flatten(-2), rope], dim=-1)


def dequantize_model1_pages(cache: Tensor) -> Tensor:
    """DeepSeek-V4 pages (``xpu_ops.mla_fp8_layout``'s MODEL1 layout) as float32
    ``[num_pages, page_size, 1, 512]``, read from the raw page bytes ``cache.stride(0)`` apart."""
    num_pages, page_size = cache.shape[:2]
    page_bytes = cache.stride(0) if num_pages > 1 else page_size * MODEL1_VIEW_BYTES
    raw = torch.as_strided(cache.view(torch.uint8), (num_pages, page_bytes), (page_bytes, 1))
    data = raw[:, :page_size * MODEL1_TOKEN_DATA].reshape(num_pages, page_size,
                                                          MODEL1_TOKEN_DATA)
    groups = raw[:, page_size * MODEL1_TOKEN_DATA:page_size * MODEL1_VIEW_BYTES]
    tiles = MODEL1_NOPE // MODEL1_TILE
    exponents = groups.reshape(num_pages, page_size, MODEL1_SCALE_BYTES)[..., :tiles]
    scales = torch.exp2(exponents.float() - 127.0)                    # UE8M0
    latent = data[..., :MODEL1_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    latent = (latent.unflatten(-1, (tiles, MODEL1_TILE)) * scales[..., None]).flatten(-2)
    rope = data[..., MODEL1_NOPE:].contiguous().view(torch.bfloat16).float()
    return torch.cat([latent, rope], dim=-1)[:, :, None]


def _fresh(t: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``t`` copied into a new row-major tensor (strides as the fake's, size-1 dims included)."""
    return torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device).copy_(t)


def _as_float(tokens: Tensor, is_fp8: bool, head_dim_v: int) -> Tensor:
    return dequantize_fp8_tokens(tokens, head_dim_v) if is_fp8 else tokens.float()


def _model1(cache: Tensor, is_fp8: bool, head_dim: int, head_dim_v: int) -> bool:
    return is_fp8 and is_model1(head_dim, head_dim_v, cache.shape[-1])


def attend(q: Tensor, keys: Tensor, visible: Tensor, head_dim_v: int, scale: float,
           attn_sink: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Masked softmax attention, float32.

    Args:
        q: [n, s, H, D]; keys: [n, s or 1, T, D] (invalid keys zeroed); visible: [n, s, T].
    Returns:
        ``(out [n, s, H, Dv], lse [n, s, H], max_logits [n, s, H])``; a row with no visible
        key gives 0, -inf, -inf. ``attn_sink [H]`` scales the output by
        ``1 / (1 + e^{sink - lse})`` and changes neither statistic.
    """
    scores = torch.matmul(q.float(), keys.transpose(-1, -2)) * scale        # [n, s, H, T]
    scores = torch.where(visible[:, :, None, :], scores, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if scores.shape[-1] > 0:
        max_logits = scores.amax(dim=-1)
    else:
        max_logits = torch.full_like(lse, float("-inf"))
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - torch.where(empty, 0.0, lse)[..., None])     # empty rows: 0
    out = torch.matmul(probs, keys[..., :head_dim_v])
    if attn_sink is not None:
        keep = torch.where(empty, 0.0, torch.sigmoid(lse - attn_sink.float()))
        out = out * keep[..., None]
    return out, lse, max_logits


def _sparse_keys(cache: Tensor, indices: Tensor, length: Optional[Tensor], is_fp8: bool,
                 head_dim: int, head_dim_v: int) -> tuple[Tensor, Tensor]:
    """``(keys [b, s, topk, D] float32, valid [b, s, topk])`` of the slots ``indices`` selects
    (valid: inside the cache and within ``length [b]``)."""
    slots = cache.shape[0] * cache.shape[1]
    if _model1(cache, is_fp8, head_dim, head_dim_v):      # whole pages first (bytes apart)
        cache, is_fp8 = dequantize_model1_pages(cache), False
    flat = cache.reshape(slots, cache.shape[-1])
    topk = indices.shape[-1]
    valid = (indices >= 0) & (indices < slots)
    if length is not None:
        ranks = torch.arange(topk, device=indices.device)
        valid = valid & (ranks[None, None, :] < length.long()[:, None, None])
    if slots == 0:
        return flat.new_zeros((*indices.shape, head_dim), dtype=torch.float32), valid
    rows = flat[torch.where(valid, indices.long(), 0)]                       # [b, s, topk, X]
    keys = _as_float(rows, is_fp8, head_dim_v)
    return torch.where(valid[..., None], keys, 0.0), valid


def _sparse(q, k_cache, head_dim_v, scale, is_fp8, indices, attn_sink, extra_k_cache,
            extra_indices, topk_length, extra_topk_length):
    head_dim = q.shape[-1]
    keys, valid = _sparse_keys(k_cache, indices, topk_length, is_fp8, head_dim, head_dim_v)
    if extra_k_cache is not None:
        keys2, valid2 = _sparse_keys(extra_k_cache, extra_indices, extra_topk_length, is_fp8,
                                     head_dim, head_dim_v)
        keys, valid = torch.cat([keys, keys2], dim=2), torch.cat([valid, valid2], dim=2)
    return attend(q, keys, valid, head_dim_v, scale, attn_sink)


def _dense(q, k_cache, block_table, cache_seqlens, head_dim_v, scale, causal, is_fp8):
    seqlen_q = q.shape[1]
    page_size = k_cache.shape[1]
    if _model1(k_cache, is_fp8, q.shape[-1], head_dim_v):
        cache = dequantize_model1_pages(k_cache)
    else:
        cache = _as_float(k_cache, is_fp8, head_dim_v) if is_fp8 else k_cache
    k_lens = paged_lengths(block_table, cache_seqlens, page_size)                  # [b]
    keys, valid = gather_pages(cache, block_table, k_lens)                         # [b, T, 1, D]
    visible = valid[:, None, :].expand(-1, seqlen_q, -1)                           # [b, s, T]
    if causal:
        cols = torch.arange(keys.shape[1], device=q.device)
        last = (k_lens - seqlen_q)[:, None] + torch.arange(seqlen_q, device=q.device)
        visible = visible & (cols[None, None, :] <= last[:, :, None])
    return attend(q, keys[:, None, :, 0], visible, head_dim_v, scale, None)


@provider_table.register("flash_mla_with_kvcache", "reference")
def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
                           causal, is_fp8_kvcache, indices, attn_sink, extra_k_cache,
                           extra_indices_in_kvcache, topk_length, extra_topk_length):
    """Reference ``flash_mla_with_kvcache`` (contract: ``xpu_ops/ops/flash_mla_kvcache.py``).
    Returns ``(out [b, s_q, h_q, Dv], lse [b, h_q, s_q])``."""
    if indices is None:
        out, lse, _ = _dense(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
                             causal, is_fp8_kvcache)
    else:
        out, lse, _ = _sparse(q, k_cache, head_dim_v, softmax_scale, is_fp8_kvcache, indices,
                              attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
                              extra_topk_length)
    return _fresh(out, q.dtype), _fresh(lse.transpose(1, 2))


@provider_table.register("flash_mla_sparse_fwd", "reference")
def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    """Reference ``flash_mla_sparse_fwd`` (contract: ``xpu_ops/ops/mla_sparse_prefill.py``):
    each token is a request of one query row over its own top-k rows of ``kv``."""
    keys, valid = _sparse_keys(kv[:, None], indices, topk_length, False, q.shape[-1],
                               d_v)                                        # [s_q, 1, topk]
    out, lse, max_logits = attend(q[:, None], keys, valid, d_v, sm_scale, attn_sink)
    return _fresh(out[:, 0], q.dtype), _fresh(max_logits[:, 0]), _fresh(lse[:, 0])
