"""``flash_mla_with_kvcache`` and ``get_mla_metadata``: every sample against the float64 oracle
on every provider (Triton through its interpreter), the edge cases of API.md (rows without a
valid index, sinks of +-inf, slots past the cache, empty caches), FlashMLA's fp8 token layout,
strided and expanded inputs, tracing, and every argument check."""

from __future__ import annotations

import math

import pytest

from .triton_mode import provider_params, rerun_in_subprocess, running  # first

import torch  # noqa: E402

import xpu_ops  # noqa: E402
from xpu_ops.mla_fp8_layout import fp8_token_bytes, quantize_fp8_tokens  # noqa: E402
from xpu_ops.testing_flash_mla import flashmla_cache  # noqa: E402

from . import oracle_flash_mla as oracle  # noqa: E402
from .utils import (assert_matches_oracle, assert_named_error, reseeded_sample,  # noqa: E402
                    sample_indices)

OP = torch.ops.xpu_ops.flash_mla_with_kvcache
PROVIDERS = provider_params()
I32 = torch.int32
test_rerun_in_subprocess = rerun_in_subprocess(__file__)


def _call(args, provider):
    with running(provider):
        return OP(*args)


def _check(args, provider):
    out, lse = _call(args, provider)
    expected, expected_lse = oracle.flash_mla_with_kvcache(*args)
    assert_matches_oracle(out, expected, args[0].dtype, lse, expected_lse)
    return out, lse


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", sample_indices(OP))
def test_matches_oracle(provider, index):
    args = reseeded_sample(OP, index, seed=7000 + index)
    cache = args[1].view(torch.uint8) if args[7] else args[1]
    assert (cache == 0xFF).all(-1).any() if args[7] else cache.isnan().any()   # garbage present
    _check(args, provider)


def _sparse_args(seed=0, *, b=2, s_q=2, h=4, d=48, dv=32, pages=(3, 4), topk=5, dtype=None,
                 fp8=False):
    dtype = dtype or torch.float32
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(*pages, d, generator=gen)
    cache = flashmla_cache(values, torch.ones(pages, dtype=torch.bool), dv, fp8, dtype)
    indices = torch.randint(0, pages[0] * pages[1], (b, s_q, topk), generator=gen).to(I32)
    q = torch.randn(b, s_q, h, d, generator=gen).to(dtype)
    return [q, cache, None, None, dv, 0.3, False, fp8, indices, None, None, None, None, None]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_rows_without_a_valid_index_are_zero_with_lse_minus_inf(provider):
    args = _sparse_args(1)
    args[8][0, 1] = -1                                    # every index invalid
    args[8][1, 0] = torch.tensor([-1, 12, 10 ** 6, -7, 2 ** 31 - 1], dtype=I32)  # past the cache
    args[12] = torch.tensor([5, 0], dtype=I32)            # request 1: topk_length 0
    args[9] = torch.tensor([0.5, math.inf, -math.inf, 2.0])
    out, lse = _check(args, provider)
    assert (out[0, 1] == 0).all() and (out[1] == 0).all()
    assert torch.isneginf(lse[0, :, 1]).all() and torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_attn_sink_scales_the_output_and_leaves_the_lse(provider):
    args = _sparse_args(2)
    plain_out, plain_lse = _call(args, provider)
    args[9] = torch.tensor([math.inf, -math.inf, 0.0, -1.5])
    out, lse = _check(args, provider)
    torch.testing.assert_close(lse, plain_lse)                      # the LSE excludes the sink
    assert (out[:, :, 0] == 0).all()                                # +inf: nothing left
    torch.testing.assert_close(out[:, :, 1], plain_out[:, :, 1])    # -inf: no effect
    keep = torch.sigmoid(plain_lse[:, 3] - (-1.5))                  # [b, s_q]
    torch.testing.assert_close(out[:, :, 3], plain_out[:, :, 3] * keep[..., None])


