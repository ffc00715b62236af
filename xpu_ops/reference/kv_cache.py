"""Reference KV-cache writes (index_put into the addressed in-range slots only)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import provider_table
from .._checks import FP8_DTYPES


def to_cache_dtype(values: Tensor, dtype: torch.dtype) -> Tensor:
    """``values`` cast to a cache dtype; into fp8, values beyond the range saturate to its
    largest finite value with their sign (infinities included), NaN stays NaN."""
    if dtype in FP8_DTYPES:
        limit = torch.finfo(dtype).max
        values = values.float().clamp(-limit, limit)
    return values.to(dtype)


def paged_view(cache: Tensor, feature_dims: int) -> Tensor:
    """``cache`` as ``[num_pages, page_size, *features]`` (a view for any strides): a flat
    ``[slots, *features]`` cache is pages of one slot. Slot ``s`` is ``[s // page_size,
    s % page_size]``."""
    return cache.unsqueeze(1) if cache.dim() == feature_dims + 1 else cache


def write_slots(cache: Tensor, loc: Tensor, values: Tensor) -> None:
    """``cache[slot loc[i]] = values[i]`` cast to the cache dtype (``to_cache_dtype``), skipping
    slots outside ``[0, slots)``; ``cache`` is ``[num_pages, page_size, ...]`` with any strides.
    fp8 caches are written as bytes (index_put has no fp8 kernel on every device).

    No host sync (so it also runs in a captured graph): an out-of-range entry is redirected to
    repeat the first in-range write (same slot, same value), or, when no entry is in range, to
    rewrite slot 0 with its own contents; either way no slot outside ``loc`` changes. On the CPU,
    a cache whose pages are contiguous slots takes ``_write_slots_cpu`` (fewer ops).
    """
    page_size = cache.shape[1]
    num_slots = cache.shape[0] * page_size
    if num_slots == 0 or loc.shape[0] == 0:
        return
    values = to_cache_dtype(values, cache.dtype)
    if cache.dtype in FP8_DTYPES:
        cache, values = cache.view(torch.uint8), values.view(torch.uint8)
    loc = loc.long()
    rows = flat_rows(cache) if cache.device.type == "cpu" else None
    if rows is not None:
        _write_slots_cpu(loc, (rows, values))
        return
    in_range = (loc >= 0) & (loc < num_slots)                                  # [N]
    first = in_range.to(torch.uint8).argmax()                  # first in-range entry (0 if none)
    any_in_range = in_range[first]
    fill_slot = torch.where(any_in_range, loc[first], 0)
    fill_value = torch.where(any_in_range, values[first], cache[0, 0])
    row_mask = in_range.view(-1, *([1] * (values.dim() - 1)))
    slot = torch.where(in_range, loc, fill_slot)
    cache[slot // page_size, slot % page_size] = torch.where(row_mask, values, fill_value)


def flat_rows(cache: Tensor) -> Optional[Tensor]:
    """A paged ``cache [num_pages, page_size, ...]`` as ``[slots, ...]`` (slot ``s`` is row
    ``s``, a view) when its pages are runs of adjacent slots; None for other page strides."""
    if cache.stride(0) == cache.stride(1) * cache.shape[1]:
        return cache.flatten(0, 1)
    return None


def _write_slots_cpu(loc: Tensor, *pairs: tuple[Tensor, Tensor]) -> None:
    """``write_slots`` on the CPU, where reading ``loc`` (int64) costs no synchronisation: for
    each ``(rows [slots, ...], values [N, ...])`` of ``pairs`` (caches with one slot count),
    one ``index_copy_`` of the in-range entries, found with one ``aminmax``."""
    low, high = torch.aminmax(loc)
    num_slots = pairs[0][0].shape[0]
    if int(low) < 0 or int(high) >= num_slots:
        in_range = (loc >= 0) & (loc < num_slots)
        loc, pairs = loc[in_range], [(rows, values[in_range]) for rows, values in pairs]
    for rows, values in pairs:
        rows.index_copy_(0, loc, values)


@provider_table.register("store_kv_cache", "reference")
def store_kv_cache(k_cache, v_cache, loc, k, v, k_scale, v_scale):
    """Reference ``store_kv_cache`` (contract: ``xpu_ops/ops/kv_cache.py``).

    Writes K and V rows ``[N, Hkv, D]`` into token slots ``loc`` of the caches (flat or paged,
    any strides) with ``write_slots`` (index_put), dividing by ``k_scale``/``v_scale`` first
    when given (fp8). Unscaled stores into CPU caches whose slots are rows of a view take
    ``_write_slots_cpu`` for both at once (one ``aminmax``, two ``index_copy_``).
    """
    if loc.shape[0] == 0:
        return
    if k_scale is None and v_scale is None and k_cache.device.type == "cpu":
        k_rows, v_rows = flat_rows(paged_view(k_cache, 2)), flat_rows(paged_view(v_cache, 2))
        if (k_rows is not None and v_rows is not None and k_rows.dtype == k.dtype
                and v_rows.dtype == v.dtype and k_rows.shape[0] > 0):
            _write_slots_cpu(loc.long(), (k_rows, k), (v_rows, v))
            return
    for cache, src, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        write_slots(paged_view(cache, 2), loc,
                    src if scale is None else src.float() / scale.float().reshape(()))


@provider_table.register("store_mla_kv_cache", "reference")
def store_mla_kv_cache(kv_cache, loc, k_nope, k_rope):
    """Reference ``store_mla_kv_cache`` (contract: ``xpu_ops/ops/kv_cache.py``).

    Writes ``cat(k_nope, k_rope)`` rows ``[N, R + r]`` into token slots ``loc``
    (``write_slots``); a 4-D cache's latent head dimension is dropped first.
    """
    rows = kv_cache.select(2, 0) if kv_cache.dim() == 4 else kv_cache   # [a, b, R + r]
    write_slots(rows, loc, torch.cat([k_nope, k_rope], dim=-1).view(loc.shape[0], rows.shape[-1]))


@provider_table.register("store_cache", "reference")
def store_cache(k, v, k_cache, v_cache, indices):
    """Reference ``store_cache`` (contract: ``xpu_ops/ops/store_cache.py``): rows ``[N, D]``
    into rows ``indices`` of the flat caches ``[S, D]``; indices outside ``[0, S)`` (-1 above
    all) are skipped."""
    if indices.shape[0] == 0:
        return
    write_slots(paged_view(k_cache, 1), indices, k)
    write_slots(paged_view(v_cache, 1), indices, v)
