"""Hypothesis fuzzing of the DSA indexer's index-taking ops, bounded for a 2-core CI
(derandomized; ``XPU_OPS_HYPOTHESIS_EXAMPLES=500`` explores more, randomly): the index-key store
with slots that are valid, -1, past the cache, int32 or int64 extremes or repeated-free, into a
cache that is a view of a garbage-filled buffer, and top-k over rows whose lengths and starts
are extreme, loose or negative, with NaN and infinite scores. Both providers, value checks off:
neither crashes, writes outside the view or into a slot nobody addressed, and they agree (the
store byte for byte, top-k exactly). The values themselves are checked against the float64
oracle in ``test_dsa_indexer.py``."""

from __future__ import annotations

import os

import pytest

from .triton_mode import INTERPRETED, rerun_in_subprocess, running  # first

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import xpu_ops  # noqa: E402,F401
from xpu_ops.testing_layouts import outside_view_unchanged, strided_view  # noqa: E402

_EXAMPLES = int(os.environ.get("XPU_OPS_HYPOTHESIS_EXAMPLES", "0"))
PROVIDERS = ("reference", "triton")
test_rerun_in_subprocess = rerun_in_subprocess(__file__)
I32_MIN, I32_MAX = -2**31, 2**31 - 1
NUM_BLOCKS, BLOCK, DIM = 3, 4, 32
SLOTS = NUM_BLOCKS * BLOCK
pytestmark = pytest.mark.skipif(not INTERPRETED, reason="Triton was imported in compile "
                                "mode before this module; test_rerun_in_subprocess covers it")


def _settings(examples: int):
    return settings(max_examples=_EXAMPLES or examples, deadline=None,
                    derandomize=not _EXAMPLES, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


slot = st.one_of(st.integers(0, SLOTS - 1), st.sampled_from(
    [-1, SLOTS, SLOTS + 7, I32_MIN, I32_MAX, 2**40, -2**40]))


@_settings(12)
@given(slots=st.lists(slot, min_size=0, max_size=6, unique=True), seed=st.integers(0, 2**16),
       ue8m0=st.booleans())
def test_store_index_k_cache_clamps_alike_on_both_providers(slots, seed, ue8m0):
    gen = torch.Generator().manual_seed(seed)
    index_k = torch.randn(len(slots), DIM, generator=gen) * 4
    loc = torch.tensor(slots, dtype=torch.int64)
    results = []
    for provider in PROVIDERS:
        cache = strided_view(torch.randint(0, 256, (NUM_BLOCKS, BLOCK, 1, DIM + 4),
                                           generator=torch.Generator().manual_seed(seed),
                                           dtype=torch.uint8))
        base = (cache._base if cache._base is not None else cache).clone()
        before = cache.clone()
        with running(provider):
            torch.ops.xpu_ops.store_index_k_cache(cache, loc, index_k, ue8m0)
        assert outside_view_unchanged(cache, base)
        # a block holds its tokens' fp8 bytes, then their scales (DeepGEMM's paged layout):
        # blocks that no slot addresses keep every byte
        addressed = {s // BLOCK for s in slots if 0 <= s < SLOTS}
        for block in range(NUM_BLOCKS):
            if block not in addressed:
                assert torch.equal(cache[block], before[block]), block
        results.append(cache.clone())
    assert torch.equal(results[0], results[1])


score_value = st.sampled_from([0.0, 1.0, -1.0, 2.5, float("nan"), float("inf"), float("-inf"),
                               -0.0])
length = st.sampled_from([0, 1, 5, 9, 16, -1, I32_MIN, I32_MAX])


@_settings(12)
@given(rows=st.integers(1, 3), width=st.integers(1, 16), topk=st.sampled_from([1, 4, 8, 20]),
       lengths=st.lists(length, min_size=3, max_size=3),
       starts=st.one_of(st.none(), st.lists(st.sampled_from([0, 2, -3, I32_MAX, I32_MIN]),
                                            min_size=3, max_size=3)),
       specials=st.lists(score_value, min_size=0, max_size=6), seed=st.integers(0, 2**16))
def test_fast_topk_agrees_on_extreme_lengths_and_scores(rows, width, topk, lengths, starts,
                                                         specials, seed):
    gen = torch.Generator().manual_seed(seed)
    score = torch.randn(rows, width, generator=gen)
    flat = score.view(-1)
    for i, value in enumerate(specials):
        flat[(i * 7) % flat.numel()] = value
    lens = torch.tensor(lengths[:rows], dtype=torch.int32)
    row_starts = None if starts is None else torch.tensor(starts[:rows], dtype=torch.int32)
    results = []
    for provider in PROVIDERS:
        with running(provider):
            out = torch.ops.xpu_ops.fast_topk(strided_view(score), lens, row_starts, topk)
        assert out.shape == (rows, topk) and out.dtype == torch.int32
        chosen = out[out >= 0]
        assert bool(((chosen >= 0) & (chosen < width)).all()), out  # never past the row
        results.append(out)
    assert torch.equal(results[0], results[1]), (results, lens, row_starts)
