"""XPUAttentionBackend: decode, extend (with/without prefix), mixed, idle and layer features,
each compared with the float64 oracle over logical token sequences."""


import pytest
import torch

from compile.batch import ForwardMode
from tests.compile.oracle import Harness, assert_close

PAGE_SIZES = [1, 16, 64]
PREFIXES = [0, 17, 5, 64]          # empty, mid-page, short, page aligned (for 16/64)


def _run(h, mode, prefixes, new_lens, layer_kw=None, sinks=None, scale=1.0):
    reqs = [h.add_request(p, scale=scale) for p in prefixes]
    layer = h.layer(**(layer_kw or {}))
    if scale != 1.0:
        layer.set_kv_scales(scale, scale)
    outs, qs = h.step(mode, reqs, new_lens, [layer], scale=scale, sinks=sinks)
    assert outs[0].shape == (sum(new_lens), h.hq * h.dv)
    assert_close(outs[0], h.expected(reqs, new_lens, layer, qs[0], sinks=sinks), h.dtype)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_extend_with_and_without_prefix(page_size):
    h = Harness(page_size, seed=page_size)
    _run(h, ForwardMode.EXTEND, PREFIXES, [9, 1, 20, 3])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decode(page_size):
    h = Harness(page_size, seed=1 + page_size)
    _run(h, ForwardMode.DECODE, [0, 17, 63, 64, 5], [1] * 5)


def test_mixed_chunked_prefill_and_decode():
    h = Harness(16, seed=3)
    _run(h, ForwardMode.MIXED, [30, 0, 47], [12, 1, 1])


def test_draft_extend_is_causal_extend():
    h = Harness(16, seed=4)
    _run(h, ForwardMode.DRAFT_EXTEND_V2, [33, 16], [3, 2])


def test_idle_returns_empty():
    h = Harness(16)
    fb = h.batch(ForwardMode.IDLE, [], [], torch.zeros(0, dtype=torch.int64), [])
    h.backend.init_forward_metadata(fb)
    layer = h.layer()
    out = layer(torch.zeros(0, h.hq * h.d), torch.zeros(0, h.hkv, h.d),
                torch.zeros(0, h.hkv, h.d), fb)
    assert out.shape == (0, h.hq * h.dv)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_sliding_window(page_size, mode):
    h = Harness(page_size, seed=5, window=8)
    new = [6, 1, 10] if mode == ForwardMode.EXTEND else [1, 1, 1]
    _run(h, mode, [40, 0, 21], new, dict(sliding_window_size=8))


def test_softcap_and_sinks_gqa():
    h = Harness(16, hq=8, hkv=2, seed=6)
    sinks = torch.randn(8, generator=h.gen).float()
    _run(h, ForwardMode.EXTEND, [20, 0], [5, 7], dict(logit_cap=3.0), sinks=sinks)
    _run(h, ForwardMode.DECODE, [33, 2], [1, 1], dict(logit_cap=3.0), sinks=sinks)


def test_head_dims_v_differs_and_bf16():
    h = Harness(16, d=64, dv=32, dtype=torch.bfloat16, seed=7)
    _run(h, ForwardMode.EXTEND, [18, 0], [4, 6])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_cache_in_extend(page_size, kv_dtype):
    # Beyond sglang 0.5.23, whose XPU extend path has no fp8 KV: scale on write, descale on read.
    h = Harness(page_size, kv_dtype=kv_dtype, seed=14 + page_size)
    _run(h, ForwardMode.EXTEND, PREFIXES, [9, 1, 20, 3], scale=0.5)
    _run(h, ForwardMode.DRAFT_EXTEND_V2, [12, 30], [3, 4], scale=0.5)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_fp8_kv_cache_scale_on_write_descale_on_read(mode):
    h = Harness(16, kv_dtype=torch.float8_e4m3fn, seed=8)
    new = [5, 3] if mode == ForwardMode.EXTEND else [1, 1]
    _run(h, mode, [19, 0], new, scale=0.25)
    kb = h.pool.get_key_buffer(0)
    assert kb.dtype == torch.float8_e4m3fn


def test_cross_layer_kv_sharing_reads_target_and_writes_nothing():
    h = Harness(16, num_layers=2, seed=9)
    reqs = [h.add_request(p, layers=(0, 1)) for p in (21, 3)]
    target, sharer = h.layer(0), h.layer(1, kv_sharing_target_layer_id=0)
    before = h.pool.get_key_buffer(1).clone()
    outs, qs = h.step(ForwardMode.EXTEND, reqs, [4, 2], [target, sharer])
    # The sharing layer sees layer 0's cache (its new tokens included) and writes nothing.
    assert_close(outs[1], h.expected(reqs, [4, 2], sharer, qs[1]))
    torch.testing.assert_close(h.pool.get_key_buffer(1), before, equal_nan=True)


