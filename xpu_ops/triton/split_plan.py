"""Split-KV schedule of a decode launch: into how many splits each program's keys are cut.

A decode launch has one program per (row tile, request, KV head); cutting each program's keys
into ``num_splits`` pieces multiplies the grid (FlashDecoding), and the kernel merges the pieces
itself (the last split of a tile to arrive). The count comes from shapes and device facts only
(never tensor values), so a launch captured in a graph replays with the count it was planned
with.

The device runs ``slots`` programs at once (multiprocessors x programs resident on one,
``resident_programs``: bounded by a program's shared memory, the pipelined K/V tiles). A grid
of ``T`` programs of equal work runs in ``ceil(T / slots)`` waves, the last one partly empty:
``wave_efficiency`` is the busy fraction of those waves. FlashInfer's decode planner sizes its
chunks so that the grid fits the resident slots; FlashAttention-2's split heuristic picks the
smallest split count whose wave efficiency is near the best. ``decode_splits`` does both:

- a floor of ``min(max_chunks, cdiv(max_kv_len, chunk_keys))`` splits, which balances requests
  of mixed lengths (a long request is cut into chunks of ``chunk_keys`` keys or more);
- no split shorter than ``split_keys`` keys while the unsplit grid leaves slots empty, nor than
  ``chunk_keys`` keys once it fills them;
- between those bounds, the smallest count whose wave efficiency is at least ``tolerance`` of
  the best one's.

``legacy_decode_splits`` is the rule it replaces (splits until the grid holds
``programs_per_sm`` programs per multiprocessor, rounded up: 8 requests x 8 KV heads on 132
multiprocessors took 5 splits, 320 programs, 1.2 waves of 264 slots), kept selectable for A/B
runs (``XPU_OPS_SPLIT_PLAN=legacy``, read once at import, or ``set_schedule``).
"""

from __future__ import annotations

import os
from typing import Optional

from ._common import cdiv

SCHEDULES = ("waves", "legacy")


def _checked(name: str, where: str) -> str:
    if name not in SCHEDULES:
        raise ValueError(f"{where}: schedule {name!r} is not a split schedule; expected one of "
                         f"{SCHEDULES}, got {name!r}. Use 'waves' (the default) or 'legacy'.")
    return name


def _schedule_from_env() -> str:
    return _checked(os.environ.get("XPU_OPS_SPLIT_PLAN", "") or "waves", "XPU_OPS_SPLIT_PLAN")


# The schedule ``plan_splits`` uses for decode launches; change it with ``set_schedule``.
SCHEDULE = _schedule_from_env()
# Called after a change: caches of launch parameters planned under the old schedule.
_ON_CHANGE: list = []


def set_schedule(name: str) -> str:
    """Plan decode splits with ``name`` (``"waves"`` or ``"legacy"``) from now on, for A/B runs
    in one process; clears the cached launch parameters; returns the previous schedule.

    Raises:
        ValueError: ``name`` is not in ``SCHEDULES``.
    """
    global SCHEDULE
    previous, SCHEDULE = SCHEDULE, _checked(name, "set_schedule")
    for clear in _ON_CHANGE:
        clear()
    return previous


def wave_efficiency(programs: int, slots: int) -> float:
    """Busy fraction of the waves a grid of ``programs`` equal programs needs on ``slots``
    resident slots: ``(programs / slots) / ceil(programs / slots)`` (1.0: whole waves).

    >>> wave_efficiency(512, 264), wave_efficiency(320, 264)
    (0.9696969696969697, 0.6060606060606061)
    """
    if programs <= 0 or slots <= 0:
        return 0.0
    waves = programs / slots
    return waves / cdiv(programs, slots)


def resident_programs(program_smem: int, smem_per_sm: Optional[int], default: int,
                      cap: int) -> int:
    """Programs one multiprocessor holds at once when shared memory bounds them:
    ``smem_per_sm // (program_smem + 1 KiB)`` (CUDA reserves 1 KiB per block), between 1 and
    ``cap``; ``default`` when the device's shared memory is unknown.

    >>> resident_programs(100 * 1024, 228 * 1024, 2, 4), resident_programs(0, None, 2, 4)
    (2, 2)
    """
    if not smem_per_sm:
        return default
    return max(1, min(cap, smem_per_sm // (max(program_smem, 0) + 1024)))


def decode_splits(programs: int, slots: int, max_kv_len: int, block_n: int, *,
                  split_keys: int, chunk_keys: int, max_chunks: int, max_splits: int,
                  tolerance: float = 0.95) -> tuple[int, int]:
    """``(num_splits, min_split_tiles)`` of a decode launch of ``programs`` unsplit programs
    on a device with ``slots`` resident program slots, keys bounded by ``max_kv_len`` (the page
    table's capacity in tokens), ``block_n`` keys per tile (see the module docstring).

    ``min_split_tiles`` is the kernel's shortest share in tiles (``split_keys`` or
    ``chunk_keys`` keys): a request shorter than the capacity uses fewer splits.

    >>> decode_splits(64, 264, 32768, 64, split_keys=256, chunk_keys=4096, max_chunks=8,
    ...               max_splits=64)
    (8, 4)
    >>> decode_splits(512, 264, 4096, 64, split_keys=256, chunk_keys=4096, max_chunks=8,
    ...               max_splits=64)
    (1, 64)
    """
    programs, max_kv_len = max(programs, 1), max(max_kv_len, 1)
    floor = max(1, min(max_chunks, cdiv(max_kv_len, chunk_keys), max_splits))
    min_keys = split_keys if programs < slots else chunk_keys
    ceiling = max(floor, min(max_splits, cdiv(max_kv_len, min_keys)))
    counts = range(floor, ceiling + 1)
    best = max(wave_efficiency(programs * s, slots) for s in counts)
    splits = next(s for s in counts if wave_efficiency(programs * s, slots) >= tolerance * best)
    return splits, cdiv(min_keys, block_n)


def legacy_decode_splits(programs: int, num_sms: int, programs_per_sm: int, max_kv_len: int,
                         block_n: int, *, split_keys: int, chunk_keys: int, max_chunks: int,
                         max_splits: int) -> tuple[int, int]:
    """The former decode rule: below ``programs_per_sm`` programs per multiprocessor, splits
    until the grid reaches it (rounded up), each of ``split_keys`` keys or more; else chunks of
    ``chunk_keys`` keys or more, at most ``max_chunks``.

    >>> legacy_decode_splits(64, 132, 2, 32768, 64, split_keys=256, chunk_keys=4096,
    ...                      max_chunks=8, max_splits=64)
    (5, 4)
    """
    want = cdiv(programs_per_sm * num_sms, max(programs, 1))
    if want > 1:
        return (max(1, min(want, cdiv(max_kv_len, split_keys), max_splits)),
                cdiv(split_keys, block_n))
    return (max(1, min(max_chunks, cdiv(max_kv_len, chunk_keys))), cdiv(chunk_keys, block_n))
