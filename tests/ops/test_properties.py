"""Property tests (hypothesis) over random batch compositions, bounded for a 2-core CI.

Shapes and flags are drawn by hypothesis, values come from a drawn seed. CI runs a fixed,
derandomized set of examples; ``XPU_OPS_HYPOTHESIS_EXAMPLES=500`` explores more, randomly.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import xpu_ops
from xpu_ops.testing import paged_kv_cache

from . import oracle
from .utils import OUT_TOL, assert_matches_oracle, runnable_providers

_EXAMPLES = int(os.environ.get("XPU_OPS_HYPOTHESIS_EXAMPLES", "0"))
SETTINGS = settings(max_examples=_EXAMPLES or 20, deadline=None, derandomize=not _EXAMPLES,
                    database=None, suppress_health_check=[HealthCheck.too_slow])
I32 = torch.int32

requests = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 19)), min_size=1, max_size=4)
heads = st.sampled_from([(1, 1), (4, 1), (6, 2), (4, 4), (6, 3), (8, 2)])
windows = st.tuples(st.sampled_from([-1, 0, 1, 5]), st.sampled_from([-1, 0, 2]))


@pytest.mark.parametrize("provider", runnable_providers("flash_attn_with_kvcache"))
@SETTINGS
@given(reqs=requests, page_size=st.sampled_from([1, 3, 4, 16]), hq_hkv=heads,
       d=st.sampled_from([16, 64]), causal=st.booleans(), window=windows,
       softcap=st.sampled_from([0.0, 3.0]), sinks=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_paged_attention_random_batches(provider, reqs, page_size, hq_hkv, d, causal, window,
                                        softcap, sinks, seed):
    """Request = (new tokens, cached prefix); keys = prefix + new tokens."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = hq_hkv
    q_lens = [lq for lq, _ in reqs]
    k_lens = [lq + prefix for lq, prefix in reqs]
    (k_cache, v_cache), page_table, cache_seqlens = paged_kv_cache(
        gen, k_lens, page_size, [(hkv, d), (hkv, d)], dtype=torch.float32, device="cpu")
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    cu = torch.tensor([0] + q_lens, dtype=I32).cumsum(0, dtype=I32)
    sink = torch.randn(hq, generator=gen) if sinks else None
    with xpu_ops.use_provider(provider):
        out, lse = xpu_ops.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
            cu_seqlens_q=cu, max_seqlen_q=max(q_lens), causal=causal, window_size=window,
            softcap=softcap, sinks=sink, return_softmax_lse=True)
    left, right = window
    out64, lse64 = oracle.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens, page_table, cu, None, None, None, None, None, sink,
        max_seqlen_q=max(q_lens), softmax_scale=d ** -0.5, causal=causal,
        window_size_left=left, window_size_right=right, softcap=softcap)
    assert_matches_oracle(out, out64, torch.float32, lse, lse64)


@pytest.mark.parametrize("provider", runnable_providers("merge_state_v2"))
@SETTINGS
@given(q_len=st.integers(1, 4), k_lens=st.tuples(st.integers(0, 9), st.integers(0, 9)),
       hq_hkv=heads, seed=st.integers(0, 2 ** 16))
def test_attention_over_a_split_equals_merge_of_parts(provider, q_len, k_lens, hq_hkv, seed):
    """Cascade attention: attending to keys A then B and merging by LSE equals attending to A+B
    (non-causal), which ties varlen attention, its LSE and merge_state_v2 together."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = hq_hkv
    n_a, n_b = k_lens
    q = torch.randn(q_len, hq, 32, generator=gen)
    k, v = torch.randn(n_a + n_b, hkv, 32, generator=gen), torch.randn(n_a + n_b, hkv, 16,
                                                                       generator=gen)
    cu_q = torch.tensor([0, q_len], dtype=I32)

    def part(lo, hi):
        return xpu_ops.flash_attn_varlen_func(q, k[lo:hi], v[lo:hi], cu_q,
                                              torch.tensor([0, hi - lo], dtype=I32),
                                              return_softmax_lse=True)

    with xpu_ops.use_provider(provider):
        (o_a, s_a), (o_b, s_b) = part(0, n_a), part(n_a, n_a + n_b)
        merged, lse = xpu_ops.merge_state_v2(o_a, s_a.t().contiguous(), o_b,
                                             s_b.t().contiguous())
    expected, expected_lse = oracle.attend(q, k, v, torch.ones(q_len, n_a + n_b, dtype=torch.bool),
                                           scale=32 ** -0.5)
    assert_matches_oracle(merged, expected, torch.float32, lse.t(), expected_lse)


@SETTINGS
@given(k_lens=st.lists(st.integers(1, 12), min_size=1, max_size=3),
       page_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2 ** 16))
def test_store_then_attend_sees_the_new_token(k_lens, page_size, seed):
    """Writing each request's last token through ``store_kv_cache`` then decoding reads it:
    the output equals the oracle over the updated cache, and no other slot changed."""
    gen = torch.Generator().manual_seed(seed)
    hkv, hq, d = 2, 4, 16
    (k_cache, v_cache), page_table, cache_seqlens = paged_kv_cache(
        gen, k_lens, page_size, [(hkv, d), (hkv, d)], dtype=torch.float32, device="cpu")
    last = cache_seqlens.long() - 1
    loc = page_table.long().gather(1, (last // page_size)[:, None])[:, 0] * page_size \
        + last % page_size
    new_k, new_v = (torch.randn(len(k_lens), hkv, d, generator=gen) for _ in range(2))
    before = k_cache.clone()
    xpu_ops.store_kv_cache(k_cache, v_cache, loc, new_k, new_v)
    changed = (k_cache.flatten(0, 1) != before.flatten(0, 1)) & ~before.flatten(0, 1).isnan()
    assert set(torch.nonzero(changed.flatten(1).any(1)).flatten().tolist()) <= set(loc.tolist())
    q = torch.randn(len(k_lens), hq, d, generator=gen)
    cu = torch.arange(len(k_lens) + 1, dtype=I32)
    out = xpu_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                          page_table=page_table, cu_seqlens_q=cu, causal=True)
    for r in range(len(k_lens)):
        keys = oracle.paged_keys(k_cache, page_table, r, k_lens[r])
        values = oracle.paged_keys(v_cache, page_table, r, k_lens[r])
        assert torch.equal(keys[-1], new_k[r].double())
        expected, _ = oracle.attend(q[r:r + 1], keys, values,
                                    torch.ones(1, k_lens[r], dtype=torch.bool), scale=d ** -0.5)
        torch.testing.assert_close(out[r:r + 1].double(), expected, **OUT_TOL[torch.float32])
