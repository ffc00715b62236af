"""Hostile fuzzing of the FlashMLA surface (hypothesis, derandomized, bounded for a 2-core CI;
``XPU_OPS_HYPOTHESIS_EXAMPLES=500`` explores more, randomly).

Wild metadata is legal input here (API.md, "FlashMLA surface"): sparse indices anywhere in
int32 (-1, other negatives, past the cache, ``2**31 - 1``), ``topk_length`` negative or past
``topk``, dense ``cache_seqlens`` negative or past the block table, block-table ids anywhere in
int32. Every provider survives, reads no slot outside the selection (every other slot is NaN),
and matches the float64 oracle; strided and expanded views of each tensor give the same result.
"""

from __future__ import annotations

import os

import pytest

from .triton_mode import provider_params, rerun_in_subprocess, running  # first

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import xpu_ops  # noqa: E402
from xpu_ops.testing_flash_mla import flashmla_cache, used_slots  # noqa: E402
from xpu_ops.testing_layouts import strided_view  # noqa: E402

from . import oracle_flash_mla as oracle  # noqa: E402
from .utils import assert_matches_oracle  # noqa: E402

_EXAMPLES = int(os.environ.get("XPU_OPS_HYPOTHESIS_EXAMPLES", "0"))
PROVIDERS = provider_params()
I32 = torch.int32
INT32_MAX = 2 ** 31 - 1
test_rerun_in_subprocess = rerun_in_subprocess(__file__)
wild = st.sampled_from([-1, -7, -INT32_MAX - 1, INT32_MAX, 10 ** 6])


def _settings(examples: int):
    return settings(max_examples=_EXAMPLES or examples, deadline=None,
                    derandomize=not _EXAMPLES, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


def _run(args, provider):
    with running(provider):
        out, lse = torch.ops.xpu_ops.flash_mla_with_kvcache(*args)
    expected, expected_lse = oracle.flash_mla_with_kvcache(*args)
    assert_matches_oracle(out, expected, args[0].dtype, lse, expected_lse)


@pytest.mark.parametrize("provider", PROVIDERS)
@_settings(10)
@given(b=st.integers(1, 2), s_q=st.integers(1, 2), topk=st.integers(1, 20),
       pages=st.tuples(st.integers(0, 3), st.sampled_from([1, 4])), fp8=st.booleans(),
       wild_values=st.lists(wild, min_size=1, max_size=4), lengths=st.lists(
           st.integers(-3, 25), min_size=2, max_size=2), strided=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_sparse_wild_indices_and_lengths(provider, b, s_q, topk, pages, fp8, wild_values,
                                         lengths, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    slots = pages[0] * pages[1]
    indices = torch.randint(0, max(slots, 1), (b, s_q, topk), generator=gen)
    spots = torch.randint(0, b * s_q * topk, (len(wild_values),), generator=gen)
    indices.view(-1)[spots] = torch.tensor(wild_values)
    indices = indices.to(I32)
    length = torch.tensor(lengths[:b], dtype=I32)
    head_dim, head_dim_v = (160, 128) if fp8 else (24, 16)
    used = used_slots(slots, indices, length).view(pages)
    cache = flashmla_cache(torch.randn(*pages, head_dim, generator=gen), used, head_dim_v, fp8,
                           torch.float32)
    q = torch.randn(b, s_q, 2, head_dim, generator=gen)
    if strided:
        q, indices, length = strided_view(q), strided_view(indices), strided_view(length)
    _run([q, cache, None, None, head_dim_v, 0.3, False, fp8, indices, None, None, None, length,
          None], provider)


@pytest.mark.parametrize("provider", PROVIDERS)
@_settings(10)
@given(b=st.integers(1, 3), s_q=st.integers(1, 3), causal=st.booleans(),
       seqlens=st.lists(st.sampled_from([-5, 0, 1, 3, 9, 12, 40, INT32_MAX]), min_size=3,
                        max_size=3),
       ids=st.lists(wild, min_size=0, max_size=3), fp8=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_dense_wild_lengths_and_page_ids(provider, b, s_q, causal, seqlens, ids, fp8, seed):
    """Lengths clamp into ``[0, block_table.shape[1] * page_size]``; an id outside the cache
    hides its page; pages and slots no request reads are NaN."""
    gen = torch.Generator().manual_seed(seed)
    num_pages, page_size, width = 5, 4, 3
    table = torch.randint(0, num_pages, (b, width), generator=gen)
    spots = torch.randint(0, b * width, (len(ids),), generator=gen)
    table.view(-1)[spots] = torch.tensor(ids, dtype=torch.int64)
    table = table.to(I32)
    lens = torch.tensor(seqlens[:b], dtype=I32)
    used = torch.zeros(num_pages, page_size, dtype=torch.bool)
    for i in range(b):
        n = max(0, min(int(lens[i]), width * page_size))
        for j in range(n):
            page = int(table[i, j // page_size])
            if 0 <= page < num_pages:
                used[page, j % page_size] = True
    head_dim, head_dim_v = (160, 128) if fp8 else (24, 16)
    cache = flashmla_cache(torch.randn(num_pages, page_size, head_dim, generator=gen), used,
                           head_dim_v, fp8, torch.float32)
    q = torch.randn(b, s_q, 2, head_dim, generator=gen)
    _run([q, cache, table, lens, head_dim_v, 0.3, causal, fp8, None, None, None, None, None,
          None], provider)
