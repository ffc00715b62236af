"""Reference KV-cache writes (index_put into the addressed slots only)."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import providers
from .._checks import FP8_DTYPES


def write_slots(cache_rows: Tensor, loc: Tensor, values: Tensor) -> None:
    """``cache_rows[loc] = values`` cast to the cache dtype; fp8 caches are written as bytes
    (index_put has no fp8 kernel on every device)."""
    values = values.to(cache_rows.dtype)
    if cache_rows.dtype in FP8_DTYPES:
        cache_rows, values = cache_rows.view(torch.uint8), values.view(torch.uint8)
    cache_rows[loc.long()] = values


@providers.register("store_kv_cache", "reference")
def store_kv_cache(k_cache, v_cache, loc, k, v, k_scale, v_scale):
    for cache, src, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        rows = cache.view(-1, *cache.shape[-2:])
        write_slots(rows, loc, src if scale is None else src.float() / scale.float())


@providers.register("store_mla_kv_cache", "reference")
def store_mla_kv_cache(kv_cache, loc, k_nope, k_rope):
    rows = kv_cache.view(-1, kv_cache.shape[-1])
    write_slots(rows, loc, torch.cat([k_nope, k_rope], dim=-1).view(loc.shape[0], rows.shape[-1]))