def test_k_v_none_without_sharing_only_reads():
    h = Harness(16, seed=10)
    reqs = [h.add_request(p) for p in (12, 30)]
    layer = h.layer()
    # Pretend the new tokens' K/V were written earlier: write them directly, call with None.
    loc = torch.cat([h.alloc_slots(r, r.length(), 1) for r in reqs])
    k, v = h.rand(2, h.hkv, h.d), h.rand(2, h.hkv, h.d)
    h.write_direct(0, loc, k, v)
    h._append(reqs, [1, 1], 0, k, v, 1.0)
    fb = h.batch(ForwardMode.DECODE, reqs, [1, 1], loc, [13, 31])
    h.backend.init_forward_metadata(fb)
    q = h.rand(2, h.hq * h.d).float()
    h.poisoned_output(fb, 2, layer)
    out = layer(q, None, None, fb)
    assert_close(out, h.expected(reqs, [1, 1], layer, q.double()))


def test_output_allocated_without_attn_output():
    h = Harness(16, seed=11)
    reqs = [h.add_request(9)]
    layer = h.layer()
    loc = h.alloc_slots(reqs[0], 9, 2)
    fb = h.batch(ForwardMode.EXTEND, reqs, [2], loc, [11])
    h.backend.init_forward_metadata(fb)
    q, k, v = h.rand(2, h.hq, h.d), h.rand(2, h.hkv, h.d), h.rand(2, h.hkv, h.d)
    out = layer(q.float(), k.float(), v.float(), fb)          # 3-D q accepted
    h._append(reqs, [2], 0, k, v, 1.0)
    assert_close(out, h.expected(reqs, [2], layer, q.reshape(2, -1)))


def test_forward_without_metadata_raises():
    h = Harness(16)
    fb = h.batch(ForwardMode.DECODE, [], [], torch.zeros(0, dtype=torch.int64), [])
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        h.layer()(torch.zeros(0, h.hq * h.d), None, None, fb)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_inference_pins_one_kv_split(deterministic):
    # sglang's --enable-deterministic-inference: num_splits=1 in every call (0: automatic).
    # Recorded at the op (num_splits is its 21st argument), which the plain decode layer calls
    # without the public wrapper.
    from torch.utils._python_dispatch import TorchDispatchMode
    from compile.backend import XPUAttentionBackend
    calls, op = [], torch.ops.xpu_ops.flash_attn_with_kvcache.default

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is op:
                calls.append(args[20])
            return func(*args, **(kwargs or {}))
    h = Harness(16, seed=13)
    h.runner.server_args.enable_deterministic_inference = deterministic
    h.backend = XPUAttentionBackend(h.runner)
    with Record():
        _run(h, ForwardMode.EXTEND, [40, 0], [7, 3])
        _run(h, ForwardMode.DECODE, [9, 70], [1, 1])
    assert calls == [1 if deterministic else 0] * 2


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND], ids=lambda m: m.name)
def test_deterministic_inference_is_batch_invariant(page_size, mode):
    # The backend's promise: one pass over the keys, so request 0 gets the same bits alone
    # as beside longer requests (which widen the batch's page table and padded key blocks).
    from compile.backend import XPUAttentionBackend
    h = Harness(page_size, seed=140 + page_size, context_len=2048,
                num_pages=3 * 2048 // page_size + 8)
    h.runner.server_args.enable_deterministic_inference = True
    h.backend = XPUAttentionBackend(h.runner)
    lens, n = [300, 1500, 5, 900, 64, 1200, 33, 700], 1 if mode.is_decode() else 6
    reqs, layer = [h.add_request(x) for x in lens], h.layer()
    q = h.rand(len(lens) * n, h.hq * h.d).float()

    def run(idx):   # reads only: the new tokens' K/V are part of the cached prefix
        fb = h.batch(mode, [reqs[i] for i in idx], [n] * len(idx),
                     torch.zeros(n * len(idx), dtype=torch.int64), [lens[i] for i in idx])
        h.backend.init_forward_metadata(fb)
        h.poisoned_output(fb, n * len(idx), layer)
        rows = torch.cat([torch.arange(i * n, (i + 1) * n) for i in idx])
        return layer(q[rows], None, None, fb)[:n].clone()

    alone = run([0])
    for idx in ([0, 1], [0, 2, 3, 5], list(range(8))):
        assert torch.equal(run(idx), alone), f"batch {idx} changed request 0's output"
    assert_close(alone.double(), h.expected([reqs[0]], [n], layer, q[:n].double()))
