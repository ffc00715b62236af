"""``num_splits=1`` / ``num_kv_splits=1`` (deterministic inference) on the CPU reference
provider: a request's output (and LSE) has the same bits alone as in any batch, while the
batch's longest request sets how wide the padded key blocks are.

Every batch puts request 0 beside fresh random partners, most of them longer, over shuffled
pages; the outputs start NaN-poisoned and request 0's rows are also checked against the float64
oracle (a batch-invariant wrong answer would pass the bitwise comparison alone).
"""

from __future__ import annotations

import math

import pytest
import torch

import xpu_ops
from tests.compile.oracle import attention_oracle

HQ, HKV, D, R, RP = 4, 2, 32, 32, 16
LENS = [300, 1500, 5, 900, 64, 1200, 33, 700]       # request 0 first; partners mostly longer


class Pool:
    """One shuffled paged cache of ``len(LENS)`` requests, NaN past every request's keys."""

    def __init__(self, page_size: int, seed: int, width: int, heads: int = HKV):
        self.gen = torch.Generator().manual_seed(seed)
        self.ps = page_size
        pages_per = -(-max(LENS) // page_size)
        n = len(LENS) * pages_per + 1
        self.cache = torch.full((n, page_size, heads, width), math.nan)
        order = torch.randperm(n - 1, generator=self.gen) + 1
        self.table = order.view(len(LENS), pages_per).to(torch.int32)
        self.logical = []
        for r, length in enumerate(LENS):
            x = torch.randn(length, heads, width, generator=self.gen)
            slots = (self.table[r].long()[:, None] * page_size
                     + torch.arange(page_size)).view(-1)[:length]
            self.cache.view(-1, heads, width)[slots] = x
            self.logical.append(x)

    def rows(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cache_seqlens, page_table)`` of requests ``idx``, the table as wide as the
        longest of them (what a backend builds for that batch)."""
        lens = torch.tensor([LENS[i] for i in idx], dtype=torch.int32)
        width = -(-int(lens.max()) // self.ps)
        return lens, self.table[torch.tensor(idx), :width].contiguous()


BATCHES = [[0, 1], [0, 2, 3, 5], list(range(8)), [0, 7, 5]]


def _cu(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("rows_per_req", [1, 6], ids=["decode", "extend"])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "extras"])
def test_paged_attention_one_split_is_batch_invariant(page_size, rows_per_req, extras):
    """``extras``: sinks, softcap, a window, a left pad and the LSE (the CPU decode path's
    heads-first form); plain: none of them (its SDPA form)."""
    k = Pool(page_size, seed=page_size + rows_per_req, width=D)
    v = Pool(page_size, seed=page_size + rows_per_req, width=D)   # same pages, same values
    gen = torch.Generator().manual_seed(7)
    q_all = torch.randn(len(LENS) * rows_per_req, HQ, D, generator=gen)
    sinks = torch.randn(HQ, generator=gen) if extras else None
    leftpad_all = torch.tensor([3, 0, 1, 10, 0, 2, 0, 5] if extras else [0] * 8,
                               dtype=torch.int32)
    cap, window = (7.0, 250) if extras else (0.0, -1)

    def run(idx):
        lens, table = k.rows(idx)
        q = torch.cat([q_all[i * rows_per_req:(i + 1) * rows_per_req] for i in idx])
        out = torch.full_like(q, math.nan)
        res = xpu_ops.flash_attn_with_kvcache(
            q, k.cache, v.cache, cache_seqlens=lens, page_table=table,
            cu_seqlens_q=_cu([rows_per_req] * len(idx)), max_seqlen_q=rows_per_req,
            causal=True, softcap=cap, sinks=sinks, window_size=(window, 0),
            cache_leftpad=leftpad_all[torch.tensor(idx)] if extras else None, out=out,
            num_splits=1, return_softmax_lse=extras)
        lse = res[1][:, :rows_per_req] if extras else torch.empty(0)
        return out[:rows_per_req], lse

    alone, alone_lse = run([0])
    for idx in BATCHES:
        out, lse = run(idx)
        assert torch.equal(out, alone), f"batch {idx} changed request 0's output"
        assert torch.equal(lse, alone_lse), f"batch {idx} changed request 0's LSE"
    keys, vals = k.logical[0].double(), v.logical[0].double()
    pad = int(leftpad_all[0])
    expected = attention_oracle(q_all[:rows_per_req].double(), keys[pad:], vals[pad:],
                                scale=D ** -0.5, softcap=cap, sinks=sinks, window_left=window,
                                q_pos=[LENS[0] - pad - rows_per_req + i
                                       for i in range(rows_per_req)])
    torch.testing.assert_close(alone.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_mla_one_kv_split_is_batch_invariant(page_size, op):
    pool = Pool(page_size, seed=40 + page_size, width=R + RP, heads=1)
    n = 1 if op == "decode" else 5
    gen = torch.Generator().manual_seed(8)
    q_nope = torch.randn(len(LENS) * n, HQ, R, generator=gen)
    q_rope = torch.randn(len(LENS) * n, HQ, RP, generator=gen)
    scale = (R + RP) ** -0.5
    workspace = torch.empty(xpu_ops.flash_mla_decode_get_workspace_size(
        max(LENS), len(LENS), HQ, page_size, num_kv_splits=1), dtype=torch.uint8)

    def run(idx):
        lens, table = pool.rows(idx)
        sel = torch.cat([torch.arange(i * n, (i + 1) * n) for i in idx])
        kv = pool.cache.view(pool.cache.shape[0], page_size, R + RP)
        if op == "decode":
            out = xpu_ops.flash_mla_decode(q_nope[sel], q_rope[sel], kv, lens, table, workspace,
                                           scale, num_kv_splits=1)
        else:
            out = xpu_ops.flash_mla_prefill(q_nope[sel], q_rope[sel], kv,
                                            _cu([n] * len(idx)), lens, n, table, workspace,
                                            scale, causal=True, num_kv_splits=1)
        return out[:n]

    alone = run([0])
    for idx in BATCHES:
        assert torch.equal(run(idx), alone), f"batch {idx} changed request 0's output"
    lat = pool.logical[0].double()
    q = torch.cat([q_nope[:n], q_rope[:n]], -1).double()
    torch.testing.assert_close(alone.double(), attention_oracle(q, lat, lat[..., :R],
                                                                scale=scale),
                               atol=2e-5, rtol=2e-5)
