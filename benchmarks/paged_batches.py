"""Pools, backend and one ``ForwardBatch`` of a benchmark step (decode, extend or mixed).

Every request has ``context`` cached tokens and ``new_lens[r]`` new ones; the pools hold exactly
those tokens (plus the reserved padding page), and the batch's metadata is not built yet.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

import torch

from compile.backend import XPUAttentionBackend
from compile.batch import ForwardBatch, ForwardMode, MHATokenToKVPool, PageAllocator, ReqToTokenPool
from compile.engine.model_runner import ModelRunnerInfo


def paged_batch(new_lens: Sequence[int], context: int, mode: ForwardMode, *, num_heads: int,
                num_kv_heads: int, head_dim: int, num_layers: int, dtype: torch.dtype, device,
                page_size: int = 16) -> ForwardBatch:
    """A ``mode`` batch of ``len(new_lens)`` requests (DECODE: every ``new_lens[r]`` is 1;
    EXTEND/MIXED: ``extend_seq_lens = new_lens`` over ``extend_prefix_lens = context``)."""
    device, b = torch.device(device), len(new_lens)
    longest = context + max(new_lens)
    num_pages = sum(-(-(context + n) // page_size) for n in new_lens) + 1
    req_pool = ReqToTokenPool(b, longest, device)
    kv = MHATokenToKVPool(num_pages * page_size, page_size, dtype, num_kv_heads, head_dim,
                          num_layers, device)
    alloc = PageAllocator(num_pages, page_size, device)
    runner = ModelRunnerInfo(model_config=SimpleNamespace(
        context_len=longest, num_attention_heads=num_heads), tp_size=1,
        device=device, page_size=page_size, req_to_token_pool=req_pool, token_to_kv_pool=kv,
        kv_cache_dtype=kv.dtype)
    loc = torch.cat([alloc.alloc_extend(req_pool, r, 0, context + n)[-n:]
                     for r, n in enumerate(new_lens)])
    seq_lens_cpu = torch.tensor([context + n for n in new_lens], dtype=torch.int32)
    positions = torch.cat([torch.arange(context, context + n) for n in new_lens])
    extend = {}
    if mode != ForwardMode.DECODE:
        extend = dict(extend_seq_lens=torch.tensor(list(new_lens), dtype=torch.int32,
                                                   device=device),
                      extend_prefix_lens=torch.full((b,), context, dtype=torch.int32,
                                                    device=device))
    fb = ForwardBatch(forward_mode=mode, batch_size=b,
                      req_pool_indices=torch.arange(b, device=device),
                      seq_lens=seq_lens_cpu.to(device), seq_lens_cpu=seq_lens_cpu,
                      out_cache_loc=loc.to(device), positions=positions.to(device), **extend)
    fb.attn_backend, fb.token_to_kv_pool = XPUAttentionBackend(runner), kv
    fb.req_to_token_pool = req_pool
    return fb


def step_lens(kind: str, tokens: int) -> list[int]:
    """New tokens per request of an ``extend`` step (4 requests sharing ``tokens``) or a
    ``mixed`` step (one chunk of ``tokens - 7`` prompt tokens beside 7 decoding requests)."""
    if kind == "extend":
        return [tokens - 3 * (tokens // 4)] + [tokens // 4] * 3
    if kind == "mixed":
        return [tokens - 7] + [1] * 7
    raise ValueError(f"step_lens: kind {kind!r} is unknown; expected 'extend' or 'mixed'.")


__all__ = ["paged_batch", "step_lens"]
