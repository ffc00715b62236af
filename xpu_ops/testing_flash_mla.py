"""Sample inputs of the FlashMLA surface (``flash_mla_with_kvcache``, ``flash_mla_sparse_fwd``),
registered with ``xpu_ops.testing.sample_inputs``; helpers the tests reuse to build caches.

Adversarial as the other samples: cache slots that no valid index (or no request's length)
reaches hold NaN (fp8 tokens: all bytes 0xFF, NaN in each part), indices mix -1, slots past the
cache and ranks past ``topk_length``, some query rows have no valid key at all, and sinks
include +inf and -inf.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .mla_fp8_layout import quantize_fp8_tokens
from .testing import _randn, _sampler, paged_kv_cache


def flashmla_cache(values: Tensor, used: Tensor, head_dim_v: int, is_fp8: bool,
                   dtype: torch.dtype) -> Tensor:
    """``values [num_blocks, page_size, D]`` float32 as a ``[num_blocks, page_size, 1, X]``
    cache (``dtype``, or FlashMLA fp8 bytes), every slot not in ``used`` (bool, same leading
    shape) NaN."""
    if is_fp8:
        cache = quantize_fp8_tokens(values.nan_to_num(0.0), head_dim_v).view(torch.uint8).clone()
        cache[~used] = 0xFF
        return cache.view(torch.float8_e4m3fn)[:, :, None]
    return torch.where(used[..., None], values, float("nan")).to(dtype)[:, :, None]


def sparse_indices(gen, batch: int, seqlen_q: int, topk: int, slots: int,
                   past: Optional[int] = None) -> Tensor:
    """Random ``[b, s_q, topk]`` int32 slots in ``[0, slots)``, about a quarter replaced by -1
    or ``past`` (default ``slots``: the first slot past the cache); row ``(0, 0)`` holds no
    valid slot at all."""
    idx = torch.randint(0, max(slots, 1), (batch, seqlen_q, topk), generator=gen)
    bad = torch.rand(batch, seqlen_q, topk, generator=gen) < 0.25
    past = slots if past is None else past
    junk = torch.where(torch.rand(batch, seqlen_q, topk, generator=gen) < 0.5, -1, past)
    idx = torch.where(bad, junk, idx)
    idx[0, 0] = -1
    return idx.to(torch.int32)


def used_slots(slots: int, indices: Tensor, length: Optional[Tensor]) -> Tensor:
    """``[slots]`` bool: slots some valid index within ``length`` selects."""
    ranks = torch.arange(indices.shape[-1])
    ok = (indices >= 0) & (indices < slots)
    if length is not None:
        ok = ok & (ranks < length.view(-1, *([1] * (indices.dim() - 1))))
    used = torch.zeros(slots + 1, dtype=torch.bool)
    used[torch.where(ok, indices.long(), slots)] = True
    return used[:slots]


def _sparse_cache(gen, num_blocks, page_size, head_dim, head_dim_v, indices, length, is_fp8,
                  dtype):
    """A cache of ``num_blocks`` pages the indices address plus one spare page (all garbage)."""
    num_blocks += 1
    slots = num_blocks * page_size
    used = used_slots(slots, indices, length).view(num_blocks, page_size)
    values = torch.randn(num_blocks, page_size, head_dim, generator=gen)
    return flashmla_cache(values, used, head_dim_v, is_fp8, dtype)


def _dense_case(gen, k_lens, seqlen_q, h, head_dim, head_dim_v, page_size, dtype, causal,
                is_fp8, device):
    (values,), table, seqlens = paged_kv_cache(gen, k_lens, page_size, [(head_dim,)],
                                               dtype=torch.float32, device="cpu")
    cache = flashmla_cache(values, ~values.isnan().any(-1), head_dim_v, is_fp8, dtype)
    q = _randn(gen, len(k_lens), seqlen_q, h, head_dim, dtype=dtype, device=device)
    return (q, cache.to(device), table.to(device), seqlens.to(device), head_dim_v,
            head_dim ** -0.5, causal, is_fp8, None, None, None, None, None, None)


def _sparse_case(gen, batch, seqlen_q, h, head_dim, head_dim_v, pages, topk, dtype, is_fp8,
                 sink, extra, device):
    num_blocks, page_size = pages
    indices = sparse_indices(gen, batch, seqlen_q, topk, num_blocks * page_size,
                             (num_blocks + 1) * page_size)
    length = torch.randint(0, topk + 1, (batch,), generator=gen).to(torch.int32)
    cache = _sparse_cache(gen, num_blocks, page_size, head_dim, head_dim_v, indices, length,
                          is_fp8, dtype)
    extra_cache = extra_idx = extra_len = None
    if extra is not None:
        blocks2, page2, topk2 = extra
        extra_idx = sparse_indices(gen, batch, seqlen_q, topk2, blocks2 * page2,
                                   (blocks2 + 1) * page2)
        extra_len = torch.randint(0, topk2 + 1, (batch,), generator=gen).to(torch.int32)
        extra_cache = _sparse_cache(gen, blocks2, page2, head_dim, head_dim_v, extra_idx,
                                    extra_len, is_fp8, dtype)
    attn_sink = None
    if sink:
        attn_sink = torch.randn(h, generator=gen)
        attn_sink[0], attn_sink[-1] = math.inf, -math.inf
    q = _randn(gen, batch, seqlen_q, h, head_dim, dtype=dtype, device=device)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return (q, cache.to(device), None, None, head_dim_v, 0.3 * head_dim ** -0.5, False, is_fp8,
            indices.to(device), move(attn_sink), move(extra_cache), move(extra_idx),
            length.to(device), move(extra_len))


@_sampler("flash_mla_with_kvcache")
def _flash_mla_with_kvcache_samples(device, dtype, gen):
    fp32, bf16, fp16 = torch.float32, torch.bfloat16, torch.float16
    # dense: (k_lens, s_q, H, D, Dv, page_size, dtype, causal, fp8); a request with fewer keys
    # than queries (its first causal rows see nothing), an empty cache, fp8 pages
    for k_lens, seqlen_q, h, d, dv, page, dt, causal, fp8 in (
            ((9, 1, 30), 1, 4, 80, 64, 16, fp32, False, False),
            ((17, 2), 3, 16, 576, 512, 64, bf16, True, False),
            ((0, 7), 2, 2, 288, 256, 4, fp16, True, True),
            ((5, 12), 4, 3, 48, 32, 4, fp32, False, False)):
        yield _dense_case(gen, k_lens, seqlen_q, h, d, dv, page, dtype or dt, causal, fp8,
                          device), {}
    # sparse: (b, s_q, H, D, Dv, (blocks, page_size), topk, dtype, fp8, sink, extra cache)
    for b, seqlen_q, h, d, dv, pages, topk, dt, fp8, sink, extra in (
            (2, 2, 4, 80, 64, (3, 4), 6, fp32, False, False, None),
            (2, 1, 8, 288, 256, (4, 2), 5, bf16, True, True, (3, 2, 4)),
            (1, 3, 16, 576, 512, (2, 8), 8, bf16, True, False, None),
            (3, 2, 2, 48, 32, (5, 1), 4, fp16, False, True, (2, 4, 3))):
        args = _sparse_case(gen, b, seqlen_q, h, d, dv, pages, topk, dtype or dt, fp8, sink,
                            extra, device)
        if b == 1:      # sgl-kernel's callers pass block_table and cache_seqlens too (unused)
            args = (*args[:2], torch.zeros(b, 2, dtype=torch.int32, device=device),
                    torch.full((b,), 3, dtype=torch.int32, device=device), *args[4:])
        yield args, {}


@_sampler("flash_mla_sparse_fwd")
def _flash_mla_sparse_fwd_samples(device, dtype, gen):
    # (s_q, H, d_qk, d_v, s_kv, topk, dtype, sink, topk_length)
    for seqlen_q, h, d, dv, s_kv, topk, dt, sink, with_length in (
            (3, 4, 80, 64, 10, 5, torch.float32, False, False),
            (2, 16, 576, 512, 20, 8, torch.bfloat16, True, True),
            (4, 2, 48, 32, 6, 3, torch.float16, True, True),
            (0, 2, 48, 32, 4, 2, torch.float32, False, False)):
        dt = dtype or dt
        indices = sparse_indices(gen, max(seqlen_q, 1), 1, topk, s_kv)[:seqlen_q]
        length = None
        if with_length:
            length = torch.randint(0, topk + 1, (seqlen_q,), generator=gen).to(torch.int32)
        used = used_slots(s_kv, indices, length)
        kv = torch.where(used[:, None], torch.randn(s_kv, d, generator=gen), float("nan"))
        attn_sink = None
        if sink:
            attn_sink = torch.randn(h, generator=gen)
            attn_sink[0] = math.inf
        q = _randn(gen, seqlen_q, h, d, dtype=dt, device=device)
        yield ((q, kv[:, None].to(dt).to(device), indices.to(device), 0.3 * d ** -0.5, dv,
                None if attn_sink is None else attn_sink.to(device),
                None if length is None else length.to(device)), {})


__all__ = ["flashmla_cache", "sparse_indices", "used_slots"]
