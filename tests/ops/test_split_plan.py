"""The decode split-KV schedule (``xpu_ops.triton.split_plan``) as a pure function of shapes.

The expectations are computed here from the goal, not copied from the module: a grid of equal
programs is simulated slot by slot (each free slot takes the next program) to count its waves,
and the chosen split count is checked against every other count in its bounds. The device
shapes are an H100/H200 (132 multiprocessors, 2 decode programs resident on each) and a small
machine.
"""

from __future__ import annotations

import pytest
import torch

from xpu_ops.triton import paged_attention as pa
from xpu_ops.triton import split_plan

KEYS = dict(split_keys=256, chunk_keys=4096, max_chunks=8, max_splits=64)
SLOTS = 264  # 132 multiprocessors x 2 resident decode programs


def _simulated_waves(programs: int, slots: int) -> int:
    """Waves of a grid whose programs all take one time unit: fill the free slots, advance."""
    waves, left = 0, programs
    while left > 0:
        left -= min(slots, left)
        waves += 1
    return waves


def _busy_fraction(programs: int, slots: int) -> float:
    return programs / (slots * _simulated_waves(programs, slots)) if programs else 0.0


@pytest.mark.parametrize("programs, slots", [(1, 8), (320, 264), (512, 264), (528, 264),
                                             (64, 264), (7, 3)])
def test_wave_efficiency_is_the_busy_fraction_of_the_waves(programs, slots):
    assert split_plan.wave_efficiency(programs, slots) == pytest.approx(
        _busy_fraction(programs, slots))


@pytest.mark.parametrize("programs, max_kv_len", [
    (64, 32768),      # 8 requests x 8 KV heads, 32k keys: the long-context decode row
    (512, 4096),      # 64 x 4096: the grid already fills two waves
    (512, 8000),      # 64 requests of mixed lengths up to 8000
    (8, 16384), (8, 1024), (8, 131072),   # b = 1, also under a graph's 128k-token table
    (32, 4096), (128, 4096), (600, 4096), (512, 131072)])
def test_decode_splits_pick_the_fewest_splits_near_the_best_waves(programs, max_kv_len):
    splits, min_tiles = split_plan.decode_splits(programs, SLOTS, max_kv_len, 64, **KEYS)
    min_keys = 256 if programs < SLOTS else 4096
    floor = min(8, -(-max_kv_len // 4096))
    ceiling = max(floor, min(64, -(-max_kv_len // min_keys)))
    assert floor <= splits <= ceiling and min_tiles * 64 == min_keys
    best = max(_busy_fraction(programs * s, SLOTS) for s in range(floor, ceiling + 1))
    assert _busy_fraction(programs * splits, SLOTS) >= 0.95 * best
    assert all(_busy_fraction(programs * s, SLOTS) < 0.95 * best for s in range(floor, splits))


def test_long_context_decode_runs_whole_waves_where_the_old_rule_left_one_mostly_empty():
    """8 x 32768 on 132 multiprocessors: the old rule's 5 splits made 320 programs (1.2 waves
    of 264), the new plan 8 (512 programs, 1.94 waves), the split count of 64 x 4096's grid."""
    new, _ = split_plan.decode_splits(64, SLOTS, 32768, 64, **KEYS)
    old, _ = split_plan.legacy_decode_splits(64, 132, 2, 32768, 64, **KEYS)
    assert (old, new) == (5, 8)
    assert _busy_fraction(64 * new, SLOTS) > 0.95 > 0.65 > _busy_fraction(64 * old, SLOTS)


def test_plan_splits_follows_the_selected_schedule(monkeypatch):
    """``plan_splits`` takes the device's multiprocessor count (here patched to 132) and the
    module's schedule; the legacy one stays selectable for A/B runs."""
    monkeypatch.setattr(pa, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert pa.plan_splits(cuda, 64, 32768, 64, decode=True) == (8, 4)
    monkeypatch.setattr(split_plan, "SCHEDULE", "legacy")
    assert pa.plan_splits(cuda, 64, 32768, 64, decode=True) == (5, 4)


def test_unknown_schedule_is_refused(monkeypatch):
    monkeypatch.setenv("XPU_OPS_SPLIT_PLAN", "fastest")
    with pytest.raises(ValueError, match="XPU_OPS_SPLIT_PLAN.*'fastest'.*expected one of"):
        split_plan._schedule_from_env()
    monkeypatch.setenv("XPU_OPS_SPLIT_PLAN", "legacy")
    assert split_plan._schedule_from_env() == "legacy"
    with pytest.raises(ValueError, match="set_schedule.*'fast'"):
        split_plan.set_schedule("fast")
    assert split_plan.SCHEDULE == "waves"


def test_set_schedule_drops_launch_parameters_planned_under_the_old_one(monkeypatch):
    """A cached launch shape would keep its old split count: switching clears the cache."""
    monkeypatch.setattr(pa, "num_sms", lambda device: 132)
    pa._launch_params.cache_clear()
    pa._launch_params(torch.device("cpu"), (1, 2, 16), (32, 16, 1), torch.float32,
                      (4, 16, 1, 16), (256, 16, 16, 1), (4, 16, 1, 16), (256, 16, 16, 1),
                      (32, 16, 1), None, (4, 1), True, 1, 1, 64, (False,) * 8, 0.25, 0.0, -1,
                      -1, None, None, None, 1, (1, 1, 0, 1) + (0,) * 10, (4, 4, 4, True))
    assert pa._launch_params.cache_info().currsize == 1
    try:
        assert split_plan.set_schedule("legacy") == "waves"
        assert pa._launch_params.cache_info().currsize == 0
    finally:
        split_plan.set_schedule("waves")


@pytest.mark.parametrize("smem, per_sm, expected", [
    (100 * 1024, 228 * 1024, 2),    # D 128 decode tile: two fit in an H100/H200 multiprocessor
    (66 * 1024, 228 * 1024, 3),     # D 64, 128-key tiles
    (4 * 1024, 228 * 1024, 4),      # capped
    (300 * 1024, 228 * 1024, 1),    # never below one
    (100 * 1024, None, 2)])         # unknown device: the default
def test_resident_programs_by_shared_memory(smem, per_sm, expected):
    assert split_plan.resident_programs(smem, per_sm, 2, 4) == expected
    if per_sm:   # the count fits the multiprocessor, one more would not (1 KiB per block)
        n = expected
        assert n * (smem + 1024) <= per_sm or n == 1
        assert n == 4 or (n + 1) * (smem + 1024) > per_sm


def test_more_resident_programs_fill_more_slots_before_splitting_further(monkeypatch):
    """8 x 8 programs on 132 multiprocessors: 3 resident each (D 64 tiles) take 6 splits
    (384 programs, 0.97 of one wave of 396), 2 resident take 4 (256 of 264)."""
    monkeypatch.setattr(pa, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert pa.plan_splits(cuda, 64, 16384, 64, decode=True, resident=3) == (6, 4)
    assert pa.plan_splits(cuda, 64, 16384, 64, decode=True, resident=2) == (4, 4)
