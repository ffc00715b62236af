"""DSA indexer ops against their float64 oracles (``dsa_oracle``) on every provider: logits
(ragged, paged with MTP and 2-D context lengths, garbage in unread cache slots and block-table
entries), top-k and its page-table transform (ties, NaN, -inf, short rows), the index-key
store (only addressed bytes change, nothing on a rejected call), the Hadamard transform; fake
tensors with symbolic sizes and a fullgraph trace of the indexer pipeline."""

from __future__ import annotations

import math

import pytest

from .triton_mode import provider_params, rerun_in_subprocess, running  # first

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.symbolic_shapes import ShapeEnv  # noqa: E402

import xpu_ops  # noqa: E402
from xpu_ops.testing import sample_inputs  # noqa: E402
from xpu_ops.testing_dsa import paged_index_k_cache  # noqa: E402

from . import dsa_oracle as oracle  # noqa: E402
from .utils import bitwise_equal, fake_like, skip_if_unimplemented  # noqa: E402

PROVIDERS = provider_params()
test_rerun_in_subprocess = rerun_in_subprocess(__file__)
OPS = torch.ops.xpu_ops
I32 = torch.int32
E4M3 = torch.float8_e4m3fn


def _samples(op, seed):
    return list(sample_inputs(op, "cpu", seed=seed))


