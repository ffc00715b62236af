"""Per-layer reuse in the backend and the pool stays invisible: fp8 descales always follow the
layer's scales, paged views always view the layer's current buffers, and decode steps of equal
shapes read their own metadata and reject bad arguments every time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from compile.backend import PagedAttention, XPUAttentionBackend
from compile.batch import ForwardMode, MHATokenToKVPool, ReqToTokenPool
from compile.engine.model_runner import ModelRunnerInfo
from tests.compile.oracle import Harness, assert_close
import xpu_ops

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


def _decode(h: Harness, reqs, layers) -> None:
    """One DECODE step of ``reqs`` through ``layers``, each checked against the oracle."""
    ones = [1] * len(reqs)
    outs, qs = h.step(ForwardMode.DECODE, reqs, ones, layers)
    for layer, out, q in zip(layers, outs, qs):
        assert_close(out, h.expected(reqs, ones, layer, q), h.dtype)


def test_decode_steps_of_equal_shapes_read_their_own_metadata():
    h = Harness(16, num_layers=2, seed=11)
    layers = [h.layer(0), h.layer(1)]
    first = [h.add_request(n, layers=(0, 1)) for n in (20, 5, 33)]
    second = [h.add_request(n, layers=(0, 1)) for n in (33, 12, 2)]
    _decode(h, first, layers)          # seq_lens 21, 6, 34: page_table [3, 3]
    _decode(h, second, layers)         # 34, 13, 3: same shapes, other lengths and pages
    _decode(h, first, layers)          # 22, 7, 35
    _decode(h, first[:2], layers)      # b = 2: other shapes
    capped = [h.layer(0, logit_cap=5.0), h.layer(1, logit_cap=5.0)]
    _decode(h, second, capped)         # another softcap


def test_a_bad_argument_raises_on_every_step():
    h = Harness(16, seed=12)
    layer = h.layer(0)
    reqs = [h.add_request(n) for n in (9, 17)]
    _decode(h, reqs, [layer])
    for _ in range(2):  # after a valid step of the same shapes, every time
        loc = torch.cat([h.alloc_slots(r, r.length(), 1) for r in reqs])
        fb = h.batch(ForwardMode.DECODE, reqs, [1, 1], loc, [r.length() + 1 for r in reqs])
        h.backend.init_forward_metadata(fb)
        q, k, v = h.rand(2, h.hq * h.d), h.rand(2, h.hkv, h.d), h.rand(2, h.hkv, h.dv)
        with pytest.raises(ValueError, match="store_kv_cache: k has dtype torch.float64"):
            h.backend.forward(q.float(), k, v.float(), layer, fb)


def test_debug_checks_turned_on_between_layers_check_the_next_call():
    """The value checks of the public ops are read per call: a layer run under
    ``xpu_ops.debug_checks()`` checks its metadata even after earlier layers of the step ran."""
    h = Harness(16, seed=13)
    layer = h.layer(0)
    reqs = [h.add_request(n) for n in (9, 17)]
    loc = torch.cat([h.alloc_slots(r, r.length(), 1) for r in reqs])
    fb = h.batch(ForwardMode.DECODE, reqs, [1, 1], loc, [r.length() + 1 for r in reqs])
    h.backend.init_forward_metadata(fb)
    q, k, v = (x.float() for x in (h.rand(2, h.hq * h.d), h.rand(2, h.hkv, h.d),
                                    h.rand(2, h.hkv, h.dv)))
    h.backend.forward(q, k, v, layer, fb)
    loc[0] = 10 ** 6  # out of range: only the debug value check of the public op sees it
    h.backend.forward(q, k, v, layer, fb)  # skipped without the checks, no error
    with xpu_ops.debug_checks(), pytest.raises(ValueError, match="store_kv_cache: loc has a "
                                                                 "token slot out of range"):
        h.backend.forward(q, k, v, layer, fb)
