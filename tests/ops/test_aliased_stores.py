"""Stores whose source rows are views of the cache they write (API.md "Writes"): every provider
reads each source row as it was before the call, whichever slots the call overwrites.

Before, the reference raised torch's internal "unsupported operation: some elements of the
input tensor and the written-to tensor refer to a single memory location" and Triton copied
rows that an earlier program had already overwritten.
"""

from __future__ import annotations

import pytest

from .triton_mode import provider_params, rerun_in_subprocess, running  # first

import torch  # noqa: E402

import xpu_ops  # noqa: E402

PROVIDERS = provider_params()
test_rerun_in_subprocess = rerun_in_subprocess(__file__)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("paged", [False, True], ids=["flat", "paged"])
def test_store_kv_cache_from_rows_of_the_same_cache(provider, paged):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(8, 2, 4, generator=gen), torch.randn(8, 2, 3, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    # rows 2..5 move one slot up, cyclically: each source row is also a destination
    loc = torch.tensor([3, 4, 5, 2])
    k, v = k_cache[2:6], v_cache[2:6]
    caches = ((k_cache.view(4, 2, 2, 4), v_cache.view(4, 2, 2, 3)) if paged
              else (k_cache, v_cache))
    with running(provider):
        xpu_ops.store_kv_cache(*caches, loc, k, v)
    k_want, v_want = k_before.clone(), v_before.clone()
    k_want[loc], v_want[loc] = k_before[2:6], v_before[2:6]
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_store_kv_cache_with_k_from_v_cache(provider):
    """k read from the other cache (same shapes): still the values before the call."""
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(6, 1, 4, generator=gen), torch.randn(6, 1, 4, generator=gen)
    v_before = v_cache.clone()
    loc = torch.tensor([0, 1])
    with running(provider):
        xpu_ops.store_kv_cache(k_cache, v_cache, loc, v_cache[1:3], v_cache[0:2].flip(0))
    assert torch.equal(k_cache[:2], v_before[1:3])
    assert torch.equal(v_cache[:2], v_before[0:2].flip(0))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_store_mla_kv_cache_from_rows_of_the_same_cache(provider):
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(6, 1, 6, generator=gen)
    before = cache.clone()
    loc = torch.tensor([2, 3, 1])
    with running(provider):
        xpu_ops.store_mla_kv_cache(cache, loc, cache[1:4, :, :4], cache[1:4, :, 4:])
    want = before.clone()
    want[loc] = before[1:4]
    assert torch.equal(cache, want)
