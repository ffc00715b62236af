"""Hostile fuzz of the decode split-KV plan (``xpu_ops.triton.split_plan``): extreme key
bounds (0, 1, 2**31 - 1 and beyond), empty to huge grids, one resident slot or none, one
multiprocessor. Expectations come from the plan's contract (module docstring), checked by
brute force over every count in its bounds, never from the code under test."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from xpu_ops.triton import paged_attention as pa
from xpu_ops.triton import split_plan

_EXAMPLES = int(os.environ.get("XPU_OPS_HYPOTHESIS_EXAMPLES", "0"))
_SETTINGS = settings(max_examples=_EXAMPLES or 200, deadline=None, derandomize=not _EXAMPLES,
                     database=None, suppress_health_check=[HealthCheck.too_slow])
I32_MAX = 2**31 - 1
_sizes = st.integers(0, 2**40) | st.sampled_from([0, 1, 2, 255, 256, 257, 4095, 4096, 4097,
                                                   I32_MAX, I32_MAX + 1])


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _busy(programs: int, slots: int) -> float:
    """Busy fraction of ``ceil(programs / slots)`` waves (0 for an empty grid or no slot)."""
    if programs <= 0 or slots <= 0:
        return 0.0
    return programs / (slots * _cdiv(programs, slots))


@_SETTINGS
@given(programs=_sizes, slots=st.integers(0, 4096) | st.just(1), max_kv_len=_sizes,
       block_n=st.sampled_from([1, 16, 32, 64, 128]),
       split_keys=st.sampled_from([1, 16, 256]), chunk_keys=st.sampled_from([256, 4096]),
       max_chunks=st.integers(1, 16), max_splits=st.integers(1, 64))
@example(programs=0, slots=1, max_kv_len=0, block_n=64, split_keys=256, chunk_keys=4096,
         max_chunks=8, max_splits=64)
@example(programs=1, slots=1, max_kv_len=I32_MAX, block_n=64, split_keys=256,
         chunk_keys=4096, max_chunks=8, max_splits=64)
@example(programs=I32_MAX, slots=264, max_kv_len=1, block_n=16, split_keys=256,
         chunk_keys=4096, max_chunks=8, max_splits=64)
def test_decode_splits_stay_in_their_bounds(programs, slots, max_kv_len, block_n, split_keys,
                                            chunk_keys, max_chunks, max_splits):
    keys = dict(split_keys=split_keys, chunk_keys=chunk_keys, max_chunks=max_chunks,
                max_splits=max_splits)
    splits, min_tiles = split_plan.decode_splits(programs, slots, max_kv_len, block_n, **keys)
    assert type(splits) is int and type(min_tiles) is int
    assert 1 <= splits <= max_splits
    assert min_tiles >= 1
    length = max(max_kv_len, 1)
    # the floor: one split per chunk of keys, at most max_chunks (and max_splits)
    floor = max(1, min(max_chunks, _cdiv(length, chunk_keys), max_splits))
    assert splits >= floor
    # no split shorter than its minimum length beyond the floor
    min_keys = split_keys if max(programs, 1) < slots else chunk_keys
    assert splits <= max(floor, _cdiv(length, min_keys))
    assert min_tiles == _cdiv(min_keys, block_n)
    # the fewest splits within 95 % of the best wave efficiency in those bounds
    counts = range(floor, max(floor, min(max_splits, _cdiv(length, min_keys))) + 1)
    best = max(_busy(max(programs, 1) * s, slots) for s in counts)
    assert _busy(max(programs, 1) * splits, slots) >= 0.95 * best - 1e-12
    assert all(_busy(max(programs, 1) * s, slots) < 0.95 * best - 1e-12
               for s in counts if s < splits)
    # a plan is a function of these host integers only (what a captured graph replays with)
    assert split_plan.decode_splits(programs, slots, max_kv_len, block_n, **keys) == (
        splits, min_tiles)
    old_splits, old_tiles = split_plan.legacy_decode_splits(
        programs, max(slots, 1), 2, max_kv_len, block_n, **keys)
    assert 1 <= old_splits and old_tiles >= 1


@pytest.mark.parametrize("sms", [1, 132])
@pytest.mark.parametrize("resident", [None, 1, 4])
@pytest.mark.parametrize("max_kv_len", [0, 1, I32_MAX])
@pytest.mark.parametrize("programs", [0, 1, 2**20])
def test_plan_splits_at_the_extremes(monkeypatch, sms, resident, max_kv_len, programs):
    monkeypatch.setattr(pa, "num_sms", lambda device: sms)
    for decode in (True, False):
        splits, min_tiles = pa.plan_splits(torch.device("cpu"), programs, max_kv_len, 16,
                                           decode, resident)
        assert 1 <= splits <= pa.MAX_SPLITS and min_tiles >= 1
        # never more splits than key tiles of the bound (each split owns a tile at least)
        assert splits <= max(1, _cdiv(max_kv_len, 16))
    if resident is None:      # None means the default count of resident decode programs
        assert pa.plan_splits(torch.device("cpu"), programs, max_kv_len, 16, True) == \
            pa.plan_splits(torch.device("cpu"), programs, max_kv_len, 16, True,
                           pa.DECODE_PROGRAMS_PER_SM)
