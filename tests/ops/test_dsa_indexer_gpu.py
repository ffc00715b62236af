"""DSA indexer ops at DeepSeek-V3.2's sizes (64 heads, D = 128, block 64, top-2048) on the GPU,
every provider against float64 math done on the device (dequantise, then einsum in float64).
Marked ``gpu``: ``pytest -m gpu tests/ops/test_dsa_indexer_gpu.py`` on the GPU machine."""

from __future__ import annotations

import math

import pytest
import torch

import xpu_ops
from xpu_ops import providers

from ..markers import GPU_DEVICE, requires_gpu

pytestmark = requires_gpu
DEVICE = GPU_DEVICE or "cuda"
E4M3 = torch.float8_e4m3fn
I32 = torch.int32


def _providers(op):
    return [pytest.param(name, id=name, marks=() if reason is None else pytest.mark.skip(
        reason=reason)) for name, reason in providers.candidates(op, DEVICE)]


def _weighted(q64, k64, scale64, w64):
    """[rows, H, D] x [keys, D] -> sum_h w relu(scale * q.k) and its magnitude bound."""
    dots = torch.einsum("rhd,jd->rhj", q64, k64) * scale64
    return (torch.einsum("rhj,rh->rj", dots.clamp(min=0), w64),
            torch.einsum("rhj,rh->rj", dots.abs(), w64.abs()))


def _assert_logits(got, want, bound):
    assert torch.equal(got == -math.inf, want == -math.inf)
    finite = want != -math.inf
    err = (got.double() - want).abs()[finite]
    assert bool((err <= 2e-5 * bound[finite] + 1e-5).all())


@pytest.mark.parametrize("provider", _providers("fp8_mqa_logits"))
def test_fp8_mqa_logits_prefill_with_prefix(provider):
    gen = torch.Generator(DEVICE).manual_seed(1)
    s, prefix, h, d = 1024, 3072, 64, 128
    q = torch.randn(s, h, d, device=DEVICE, generator=gen).to(E4M3)
    k = torch.randn(prefix + s, d, device=DEVICE, generator=gen).to(E4M3)
    scale = torch.rand(prefix + s, device=DEVICE, generator=gen) + 0.1
    w = torch.randn(s, h, device=DEVICE, generator=gen)
    ks = torch.zeros(s, dtype=I32, device=DEVICE)
    ke = torch.arange(s, dtype=I32, device=DEVICE) + prefix + 1
    with xpu_ops.use_provider(provider):
        got = xpu_ops.fp8_mqa_logits(q, (k, scale), w, ks, ke)
    want, bound = _weighted(q.double(), k.double(), scale.double(), w.double())
    cols = torch.arange(prefix + s, device=DEVICE)
    inside = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
    _assert_logits(got, torch.where(inside, want, -math.inf), bound)


@pytest.mark.parametrize("provider", _providers("fp8_paged_mqa_logits"))
@pytest.mark.parametrize("next_n", [1, 2])
def test_fp8_paged_mqa_logits_decode(provider, next_n):
    gen = torch.Generator(DEVICE).manual_seed(2)
    b, h, d, bs, max_len = 8, 64, 128, 64, 8192
    lens = torch.randint(next_n, max_len, (b,), device=DEVICE, generator=gen, dtype=I32)
    width = max_len // bs
    num_blocks = b * width
    table = torch.randperm(num_blocks, device=DEVICE, generator=gen).to(I32).view(b, width)
    cache = torch.zeros(num_blocks, bs, 1, d + 4, dtype=torch.uint8, device=DEVICE)
    keys = torch.randn(num_blocks * bs, d, device=DEVICE, generator=gen) * 2
    xpu_ops.store_index_k_cache(cache, torch.arange(num_blocks * bs, device=DEVICE), keys)
    q = torch.randn(b, next_n, h, d, device=DEVICE, generator=gen).to(E4M3)
    w = torch.randn(b * next_n, h, device=DEVICE, generator=gen)
    meta = xpu_ops.get_paged_mqa_logits_metadata(lens, bs, 132)
    with xpu_ops.use_provider(provider):
        got = xpu_ops.fp8_paged_mqa_logits(q, cache, w, lens, table, meta, max_len)
    # float64 oracle: each request's keys gathered position by position from the stored bytes
    flat = cache.view(num_blocks, -1)
    values = flat[:, :bs * d].view(E4M3).view(num_blocks, bs, d).double()
    scales = flat[:, bs * d:].contiguous().view(torch.float32).view(num_blocks, bs).double()
    pos = torch.arange(max_len, device=DEVICE)
    blk = table.long()[:, pos // bs]                                           # [b, W]
    want = torch.full((b * next_n, max_len), -math.inf, dtype=torch.float64, device=DEVICE)
    bound = torch.zeros_like(want)
    for i in range(b):
        k64, s64 = values[blk[i], pos % bs], scales[blk[i], pos % bs]
        rows = slice(i * next_n, (i + 1) * next_n)
        logits, mag = _weighted(q[i].double(), k64, s64, w[rows].double())
        limit = lens[i] - next_n + torch.arange(next_n, device=DEVICE) + 1
        want[rows] = torch.where(pos[None, :] < limit[:, None], logits, -math.inf)
        bound[rows] = mag
    _assert_logits(got, want, bound)


@pytest.mark.parametrize("provider", _providers("fast_topk"))
def test_fast_topk_2048_of_long_rows(provider):
    gen = torch.Generator(DEVICE).manual_seed(3)
    rows, width, topk = 64, 65536, 2048
    score = torch.randn(rows, width, device=DEVICE, generator=gen)
    score[::4] = score[::4].round()                                   # many ties
    lengths = torch.randint(1, width + 1, (rows,), device=DEVICE, generator=gen, dtype=I32)
    lengths[0] = 100
    with xpu_ops.use_provider(provider):
        got = xpu_ops.fast_topk_v2(score, lengths, topk)
    pos = torch.arange(width, device=DEVICE)
    vals = torch.where(pos[None, :] < lengths[:, None], score.double(), -math.inf)
    order = torch.sort(vals, dim=1, descending=True, stable=True).indices[:, :topk]
    order = torch.where(order < lengths[:, None].long(), order, width)
    want = torch.sort(order, dim=1).values
    want = torch.where(want < width, want, -1).to(I32)
    assert torch.equal(got, want)
