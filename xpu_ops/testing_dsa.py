"""Sample inputs of the DSA indexer ops (``xpu_ops.testing.sample_inputs`` serves them).

Adversarial as the other samples: index-key cache slots that no query reads hold NaN bytes
(values and scales), unused block-table entries hold out-of-range ids, block tables are
shuffled, key ranges are empty or run past the keys, top-k rows hold ties, NaN and ``-inf``,
and store slots include ``-1`` and out-of-range entries.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .index_k_layout import SCALE_BYTES, split_blocks
from .testing import _randn, _sampler

E4M3 = torch.float8_e4m3fn
I32 = torch.int32
_BAD_BLOCK = 1 << 20


def _fp8(gen, *shape, device, scale=1.0) -> Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(E4M3).to(device)


def _ints(values, device, dtype=I32) -> Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


@_sampler("fp8_mqa_logits")
def _fp8_mqa_logits_samples(device, dtype, gen):
    # (seq_len, seq_len_kv, H, D, ks, ke, clean_logits, max_seqlen_k)
    for s, skv, h, d, ks, ke, clean, width in (
            (5, 12, 4, 32, (0, 0, 0, 6, 6), (7, 8, 9, 11, 12), True, 0),     # prefix + causal
            (4, 7, 16, 64, (2, -3, 5, 0), (2, 4, 9, 7), False, 0),           # empty, clamped
            (4, 10, 2, 16, (0, 3, 5, 9), (4, 6, 10, 10), True, 6),           # compressed, loose
            (3, 6, 1, 8, (0, 1, 2), (6, 6, 6), True, 0),                     # one head
            (0, 5, 4, 16, (), (), True, 0),                                  # no query
            (3, 0, 4, 16, (0, 0, 0), (0, 0, 0), True, 0)):                   # no key
        q = _fp8(gen, s, h, d, device=device)
        k = _fp8(gen, skv, d, device=device)
        k_scale = (torch.rand(skv, generator=gen) + 0.1).to(device)
        weights = _randn(gen, s, h, device=device)
        yield ((q, k, k_scale, weights, _ints(ks, device), _ints(ke, device), clean, width), {})


def paged_index_k_cache(gen, block_table: Tensor, lens: list[int], block_size: int, dim: int,
                        num_blocks: int) -> Tensor:
    """A fused index-key cache ``[num_blocks, block_size, 1, dim + 4]`` whose slots of positions
    ``< lens[i]`` of request ``i`` (through ``block_table``) hold fp8 keys and positive scales,
    every other byte NaN (0x7F in values and scales)."""
    cache = torch.full((num_blocks, block_size, 1, dim + SCALE_BYTES), 0x7F, dtype=torch.uint8)
    values, scales = split_blocks(cache)
    for i, n in enumerate(lens):
        for pos in range(n):
            blk, row = int(block_table[i, pos // block_size]), pos % block_size
            values[blk, row] = (torch.randn(dim, generator=gen)).to(E4M3).view(torch.uint8)
            scales[blk, row] = float(torch.rand(1, generator=gen)) + 0.1
    return cache


def _block_table(gen, lens, block_size, width, num_blocks) -> Tensor:
    """Shuffled distinct blocks for each request's used positions; the rest out of range."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(lens), width), _BAD_BLOCK, dtype=I32)
    for i, n in enumerate(lens):
        used = min(-(-n // block_size), width)
        table[i, :used] = torch.tensor([perm.pop() for _ in range(used)], dtype=I32)
    return table


@_sampler("fp8_paged_mqa_logits")
def _fp8_paged_mqa_logits_samples(device, dtype, gen):
    # (next_n, H, D, block_size, table width, context_lens, max_context_len)
    for next_n, h, d, bs, width, ctx, max_len in (
            (1, 4, 32, 4, 3, (5, 1, 9), 12),
            (2, 8, 16, 8, 2, (10, 3), 16),                      # MTP: causal among next_n
            (3, 2, 64, 4, 2, ((4, 6, 7), (0, 2, 1)), 8),        # 2-D context_lens
            (1, 16, 32, 2, 4, (7, 0), 5),                       # width cut below capacity
            (1, 4, 16, 4, 2, (20,), 8),                         # longer than its table
            (1, 4, 16, 4, 2, (), 8)):                           # empty batch
        lens = [max(c) if isinstance(c, tuple) else c for c in ctx]
        b = len(ctx)
        num_blocks = b * width + 2
        table = _block_table(gen, lens, bs, width, num_blocks)
        cache = paged_index_k_cache(gen, table, [min(n, width * bs) for n in lens], bs, d,
                                    num_blocks)
        q = _fp8(gen, b, next_n, h, d, device=device)
        weights = _randn(gen, b * next_n, h, device=device)
        context_lens = torch.tensor(ctx, dtype=I32).reshape(b, -1 if ctx and isinstance(
            ctx[0], tuple) else 1)
        context_lens = context_lens if context_lens.shape[1] > 1 else context_lens[:, 0]
        yield ((q, cache.to(device), weights, context_lens.to(device), table.to(device),
                max_len, True), {})


def _scores(gen, rows, width, device) -> Tensor:
    """Scores with ties (few distinct values), a NaN, ``-inf``, ``+inf`` and ``-0.0``."""
    score = torch.randint(-4, 5, (rows, width), generator=gen).float() * 0.5
    score += torch.randn(rows, width, generator=gen) * (torch.rand(rows, 1, generator=gen) > 0.5)
    flat = score.view(-1)
    for i, value in enumerate((float("nan"), -float("inf"), float("inf"), -0.0)):
        if flat.numel() > 4 * i:
            flat[(7 * i + 3) % flat.numel()] = value
    return score.to(device)


# (rows, width, lengths, row_starts or None, topk)
_TOPK_CASES = (
    (4, 20, (20, 5, 0, 13), None, 8),
    (3, 30, (10, 15, 10), (0, 10, 25), 6),          # ragged rows; the last runs past the width
    (2, 5, (5, 3), None, 8),                        # topk beyond the width: -1 padding
    (3, 16, (16, -2, 9), (0, 3, 40), 4),            # negative length, start past the width
    (0, 8, (), None, 4),                            # no row
    (2, 4500, (4500, 4097), None, 2048))            # several radix and compaction blocks


@_sampler("fast_topk")
def _fast_topk_samples(device, dtype, gen):
    for rows, width, lengths, starts, topk in _TOPK_CASES:
        yield ((_scores(gen, rows, width, device), _ints(lengths, device),
                None if starts is None else _ints(starts, device), topk), {})


@_sampler("fast_topk_transform")
def _fast_topk_transform_samples(device, dtype, gen):
    # cu_seqlens_q per case: rows per request (the last case covers only part of its rows)
    cus = ((0, 1, 3, 3, 4), (0, 3), (0, 1, 2), (0, 2), (0, 0), (0, 1, 2))
    for (rows, width, lengths, starts, topk), cu in zip(_TOPK_CASES, cus):
        b = len(cu) - 1
        table = torch.randint(0, 1000, (b, width + 1), generator=gen, dtype=I32)
        yield ((_scores(gen, rows, width, device), _ints(lengths, device), table.to(device),
                _ints(cu, device), None if starts is None else _ints(starts, device), topk), {})


@_sampler("store_index_k_cache")
def _store_index_k_cache_samples(device, dtype, gen):
    # (num_blocks, block_size, D, loc, loc dtype, ue8m0, dtype)
    for nb, bs, d, loc, loc_dt, ue8m0, dt in (
            (3, 4, 32, (5, -1, 11, 0, 12), torch.int64, False, torch.float32),
            (2, 8, 16, (15, 2, 7, 8), torch.int32, True, torch.bfloat16),
            (4, 2, 64, (3, 6, 1), torch.int64, False, torch.float16),
            (2, 4, 8, (7, 1000, -5), torch.int64, True, torch.float32),
            (2, 4, 16, (), torch.int64, False, torch.float32)):
        dt = dtype or dt
        cache = torch.randint(0, 256, (nb, bs, 1, d + SCALE_BYTES), generator=gen,
                              dtype=torch.uint8)
        index_k = _randn(gen, len(loc), d, dtype=dt, device=device, scale=3.0)
        yield ((cache.to(device), _ints(loc, device, loc_dt), index_k, ue8m0), {})


@_sampler("hadamard_transform")
def _hadamard_transform_samples(device, dtype, gen):
    # (shape, dtype, scale)
    for shape, dt, scale in (((3, 128), torch.float32, 128 ** -0.5),
                             ((2, 3, 16), torch.bfloat16, 1.0),
                             ((4, 12), torch.float16, 0.25),           # not a power of two
                             ((5, 1), torch.float32, -2.0),
                             ((0, 8), torch.float32, 1.0)):
        yield ((_randn(gen, *shape, dtype=dtype or dt, device=device), scale), {})