@pytest.mark.parametrize("provider", PROVIDERS)
def test_extra_cache_joins_the_same_softmax(provider):
    """Selecting half of the slots from an extra cache equals selecting them all from one."""
    args = _sparse_args(3, topk=6)
    gen = torch.Generator().manual_seed(4)
    extra = torch.randn(2, 2, 1, 48, generator=gen)
    extra_idx = torch.tensor([[[3, 0, -1], [1, 1, 2]], [[2, 2, 3], [0, -1, -1]]], dtype=I32)
    both = list(args)
    both[10], both[11], both[13] = extra, extra_idx, torch.tensor([2, 3], dtype=I32)
    out, lse = _check(both, provider)
    merged = torch.cat([args[1].view(12, 48), extra.view(4, 48)])[:, None, None]
    shifted = torch.where(extra_idx >= 0, extra_idx + 12, -1)
    shifted[0, :, 2:] = -1                                              # extra_topk_length 2
    one = list(args)
    one[1], one[8] = merged, torch.cat([args[8], shifted], dim=-1)
    out1, lse1 = _call(one, provider)
    torch.testing.assert_close(out, out1, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(lse, lse1, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_strided_and_expanded_inputs(provider):
    """q out of a wider tensor, indices shared by every query row (stride 0), an expanded sink
    and a page-strided fp8 cache at an odd byte offset (read byte by byte)."""
    args = _sparse_args(5, dtype=torch.bfloat16, d=288, dv=256, fp8=True)
    q, cache = args[0], args[1]
    wide = torch.full((*q.shape[:3], q.shape[3] + 5), float("nan"), dtype=q.dtype)
    wide[..., 2:2 + q.shape[3]] = q
    padded = torch.full((*cache.shape[:3], cache.shape[3] + 3), 0xFF, dtype=torch.uint8)
    padded[..., 1:1 + cache.shape[3]] = cache.view(torch.uint8)
    args[0], args[1] = wide[..., 2:2 + q.shape[3]], padded[..., 1:1 + cache.shape[3]]
    args[8] = args[8][:, :1].expand(-1, 2, -1)
    args[9] = torch.tensor([0.25]).expand(4)
    _check(args, provider)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [80, 64], ids=["rope16", "no_rope"])
def test_dense_several_query_tokens(provider, causal, head_dim):
    """Dense pages, 4 query tokens per request, bottom-right causal; a request with fewer keys
    than queries (its first rows see nothing), shuffled pages, garbage ids past the end. Without
    a rope part (D = Dv) Triton reads the pages with its slot kernel, else the paged kernel."""
    gen = torch.Generator().manual_seed(6)
    values = torch.randn(6, 4, head_dim, generator=gen)
    table = torch.tensor([[4, 1, 2 ** 31 - 1], [0, -1, 7]], dtype=I32)
    seqlens = torch.tensor([10, 2], dtype=I32)
    used = torch.zeros(6, 4, dtype=torch.bool)
    used[4], used[1], used[2, :2], used[0, :2] = True, True, True, True
    cache = flashmla_cache(values, used, 64, False, torch.float32)
    q = torch.randn(2, 4, 3, head_dim, generator=gen)
    args = [q, cache, table, seqlens, 64, 0.2, causal, False, None, None, None, None, None, None]
    out, lse = _check(args, provider)
    if causal:
        assert (out[1, :2] == 0).all() and torch.isneginf(lse[1, :, :2]).all()


def test_fp8_tokens_decode_as_flashmla_lays_them_out():
    tokens = torch.randn(3, 576) * 3
    raw = quantize_fp8_tokens(tokens, 512)
    assert raw.shape == (3, fp8_token_bytes(576, 512)) == (3, 656)
    for t in range(3):
        decoded = torch.tensor(oracle.fp8_token(bytes(raw[t].view(torch.uint8).tolist()), 576,
                                                512), dtype=torch.float64)
        torch.testing.assert_close(decoded[512:], tokens[t, 512:].to(torch.bfloat16).double())
        err = (decoded[:512] - tokens[t, :512].double()).abs()
        assert err.max() <= tokens[t, :512].abs().max() / 448 * 16     # e4m3: 3 mantissa bits


def test_get_mla_metadata_is_a_plan_results_never_depend_on():
    meta, none = xpu_ops.get_mla_metadata()
    assert none is None and isinstance(meta, xpu_ops.ops.flash_mla_kvcache.FlashMLASchedMeta)
    seqlens = torch.tensor([3, 9], dtype=I32)
    sched, splits = xpu_ops.get_mla_metadata(seqlens, 2 * 4, 1, 4, False, 5)
    assert sched.dtype == splits.dtype == I32 and splits.tolist() == [0, 1, 2]
    args = _sparse_args(7)
    base = xpu_ops.flash_mla_with_kvcache(*args[:4], 32, None, None, 0.3, indices=args[8])
    foreign = type("FlashMLASchedMeta", (), {})()        # FlashMLA's own plan class
    for plan in ((meta, None), (sched, splits), (torch.zeros(9, 8, dtype=I32), None),
                 (foreign, None)):
        got = xpu_ops.flash_mla_with_kvcache(*args[:4], 32, *plan, 0.3, indices=args[8])
        assert all(torch.equal(g, w) for g, w in zip(got, base))


def test_wrapper_defaults_follow_flashmla():
    args = _sparse_args(8)
    out, lse = xpu_ops.flash_mla_with_kvcache(args[0], args[1], head_dim_v=32,
                                              indices=args[8])
    expected, expected_lse = oracle.flash_mla_with_kvcache(*args[:5], 48 ** -0.5, *args[6:])
    assert_matches_oracle(out, expected, torch.float32, lse, expected_lse)


def test_compiled_fullgraph_matches_eager():
    args = _sparse_args(9)

    def step(q, cache, indices, sink):
        out, lse = xpu_ops.flash_mla_with_kvcache(q, cache, None, None, 32, None, None, 0.3,
                                                  indices=indices, attn_sink=sink)
        return out * 2, lse

    sink = torch.randn(4)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    got, want = compiled(args[0], args[1], args[8], sink), step(args[0], args[1], args[8], sink)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def _valid():
    args = _sparse_args(10)
    names = ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v"]
    kwargs = dict(zip(names, args[:5]))
    kwargs.update(softmax_scale=0.3, indices=args[8])
    return kwargs


def _bad(t):
    table, lens = torch.zeros(2, 3, dtype=I32), torch.ones(2, dtype=I32)
    dense = dict(indices=None, block_table=table, cache_seqlens=lens)
    return {
        "q 3-D": (dict(q=t["q"][0]), ValueError, "q has the wrong number of dimensions"),
        "q int": (dict(q=t["q"].int()), ValueError, "q has dtype torch.int32"),
        "cache dtype": (dict(k_cache=t["k_cache"].half()), ValueError, "k_cache has dtype"),
        "cache D": (dict(k_cache=t["k_cache"][..., :40]), ValueError,
                    r"k_cache has the wrong size in dimension 3"),
        "cache heads": (dict(k_cache=t["k_cache"].expand(-1, -1, 2, -1)), ValueError,
                        "k_cache has the wrong size in dimension 2; expected one latent"),
        "fp8 bytes": (dict(is_fp8_kvcache=True, k_cache=torch.zeros(3, 4, 1, 60,
                                                                     dtype=torch.uint8),
                           head_dim_v=128, q=torch.randn(2, 2, 4, 160)), ValueError,
                      r"k_cache has the wrong size in dimension 3; expected bytes per token"),
        "fp8 Dv": (dict(is_fp8_kvcache=True), ValueError,
                   "head_dim_v is not a whole number of fp8 scale tiles"),
        "head_dim_v big": (dict(head_dim_v=49), ValueError, "head_dim_v is out of range"),
        "head_dim_v float": (dict(head_dim_v=32.0), TypeError, "head_dim_v is not an integer"),
        "indices int64": (dict(indices=t["indices"].long()), ValueError,
                          "indices has dtype torch.int64"),
        "indices s_q": (dict(indices=t["indices"][:, :1]), ValueError,
                        r"indices has the wrong size in dimension 1"),
        "causal sparse": (dict(causal=True), ValueError, "causal is True with sparse"),
        "causal str": (dict(causal="yes"), TypeError, "causal is not a bool"),
        "sink dtype": (dict(attn_sink=torch.zeros(4, dtype=torch.float16)), ValueError,
                       "attn_sink has dtype torch.float16"),
        "sink heads": (dict(attn_sink=torch.zeros(3)), ValueError,
                       r"attn_sink has the wrong size in dimension 0"),
        "topk_length b": (dict(topk_length=torch.ones(3, dtype=I32)), ValueError,
                          r"topk_length has the wrong size in dimension 0"),
        "extra alone": (dict(extra_k_cache=t["k_cache"]), ValueError,
                        "extra_k_cache and extra_indices_in_kvcache are not given together"),
        "extra length alone": (dict(extra_topk_length=torch.ones(2, dtype=I32)), ValueError,
                               "extra_topk_length is given without"),
        "dense without table": (dict(indices=None), ValueError,
                                "block_table is None with dense attention"),
        "dense with sink": ({**dense, "attn_sink": torch.zeros(4)}, ValueError,
                            "attn_sink is given with dense attention"),
        "dense seqlens b": ({**dense, "cache_seqlens": torch.ones(3, dtype=I32)}, ValueError,
                            r"cache_seqlens has the wrong size in dimension 0"),
        "scale nan": (dict(softmax_scale=math.nan), ValueError, "softmax_scale is not finite"),
        "cache not tensor": (dict(k_cache=[1]), TypeError, "k_cache is not a tensor"),
    }


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("name", list(_bad(_valid())))
def test_argument_errors(name, fake):
    t = _valid()
    change, exc, match = _bad(t)[name]
    call = lambda **kw: xpu_ops.flash_mla_with_kvcache(**kw)  # noqa: E731
    assert_named_error(call, {**t, **change}, fake, "flash_mla_with_kvcache", exc, match)


def test_scheduler_and_descale_arguments_are_typed():
    t = _valid()
    with pytest.raises(TypeError, match="^flash_mla_with_kvcache: tile_scheduler_metadata is"):
        xpu_ops.flash_mla_with_kvcache(**t, tile_scheduler_metadata="plan")
    with pytest.raises(TypeError, match="^flash_mla_with_kvcache: num_splits is not a tensor"):
        xpu_ops.flash_mla_with_kvcache(**t, num_splits=3)
    with pytest.raises(ValueError, match="^flash_mla_with_kvcache: descale_q does not match "
                                         "the dtype of q"):
        xpu_ops.flash_mla_with_kvcache(**t, descale_q=torch.ones(1))   # q is not fp8


def test_the_raw_op_checks_its_scalars():
    args = _sparse_args(11)
    args[5] = math.inf
    with pytest.raises(ValueError, match="^flash_mla_with_kvcache: softmax_scale is not finite"):
        OP(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("seqlen_q,topk", [(1, 2048), (2, 128)])
def test_deepseek_shapes_on_gpu(fp8, seqlen_q, topk):
    """DeepSeek-V3.2 decode shapes (128 heads, 576/512, page 64) on the GPU: Triton against
    the reference provider (itself checked against the oracle on the CPU), plus a dense causal
    MTP step."""
    gen = torch.Generator().manual_seed(12)
    b, pages = 4, (80, 64)
    values = torch.randn(*pages, 576, generator=gen) / 4
    cache = flashmla_cache(values, torch.ones(pages, dtype=torch.bool), 512, fp8,
                           torch.bfloat16).cuda()
    indices = torch.randint(-1, pages[0] * pages[1], (b, seqlen_q, topk), generator=gen)
    q = (torch.randn(b, seqlen_q, 128, 576, generator=gen) / 4).to(torch.bfloat16).cuda()
    args = [q, cache, None, None, 512, 576 ** -0.5, False, fp8, indices.to(I32).cuda(),
            torch.randn(128).cuda(), None, None,
            torch.tensor([topk, 0, topk // 2, 7], dtype=I32).cuda(), None]
    table = torch.randperm(pages[0], generator=gen)[:b * 20].view(b, 20).to(I32).cuda()
    dense = [q, cache, table, torch.tensor([1280, 3, 700, 64], dtype=I32).cuda(), 512,
             576 ** -0.5, True, fp8, None, None, None, None, None, None]
    for call in (args, dense):
        with xpu_ops.use_provider("reference"):
            want = OP(*call)
        with xpu_ops.use_provider("triton"):
            got = OP(*call)
        torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("change,match", [
    (dict(cache_seqlens=torch.tensor([4, 13], dtype=I32)), "cache_seqlens is out of range"),
    (dict(block_table=torch.tensor([[0, 9, 1], [2, 1, 0]], dtype=I32)),
     "block_table has a page id out of range in an entry that is read"),
])
def test_debug_checks_reject_inconsistent_dense_metadata(change, match):
    gen = torch.Generator().manual_seed(14)
    kwargs = dict(q=torch.randn(2, 1, 2, 48, generator=gen),
                  k_cache=torch.randn(3, 4, 1, 48, generator=gen),
                  block_table=torch.tensor([[0, 2, -1], [2, 1, 0]], dtype=I32),
                  cache_seqlens=torch.tensor([7, 12], dtype=I32), head_dim_v=32)
    xpu_ops.flash_mla_with_kvcache(**kwargs)                 # consistent: fine
    with xpu_ops.debug_checks():
        xpu_ops.flash_mla_with_kvcache(**kwargs)
        with pytest.raises(ValueError, match=f"^flash_mla_with_kvcache: {match}"):
            xpu_ops.flash_mla_with_kvcache(**{**kwargs, **change})


@pytest.mark.parametrize("provider", PROVIDERS)
def test_empty_caches_and_batches(provider):
    """A cache of 0 pages (sparse and dense), and a batch of 0 requests: 0 / -inf, right shapes."""
    gen = torch.Generator().manual_seed(15)
    q = torch.randn(1, 2, 4, 80, generator=gen)
    empty = torch.randn(0, 4, 1, 80)
    sparse = [q, empty, None, None, 64, 0.1, False, False,
              torch.tensor([[[0, -1], [3, 1]]], dtype=I32), None, None, None, None, None]
    dense = [q, empty, torch.zeros(1, 1, dtype=I32), torch.zeros(1, dtype=I32), 64, 0.1, True,
             False, None, None, None, None, None, None]
    for args in (sparse, dense):
        out, lse = _check(args, provider)
        assert (out == 0).all() and torch.isneginf(lse).all()
    none = [q[:0], torch.randn(2, 4, 1, 80), None, None, 64, 0.1, False, False,
            torch.zeros(0, 2, 3, dtype=I32), None, None, None, None, None]
    out, lse = _call(none, provider)
    assert out.shape == (0, 2, 4, 64) and lse.shape == (0, 4, 2)


@pytest.mark.parametrize("provider", [p for p in PROVIDERS if p.values[0] == "triton"])
@pytest.mark.parametrize("index", [4, 5, 6])
def test_split_kv_matches_the_oracle(provider, index, monkeypatch):
    """Triton's split-KV launch (forced to 3 splits; the extra cache joins the last split)."""
    from xpu_ops.triton import flash_mla as triton_flash_mla
    monkeypatch.setattr(triton_flash_mla, "plan_splits", lambda *args: 3)
    _check(reseeded_sample(OP, index, seed=7100 + index), provider)


@pytest.mark.parametrize("provider", [p for p in PROVIDERS if p.values[0] == "triton"])
def test_split_kv_shares_the_ranks(provider, monkeypatch):
    """40 fp8 slots in 3 splits of whole tiles (16, 16, 8 ranks) with a sink and an extra cache
    in the last split, against the oracle."""
    from xpu_ops.triton import flash_mla as triton_flash_mla
    monkeypatch.setattr(triton_flash_mla, "plan_splits", lambda *args: 3)
    args = _sparse_args(16, d=288, dv=256, topk=40, pages=(6, 8), dtype=torch.bfloat16, fp8=True)
    args[9] = torch.tensor([0.0, math.inf, -1.0, 1.0])
    args[10], args[11] = args[1][:2], torch.randint(-1, 16, (2, 2, 5), dtype=I32)
    args[12] = torch.tensor([40, 17], dtype=I32)
    _check(args, provider)


def _model1_cache(values: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4 pages of ``values [num_pages, page_size, 512]``: 448 e4m3 latent values
    scaled per 64 by powers of two (UE8M0), 64 bf16 rope values, scales at the page end; the
    page stride padded as sgl-kernel-xpu pads it; unused tokens all 0xFF (NaN)."""
    num_pages, page_size, _ = values.shape
    page_bytes = page_size * 576 + -(-page_size * 8 // 576) * 576
    raw = torch.full((num_pages, page_bytes), 0xFF, dtype=torch.uint8)
    tiles = values[..., :448].unflatten(-1, (7, 64))
    exponent = torch.ceil(torch.log2(tiles.abs().amax(-1).clamp_min(1e-30) / 448)) + 127
    latent = (tiles / torch.exp2(exponent - 127)[..., None]).flatten(-2).to(torch.float8_e4m3fn)
    data = torch.cat([latent.view(torch.uint8),
                      values[..., 448:].to(torch.bfloat16).view(torch.uint8)], -1)
    groups = torch.cat([exponent.to(torch.uint8), torch.zeros(num_pages, page_size, 1,
                                                              dtype=torch.uint8)], -1)
    data[~used], groups[~used] = 0xFF, 0xFF
    raw[:, :page_size * 576] = data.flatten(1)
    raw[:, page_size * 576:page_size * 584] = groups.flatten(1)
    return raw.view(torch.float8_e4m3fn).as_strided((num_pages, page_size, 1, 584),
                                                    (page_bytes, 584, 584, 1))


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_deepseek_v4_pages_on_the_reference(dense):
    """DeepSeek-V4 (FlashMLA MODEL1) fp8 pages, D = Dv = 512, against the oracle (sparse with a
    sliding-window extra cache and sinks; dense causal); Triton declines them by name."""
    gen = torch.Generator().manual_seed(17)
    used = torch.rand(3, 8, generator=gen) < 0.8
    cache = _model1_cache(torch.randn(3, 8, 512, generator=gen), used)
    q = torch.randn(2, 2, 4, 512, generator=gen).to(torch.bfloat16)
    slots = torch.nonzero(used.flatten()).flatten().to(I32)
    if dense:
        used = torch.ones(3, 8, dtype=torch.bool)
        cache = _model1_cache(torch.randn(3, 8, 512, generator=gen), used)
        args = [q, cache, torch.tensor([[2, 0], [1, 2]], dtype=I32),
                torch.tensor([13, 5], dtype=I32), 512, 512 ** -0.5, True, True, None, None,
                None, None, None, None]
    else:
        pick = torch.randint(0, len(slots), (2, 2, 6), generator=gen)
        indices = torch.where(pick % 5 == 0, -1, slots[pick]).to(I32)
        extra = _model1_cache(torch.randn(1, 4, 512, generator=gen), torch.ones(1, 4,
                                                                                dtype=torch.bool))
        args = [q, cache, None, None, 512, 512 ** -0.5, False, True, indices,
                torch.tensor([0.5, -math.inf, math.inf, 1.0]), extra,
                torch.randint(-1, 4, (2, 2, 3), generator=gen).to(I32),
                torch.tensor([6, 4], dtype=I32), torch.tensor([3, 1], dtype=I32)]
    _check(args, "reference")
    from .triton_mode import INTERPRETED
    if INTERPRETED:
        with running("triton"), pytest.raises(NotImplementedError, match="DeepSeek-V4"):
            OP(*args)
    squeezed = cache.as_strided(cache.shape, (100, 584, 584, 1))
    with pytest.raises(ValueError, match="k_cache has pages too small for DeepSeek-V4"):
        OP(args[0], squeezed, *args[2:])
