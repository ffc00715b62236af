"""Reference KV-cache writes (index_put into the addressed in-range slots only)."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import providers
from .._checks import FP8_DTYPES


def write_slots(cache_rows: Tensor, loc: Tensor, values: Tensor) -> None:
    """``cache_rows[loc] = values`` cast to the cache dtype, skipping slots outside
    ``[0, slots)``; fp8 caches are written as bytes (index_put has no fp8 kernel on every device).

    No host sync (so it also runs in a captured graph): an out-of-range entry is redirected to
    repeat the first in-range write (same slot, same value), or, when no entry is in range, to
    rewrite slot 0 with its own contents; either way no slot outside ``loc`` changes.
    """
    num_slots = cache_rows.shape[0]
    if num_slots == 0 or loc.shape[0] == 0:
        return
    values = values.to(cache_rows.dtype)
    if cache_rows.dtype in FP8_DTYPES:
        cache_rows, values = cache_rows.view(torch.uint8), values.view(torch.uint8)
    loc = loc.long()
    in_range = (loc >= 0) & (loc < num_slots)                                  # [N]
    first = in_range.to(torch.uint8).argmax()                  # first in-range entry (0 if none)
    any_in_range = in_range[first]
    fill_slot = torch.where(any_in_range, loc[first], 0)
    fill_value = torch.where(any_in_range, values[first], cache_rows[0])
    row_mask = in_range.view(-1, *([1] * (values.dim() - 1)))
    cache_rows[torch.where(in_range, loc, fill_slot)] = torch.where(row_mask, values, fill_value)


@providers.register("store_kv_cache", "reference")
def store_kv_cache(k_cache, v_cache, loc, k, v, k_scale, v_scale):
    """Reference ``store_kv_cache`` (contract: ``xpu_ops/ops/kv_cache.py``).

    Writes K and V rows ``[N, Hkv, D]`` into token slots ``loc`` of the flat caches with
    ``write_slots`` (index_put), dividing by ``k_scale``/``v_scale`` first when given (fp8).
    """
    for cache, src, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        rows = cache.view(-1, *cache.shape[-2:])
        write_slots(rows, loc, src if scale is None else src.float() / scale.float())


@providers.register("store_mla_kv_cache", "reference")
def store_mla_kv_cache(kv_cache, loc, k_nope, k_rope):
    """Reference ``store_mla_kv_cache`` (contract: ``xpu_ops/ops/kv_cache.py``).

    Writes ``cat(k_nope, k_rope)`` rows ``[N, R + r]`` into token slots ``loc`` (``write_slots``).
    """
    rows = kv_cache.view(-1, kv_cache.shape[-1])
    write_slots(rows, loc, torch.cat([k_nope, k_rope], dim=-1).view(loc.shape[0], rows.shape[-1]))