def _assert_logits(got, want, bound):
    """-inf exactly where the oracle has it; elsewhere float32 accumulation error."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got == -math.inf, want == -math.inf), "-inf pattern differs"
    finite = want != -math.inf
    err = (got.double() - want).abs()[finite]
    tol = 1e-5 * bound[finite] + 1e-6
    assert not got[finite].isnan().any() and bool((err <= tol).all()), float(
        (err - tol).max())


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", range(6))
def test_fp8_mqa_logits_matches_oracle(provider, index):
    skip_if_unimplemented(provider, OPS.fp8_mqa_logits)
    q, k, k_scale, w, ks, ke, clean, width = _samples(OPS.fp8_mqa_logits, 100 + index)[index][0]
    with running(provider):
        got = xpu_ops.fp8_mqa_logits(q, (k, k_scale), w, ks, ke, clean_logits=clean,
                                     max_seqlen_k=width)
    _assert_logits(got, *oracle.mqa_logits(q, k, k_scale, w, ks, ke, width))


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", range(6))
def test_fp8_paged_mqa_logits_matches_oracle(provider, index):
    skip_if_unimplemented(provider, OPS.fp8_paged_mqa_logits)
    q, cache, w, lens, table, max_len, _ = _samples(OPS.fp8_paged_mqa_logits, 200 + index)[
        index][0]
    meta = xpu_ops.get_paged_mqa_logits_metadata(lens, cache.shape[1], 3) if lens.numel() \
        else None
    with running(provider):
        got = xpu_ops.fp8_paged_mqa_logits(q, cache, w, lens, table, meta, max_len)
    _assert_logits(got, *oracle.paged_mqa_logits(q, cache, w, lens, table, max_len))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_paged_logits_of_decode_equal_the_ragged_logits(provider):
    """The same keys through the paged cache and as ragged keys give the same logits."""
    skip_if_unimplemented(provider, OPS.fp8_paged_mqa_logits)
    gen = torch.Generator().manual_seed(5)
    bs, d, h, n = 4, 32, 8, 10
    table = torch.tensor([[3, 0, 2]], dtype=I32)
    cache = torch.zeros(4, bs, 1, d + 4, dtype=torch.uint8)
    k = torch.randn(n, d, generator=gen) * 3
    slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(n)])
    q = (torch.randn(1, 1, h, d, generator=gen)).to(E4M3)
    w = torch.randn(1, h, generator=gen)
    xpu_ops.store_index_k_cache(cache, slots, k)
    with running(provider):
        paged = xpu_ops.fp8_paged_mqa_logits(q, cache, w, torch.tensor([n], dtype=I32), table,
                                             None, n)
    keys = torch.stack([oracle.read_index_k(cache, int(s))[0] for s in slots]).to(E4M3)
    scales = torch.tensor([oracle.read_index_k(cache, int(s))[1] for s in slots])
    ragged = xpu_ops.fp8_mqa_logits(q[0], (keys, scales), w, torch.zeros(1, dtype=I32),
                                    torch.tensor([n], dtype=I32))
    torch.testing.assert_close(paged, ragged, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", range(6))
def test_fast_topk_matches_oracle(provider, index):
    skip_if_unimplemented(provider, OPS.fast_topk)
    score, lengths, starts, topk = _samples(OPS.fast_topk, 300 + index)[index][0]
    with running(provider):
        got = xpu_ops.fast_topk_v2(score, lengths, topk, starts)
    assert got.dtype == I32 and got.shape == (score.shape[0], topk)
    assert got.tolist() == oracle.topk_positions(score, lengths, starts, topk)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", range(6))
def test_fast_topk_transform_matches_oracle(provider, index):
    skip_if_unimplemented(provider, OPS.fast_topk_transform)
    score, lengths, table, cu, starts, topk = _samples(OPS.fast_topk_transform, 400 + index)[
        index][0]
    with running(provider):
        got = xpu_ops.fast_topk_transform_fused(score, lengths, table, cu, topk, starts)
    assert got.tolist() == oracle.topk_slots(score, lengths, table, cu, starts, topk)
    offsets = torch.arange(score.shape[0], dtype=I32) * 7
    with running(provider):
        ragged = xpu_ops.fast_topk_transform_ragged_fused(score, lengths, offsets, topk, starts)
    want = [[p + 7 * i if p >= 0 else -1 for p in row]
            for i, row in enumerate(oracle.topk_positions(score, lengths, starts, topk))]
    assert ragged.tolist() == want


@pytest.mark.parametrize("provider", PROVIDERS)
def test_fast_topk_on_random_logits_equals_float64_selection(provider):
    """Distinct random scores (no ties): the set equals the float64 top-k of the same values."""
    skip_if_unimplemented(provider, OPS.fast_topk)
    gen = torch.Generator().manual_seed(11)
    score = torch.randn(6, 300, generator=gen) * 100
    lengths = torch.tensor([300, 299, 64, 65, 1, 200], dtype=I32)
    with running(provider):
        got = xpu_ops.fast_topk_v2(score, lengths, 64)
    for i in range(6):
        n = int(lengths[i])
        want = torch.topk(score[i, :n].double(), min(64, n)).indices.sort().values.tolist()
        assert got[i].tolist() == want + [-1] * (64 - len(want))


def _store_expected(cache, loc, index_k, ue8m0):
    """The cache after the store, in float64 terms: ``{slot: (scale, key)}`` of the written
    slots (the last row of a repeated slot is not relied on: samples have distinct slots)."""
    slots = cache.shape[0] * cache.shape[1]
    rows = oracle.quantize_index_k(index_k, ue8m0)
    return {int(s): rows[t] for t, s in enumerate(loc.tolist()) if 0 <= s < slots}


def _assert_store(before, after, written):
    slots = before.shape[0] * before.shape[1]
    for slot in range(slots):
        key, scale = oracle.read_index_k(after, slot)
        if slot not in written:
            assert bitwise_equal(*(oracle.read_index_k(c, slot)[0].view(torch.uint8)
                                   for c in (before, after)))
            old = oracle.read_index_k(before, slot)[1]
            assert scale == old or math.isnan(scale) and math.isnan(old)
            continue
        want_scale, x = written[slot]
        assert scale == pytest.approx(want_scale, rel=1e-6)
        # fp8 e4m3 keeps 3 mantissa bits: half an ulp is 2**-4 of the value (1/16); values
        # below the normal range (|x| / scale < 2**-6) are off by at most 2**-10 absolutely.
        err = (key * scale - x).abs()
        assert bool((err <= x.abs() / 16 + scale * 2 ** -10 + 1e-12).all())


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", range(5))
def test_store_index_k_cache_matches_oracle(provider, index):
    skip_if_unimplemented(provider, OPS.store_index_k_cache)
    cache, loc, index_k, ue8m0 = _samples(OPS.store_index_k_cache, 500 + index)[index][0]
    before, k_before = cache.clone(), index_k.clone()
    with running(provider):
        xpu_ops.store_index_k_cache(cache, loc, index_k, "ue8m0" if ue8m0 else None)
    _assert_store(before, cache, _store_expected(before, loc, index_k, ue8m0))
    assert bitwise_equal(index_k, k_before)
    if ue8m0:
        for slot in _store_expected(before, loc, index_k, ue8m0):
            scale = oracle.read_index_k(cache, slot)[1]
            assert scale == 2.0 ** round(math.log2(scale))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_store_into_a_view_writes_nothing_outside(provider):
    """A cache that is a slice of a NaN-guarded buffer (blocks before and after): only the
    addressed slots of the view change."""
    skip_if_unimplemented(provider, OPS.store_index_k_cache)
    gen = torch.Generator().manual_seed(3)
    buffer = torch.full((7, 4, 1, 36), 0x7F, dtype=torch.uint8)
    cache = buffer[2:5]
    before = buffer.clone()
    loc = torch.tensor([0, 11, -1, 6, 12])
    index_k = torch.randn(5, 32, generator=gen, dtype=torch.bfloat16)
    with running(provider):
        xpu_ops.store_index_k_cache(cache, loc, index_k)
    assert torch.equal(buffer[:2], before[:2]) and torch.equal(buffer[5:], before[5:])
    _assert_store(before[2:5], cache, _store_expected(before[2:5], loc, index_k, False))


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", range(5))
def test_hadamard_transform_matches_oracle(provider, index):
    skip_if_unimplemented(provider, OPS.hadamard_transform)
    x, scale = _samples(OPS.hadamard_transform, 600 + index)[index][0]
    with running(provider):
        got = xpu_ops.hadamard_transform(x, scale)
    assert got.dtype == x.dtype and got.shape == x.shape and got.is_contiguous()
    want = oracle.hadamard(x, scale)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[x.dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * (want.abs().max()
                                                                           if want.numel() else 1))


def test_hadamard_of_a_strided_view_equals_its_copy():
    x = torch.randn(3, 64)[:, ::2]
    torch.testing.assert_close(xpu_ops.hadamard_transform(x, 0.5),
                               xpu_ops.hadamard_transform(x.contiguous(), 0.5))


def test_schedule_metadata_partitions_the_blocks():
    lens = torch.tensor([130, 0, 64, 1], dtype=I32)       # 3 + 0 + 1 + 1 blocks of 64
    meta = xpu_ops.get_paged_mqa_logits_metadata(lens, 64, 4)
    assert meta.dtype == I32 and meta.shape == (5, 2)
    flat = [(r, blk) for r, n in enumerate([3, 0, 1, 1]) for blk in range(n)]
    starts = [flat[s * 5 // 4] if s * 5 // 4 < 5 else (4, 0) for s in range(5)]
    assert meta.tolist() == [list(p) for p in starts]


# ---- fake tensors and tracing ----------------------------------------------------------------

def test_fakes_give_the_output_shapes_with_symbolic_sizes():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    (q, k, k_scale, w, ks, ke, _, _), _ = _samples(OPS.fp8_mqa_logits, 0)[0]
    fq, fk, fs, fw, fks, fke = (fake_like(mode, t, dynamic_dims=(0,))
                                for t in (q, k, k_scale, w, ks, ke))
    with mode:
        out = OPS.fp8_mqa_logits(fq, fk, fs, fw, fks, fke, True, 0)
        assert out.shape == (fq.shape[0], fk.shape[0]) and out.dtype == torch.float32
        top = OPS.fast_topk(out, fks, None, 4)
        assert top.shape == (fq.shape[0], 4) and top.dtype == I32
        h = OPS.hadamard_transform(fw, 0.5)
        assert h.shape == fw.shape
    (q, cache, w, lens, table, max_len, _), _ = _samples(OPS.fp8_paged_mqa_logits, 0)[1]
    with mode:
        fq = fake_like(mode, q, dynamic_dims=(0,))
        out = OPS.fp8_paged_mqa_logits(fq, fake_like(mode, cache), fake_like(mode, w),
                                       fake_like(mode, lens), fake_like(mode, table), max_len,
                                       False)
        assert out.shape == (q.shape[0] * q.shape[1], max_len)


def test_fake_on_xpu_runs_the_checks():
    mode = FakeTensorMode()
    q = fake_like(mode, torch.randn(2, 1, 4, 16).to(E4M3), device="xpu")
    cache = fake_like(mode, torch.zeros(3, 4, 1, 20, dtype=torch.uint8), device="cpu")
    with mode, pytest.raises(ValueError, match="kv_cache is on the wrong device"):
        OPS.fp8_paged_mqa_logits(q, cache, fake_like(mode, torch.randn(2, 4), device="xpu"),
                                 fake_like(mode, torch.ones(2, dtype=I32), device="xpu"),
                                 fake_like(mode, torch.zeros(2, 1, dtype=I32), device="xpu"),
                                 4, False)


def _indexer_step(cache, loc, k, q, w, lens, table, page_table, cu):
    """One decode step of the indexer: rotate, store the new keys, score, select slots."""
    xpu_ops.store_index_k_cache(cache, loc, xpu_ops.hadamard_transform(k, k.shape[-1] ** -0.5))
    logits = xpu_ops.fp8_paged_mqa_logits(q, cache, w, lens, table, None, 16)
    return xpu_ops.fast_topk_transform_fused(logits, lens, page_table, cu, 4)


def test_fullgraph_trace_of_the_indexer_step_equals_eager():
    gen = torch.Generator().manual_seed(21)
    table = torch.tensor([[2, 0, 5, 1], [3, 4, 6, 7]], dtype=I32)
    lens = torch.tensor([9, 13], dtype=I32)
    cache = paged_index_k_cache(gen, table, [8, 12], 4, 32, 8)
    loc = torch.tensor([int(table[0, 2]) * 4, int(table[1, 3]) * 4], dtype=torch.int64)
    k = torch.randn(2, 32, generator=gen)
    q = torch.randn(2, 1, 4, 32, generator=gen).to(E4M3)
    w = torch.randn(2, 4, generator=gen)
    page_table = torch.randint(0, 100, (2, 16), generator=gen, dtype=I32)
    cu = torch.tensor([0, 1, 2], dtype=I32)
    args = (q, w, lens, table, page_table, cu)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    want = _indexer_step(eager_cache, loc, k, *args)
    compiled = torch.compile(_indexer_step, backend="aot_eager", fullgraph=True)
    got = compiled(compiled_cache, loc, k, *args)
    assert torch.equal(got, want) and torch.equal(compiled_cache, eager_cache)
    assert (want >= 0).sum() == 8          # 4 of 9 and 4 of 13 keys


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_gather_index_k_cache_reads_the_stored_keys(strided):
    gen = torch.Generator().manual_seed(31)
    table = torch.tensor([[3, 1], [0, 2]], dtype=I32)
    cache = paged_index_k_cache(gen, table, [7, 5], 4, 16, 5)
    if strided:                                   # a column slice of a garbage-padded buffer
        wide = torch.full((5, 4, 1, 40), 0x7F, dtype=torch.uint8)
        wide[..., ::2] = cache
        cache = wide[..., ::2]
    slots = torch.tensor([12, 13, 4, 0, 9, -1, 20, 3], dtype=torch.int64)
    k, scale = xpu_ops.gather_index_k_cache(cache, slots)
    assert k.dtype == E4M3 and k.shape == (8, 16) and scale.shape == (8,)
    for i, s in enumerate(slots.tolist()):
        if 0 <= s < 20:
            key, want = oracle.read_index_k(cache.contiguous(), s)
            assert bitwise_equal(k[i].view(torch.uint8), key.to(E4M3).view(torch.uint8))
            assert float(scale[i]) == want or math.isnan(want) and math.isnan(float(scale[i]))
        else:
            assert not k[i].view(torch.uint8).any() and float(scale[i]) == 0.0
    compiled = torch.compile(xpu_ops.gather_index_k_cache, backend="aot_eager", fullgraph=True)
    k2, scale2 = compiled(cache, slots)
    assert bitwise_equal(k2.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(scale2.nan_to_num(7.0), scale.nan_to_num(7.0))


@pytest.mark.parametrize("provider", [p for p in PROVIDERS if p.id == "triton"])
@pytest.mark.parametrize("index", range(5))
def test_triton_store_writes_the_reference_bytes(provider, index):
    """The Triton store encodes fp8 itself: its bytes equal torch's conversion's exactly."""
    skip_if_unimplemented(provider, OPS.store_index_k_cache)
    cache, loc, index_k, ue8m0 = _samples(OPS.store_index_k_cache, 700 + index)[index][0]
    index_k = index_k * torch.logspace(-6, 2, index_k.shape[1], dtype=torch.float32).to(
        index_k.dtype)                                # subnormal fp8 values and large ones
    want, got = cache.clone(), cache.clone()
    with running("reference"):
        xpu_ops.store_index_k_cache(want, loc, index_k, "ue8m0" if ue8m0 else None)
    with running(provider):
        xpu_ops.store_index_k_cache(got, loc, index_k, "ue8m0" if ue8m0 else None)
    assert bitwise_equal(got, want)


@pytest.mark.parametrize("op", [OPS.fp8_mqa_logits, OPS.fp8_paged_mqa_logits, OPS.fast_topk,
                                OPS.fast_topk_transform, OPS.store_index_k_cache,
                                OPS.hadamard_transform], ids=lambda op: op.__name__)
def test_every_sample_traces_on_a_fake_xpu(op):
    """No Intel GPU here: each op's fake on device ``xpu`` gives its output's shape, dtype
    and device, as a traced XPU model needs."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    for args, kwargs in _samples(op, 0):
        fake = [fake_like(mode, a, device="xpu") if isinstance(a, torch.Tensor) else a
                for a in args]
        with mode:
            out = op(*fake, **kwargs)
        real = op(*args, **kwargs)
        if real is None:
            assert out is None
            continue
        assert out.device.type == "xpu" and out.shape == real.shape and out.dtype == real.dtype
