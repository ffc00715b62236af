"""``DSATokenToKVPool`` and the DSA facts of ``KVLayout``: an index-key cache per layer in
DeepGEMM's paged fp8 layout beside the latent cache, the same slot in both; sizes and errors."""

from __future__ import annotations

import pytest
import torch

from compile.batch import DSATokenToKVPool, KVLayout, kv_cache_bytes, make_kv_pool
from xpu_ops.index_k_layout import split_blocks


def test_make_kv_pool_builds_the_dsa_pool_and_stores_index_keys():
    layout = KVLayout(num_layers=2, head_num=1, head_dim=24, v_head_dim=16, kv_lora_rank=16,
                      index_head_dim=8)
    pool = make_kv_pool(layout, size=32, page_size=8, dtype=torch.float32, device="cpu")
    assert isinstance(pool, DSATokenToKVPool)
    assert tuple(pool.get_key_buffer(1).shape) == (32, 1, 24)            # latent R + r
    cache = pool.get_index_k_with_scale_buffer(1)
    assert cache.dtype == torch.uint8 and tuple(cache.shape) == (4, 8, 1, 8 + 4)
    assert pool.index_bytes_per_token() == 12
    keys = torch.randn(3, 8)
    loc = torch.tensor([9, 2, 30])
    pool.set_index_k_buffer(1, loc, keys)
    values, scales = split_blocks(cache)
    for slot, key in zip(loc.tolist(), keys):
        page, row = divmod(slot, 8)
        got = values[page, row].view(torch.float8_e4m3fn).float() * scales[page, row]
        torch.testing.assert_close(got, key, atol=0.07 * key.abs().max().item(), rtol=0.07)
    assert not pool.get_index_k_with_scale_buffer(0).any()   # layer 0 untouched
    assert int((values.reshape(-1, 8).abs().sum(-1) > 0).sum()) == 3  # only the three rows


def test_kv_cache_bytes_counts_index_keys():
    base = dict(num_layers=3, head_num=1, head_dim=24, v_head_dim=16, kv_lora_rank=16)
    dense = kv_cache_bytes(KVLayout(**base), 64, page_size=16, dtype=torch.bfloat16)
    dsa = kv_cache_bytes(KVLayout(**base, index_head_dim=8), 64, page_size=16,
                         dtype=torch.bfloat16)
    slots = (64 // 16 + 1) * 16  # + page 0
    assert dense.full == 3 * slots * 24 * 2
    assert dsa.full == 3 * slots * (24 * 2 + 8 + 4)


def test_index_head_dim_must_be_a_multiple_of_4():
    with pytest.raises(ValueError, match="index_head_dim is not a positive multiple of 4"):
        DSATokenToKVPool(16, 8, torch.float32, 16, 8, 1, "cpu", index_head_dim=6)
