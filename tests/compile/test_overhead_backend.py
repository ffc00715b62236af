"""Per-layer reuse in the backend and the pool stays invisible: fp8 descales always follow the
layer's scales, cached paged views always view the layer's current buffers."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from compile.attention_backend import XPUAttentionBackend
from compile.layer import PagedAttention
from compile.memory_pool import MHATokenToKVPool, ReqToTokenPool
from compile.model_runner import ModelRunnerInfo

FP8 = torch.float8_e4m3fn


def _backend(dtype=FP8, page_size=4):
    pool = MHATokenToKVPool(32, page_size, dtype, head_num=2, head_dim=8, layer_num=2,
                            device="cpu")
    runner = ModelRunnerInfo(model_config=SimpleNamespace(context_len=16, num_attention_heads=4),
                             tp_size=1, device=torch.device("cpu"), page_size=page_size,
                             req_to_token_pool=ReqToTokenPool(2, 16, "cpu"),
                             token_to_kv_pool=pool, kv_cache_dtype=dtype)
    return XPUAttentionBackend(runner), pool


def _expect(descale, value, batch=3, hkv=2):
    assert descale.shape == (batch, hkv) and descale.dtype == torch.float32
    assert descale.is_contiguous() and torch.all(descale == value)


def test_descales_follow_in_place_and_replaced_scales():
    backend, pool = _backend()
    layer = PagedAttention(4, 8, 0.1, 2, layer_id=1)
    cache = pool.get_paged_kv(1)[0]
    assert backend.descales(layer, cache, 3) == (None, None)  # no scales set
    layer.set_kv_scales(0.5, 0.25)
    kd, vd = backend.descales(layer, cache, 3)
    _expect(kd, 0.5), _expect(vd, 0.25)
    layer.k_scale.fill_(2.0)  # in place
    kd, vd = backend.descales(layer, cache, 3)
    _expect(kd, 2.0), _expect(vd, 0.25)
    layer.set_kv_scales(3.0, 4.0)  # new tensors
    _expect(backend.descales(layer, cache, 3)[1], 4.0)
    _expect(backend.descales(layer, cache, 5)[0], 3.0, batch=5)
    with torch.inference_mode():
        _expect(backend.descales(layer, cache, 3)[0], 3.0)
    layer.set_kv_scales(6.0, 7.0)
    _expect(backend.descales(layer, cache, 3)[0], 6.0)  # outside inference mode again


def test_descales_are_none_for_float_caches():
    backend, pool = _backend(dtype=torch.float32)
    layer = PagedAttention(4, 8, 0.1, 2, layer_id=0)
    layer.set_kv_scales(0.5, 0.5)
    assert backend.descales(layer, pool.get_paged_kv(0)[0], 3) == (None, None)


def test_paged_views_follow_the_layer_buffers():
    _, pool = _backend(dtype=torch.float32)
    for inference in (False, True, False):
        with torch.inference_mode(inference):
            kp, vp = pool.get_paged_kv(1)
            assert kp.shape == (8, 4, 2, 8) and vp.shape == (8, 4, 2, 8)
            assert kp.data_ptr() == pool.k_buffer[1].data_ptr()
            assert vp.data_ptr() == pool.v_buffer[1].data_ptr()
            assert pool.get_paged_kv(1, page_size=1)[0].shape == (32, 1, 2, 8)
    pool.k_buffer[1] = torch.ones_like(pool.k_buffer[1])
    kp, _ = pool.get_paged_kv(1)
    assert kp.data_ptr() == pool.k_buffer[1].data_ptr() and torch.all(kp == 1)
    kp.zero_()  # a view, not a copy
    assert torch.all(pool.k_buffer[1] == 0)
