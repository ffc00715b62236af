"""Pools and allocator: page-aligned slots, req_to_token updates, writes through the ops,
SWA translation, MLA rows."""

import pytest
import torch

from compile.batch import (MHATokenToKVPool, MLATokenToKVPool, PageAllocator,
                           ReqToTokenPool, SWAKVPool)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_alloc_extend_is_page_aligned_and_fills_req_to_token(page_size):
    gen = torch.Generator().manual_seed(page_size)
    pool = ReqToTokenPool(4, 512, "cpu")
    alloc = PageAllocator(100, page_size, "cpu", generator=gen)
    row = pool.alloc(1)[0]
    first = alloc.alloc_extend(pool, row, 0, 17)
    second = alloc.alloc_extend(pool, row, 17, 50)
    slots = pool.req_to_token[row, :67].long()
    assert torch.equal(slots, torch.cat([first, second]))
    assert first.dtype == torch.int64
    # Tokens of one page are consecutive slots; pages start on page boundaries; page 0 unused.
    pos = torch.arange(67)
    assert torch.equal(slots % page_size, pos % page_size)
    pages = slots // page_size
    assert torch.equal(pages, pages[(pos // page_size) * page_size])
    assert (pages > 0).all() and len(set(pages.tolist())) == (66 // page_size) + 1
    assert alloc.available_size() == (99 - len(set(pages.tolist()))) * page_size


def test_shuffled_allocator_hands_out_pages_out_of_order():
    alloc = PageAllocator(50, 16, "cpu", generator=torch.Generator().manual_seed(0))
    pages = alloc.alloc_pages(10)
    assert pages != sorted(pages) and 0 not in pages
    with pytest.raises(RuntimeError, match="out of pages"):
        alloc.alloc_pages(100)
    assert ReqToTokenPool(2, 8, "cpu").alloc(3) is None


def test_mha_pool_write_through_op_and_paged_view():
    pool = MHATokenToKVPool(64, 16, torch.float32, 2, 8, 2, "cpu", v_head_dim=4)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 4)
    k0 = k.clone()
    loc = torch.tensor([17, 40, 63])
    pool.set_kv_buffer(1, loc, k, v)
    assert torch.equal(k, k0)
    kp, vp = pool.get_paged_kv(1)
    assert kp.shape == (4, 16, 2, 8) and vp.shape == (4, 16, 2, 4)
    assert torch.equal(kp[1, 1], k[0]) and torch.equal(vp[3, 15], v[2])
    assert torch.count_nonzero(pool.get_key_buffer(0)) == 0


def test_mha_pool_layer_ids_are_global_with_start_layer():
    # A pipeline stage holding layers 2 and 3: buffers are indexed by layer_id - start_layer.
    pool = MHATokenToKVPool(8, 4, torch.float32, 1, 2, layer_num=2, device="cpu",
                            start_layer=2)
    k3, v3 = pool.get_kv_buffer(3)
    assert k3 is pool.k_buffer[1] and v3 is pool.v_buffer[1]
    assert k3 is pool.get_key_buffer(3) and v3 is pool.get_value_buffer(3)
    pool.set_kv_buffer(3, torch.tensor([5]), torch.ones(1, 1, 2), torch.full((1, 1, 2), 2.0))
    assert pool.k_buffer[1][5].tolist() == [[1.0, 1.0]] and pool.v_buffer[1][5, 0, 0] == 2.0
    assert pool.k_buffer[0].abs().sum() == 0
    k_pages, _ = pool.get_paged_kv(2)
    assert k_pages.shape == (2, 4, 1, 2) and k_pages.data_ptr() == pool.k_buffer[0].data_ptr()


def test_fp8_pool_scales_on_write():
    pool = MHATokenToKVPool(32, 16, torch.float8_e4m3fn, 1, 16, 1, "cpu")
    k = torch.randn(2, 1, 16)
    pool.set_kv_buffer(0, torch.tensor([3, 20]), k, k, k_scale=0.5, v_scale=0.5)
    stored = pool.get_key_buffer(0)[torch.tensor([3, 20])].float()
    torch.testing.assert_close(stored * 0.5, k, atol=0.1, rtol=0.1)


def test_swa_pool_translation_and_routing():
    pool = SWAKVPool(64, 32, [1], [0, 2], 16, torch.float32, 1, 4, "cpu")
    pool.map_pages([3], [1])
    loc = torch.tensor([48, 50], dtype=torch.int32)
    swa = pool.translate_loc_from_full_to_swa(loc)
    assert swa.tolist() == [16, 18] and swa.dtype == torch.int32
    k = torch.randn(2, 1, 4)
    pool.set_kv_buffer(1, loc.long(), k, k)
    assert torch.equal(pool.get_key_buffer(1)[[16, 18]], k)
    pool.set_kv_buffer(2, loc.long(), k, k)
    assert torch.equal(pool.get_key_buffer(2)[[48, 50]], k)
    assert pool.is_swa_layer(1) and not pool.is_swa_layer(0)


def test_mla_pool_rows():
    pool = MLATokenToKVPool(32, 16, torch.float32, 8, 4, 1, "cpu")
    nope, rope = torch.randn(2, 1, 8), torch.randn(2, 1, 4)
    pool.set_mla_kv_buffer(0, torch.tensor([5, 30]), nope, rope)
    assert torch.equal(pool.get_key_buffer(0)[[5, 30]], torch.cat([nope, rope], -1))
    assert torch.equal(pool.get_value_buffer(0)[[5, 30]], nope)


def test_pool_size_must_be_page_multiple():
    with pytest.raises(ValueError, match="multiple of page_size"):
        MHATokenToKVPool(30, 16, torch.float32, 1, 4, 1, "cpu")
