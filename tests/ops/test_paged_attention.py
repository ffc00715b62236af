"""``flash_attn_with_kvcache``: numerics against the float64 oracle for every provider that can
run, the public wrapper's forms and defaults, every argument check, and the cases from public bug
reports."""

from __future__ import annotations

import math

import pytest
import torch

import xpu_ops
from xpu_ops.testing import ATTENTION_CASES, NO_LSE_CASES, attention_case_inputs, paged_kv_cache

from . import oracle
from .utils import OUT_TOL, assert_matches_oracle, case_id, error_message, runnable_providers

OP = torch.ops.xpu_ops.flash_attn_with_kvcache
PROVIDERS = runnable_providers("flash_attn_with_kvcache")
I32 = torch.int32


def _run_case(case, provider, seed, dtype=None):
    args, kwargs = attention_case_inputs(case, "cpu", dtype, torch.Generator().manual_seed(seed))
    with xpu_ops.use_provider(provider):
        lse = OP(*args, **kwargs)
    out64, lse64 = oracle.flash_attn_with_kvcache(*args, **kwargs)
    assert_matches_oracle(args[6], out64, args[6].dtype, lse, lse64)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", range(len(ATTENTION_CASES)),
                         ids=[case_id(c) for c in ATTENTION_CASES])
def test_matches_oracle(provider, index):
    _run_case(ATTENTION_CASES[index], provider, seed=1000 + index)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", range(len(NO_LSE_CASES)),
                         ids=[case_id(c) for c in NO_LSE_CASES])
def test_without_the_lse_matches_oracle_and_returns_it_empty(provider, index):
    """``return_softmax_lse=False``: the output as with the LSE, and an empty ``[Hq, 0]`` LSE
    (the fake's shape) on every provider, whichever path computes it."""
    _run_case(NO_LSE_CASES[index], provider, seed=3000 + index)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("index", [3, 15])   # D 192/Dv 128 MQA; window + softcap + sinks, GQA 3
def test_matches_oracle_per_dtype(provider, dtype, index):
    _run_case(ATTENTION_CASES[index], provider, seed=2000 + index, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# Public wrapper: forms, defaults and compatibility keywords
# ----------------------------------------------------------------------------------------------

def _wrapper_inputs(index=1, seed=3):
    args, kw = attention_case_inputs(ATTENTION_CASES[index], "cpu",
                                     gen=torch.Generator().manual_seed(seed))
    names = ("q", "k_cache", "v_cache", "cache_seqlens", "page_table", "cu_seqlens_q")
    return dict(zip(names, args[:6])), args, kw


def test_wrapper_packed_matches_oracle_and_default_scale():
    t, args, kw = _wrapper_inputs()
    out, lse = xpu_ops.flash_attn_with_kvcache(**t, causal=True, return_softmax_lse=True)
    d = t["q"].shape[-1]
    out64, lse64 = oracle.flash_attn_with_kvcache(*args, **dict(kw, softmax_scale=d ** -0.5))
    assert_matches_oracle(out, out64, out.dtype, lse, lse64)


def test_wrapper_qv_default_scale_includes_dv():
    t, args, kw = _wrapper_inputs(index=14)            # the qv case: D 64, Dv 128
    out = xpu_ops.flash_attn_with_kvcache(**t, qv=args[7], causal=True)
    scale = 1 / math.sqrt(t["q"].shape[-1] + t["v_cache"].shape[-1])
    out64, _ = oracle.flash_attn_with_kvcache(*args, **dict(kw, softmax_scale=scale))
    assert_matches_oracle(out, out64, out.dtype)


def test_wrapper_4d_q():
    gen = torch.Generator().manual_seed(4)
    b, s, hq, hkv, d = 3, 2, 4, 2, 64
    (k_cache, v_cache), page_table, cache_seqlens = paged_kv_cache(
        gen, [5, 2, 9], 4, [(hkv, d), (hkv, d)], dtype=torch.float32, device="cpu")
    q = torch.randn(b, s, hq, d, generator=gen)
    out, lse = xpu_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                               page_table=page_table, causal=True,
                                               return_softmax_lse=True)
    assert out.shape == (b, s, hq, d) and lse.shape == (b, hq, s)
    cu = torch.arange(0, b + 1, dtype=I32) * s
    out64, lse64 = oracle.flash_attn_with_kvcache(
        q.flatten(0, 1), k_cache, v_cache, cache_seqlens, page_table, cu, None, None, None, None,
        None, None, max_seqlen_q=s, softmax_scale=d ** -0.5, causal=True, window_size_left=-1,
        window_size_right=0, softcap=0.0)
    assert_matches_oracle(out.flatten(0, 1), out64, out.dtype,
                          lse.transpose(0, 1).flatten(1), lse64)
    given = torch.full_like(out, float("nan"))
    assert xpu_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                           page_table=page_table, causal=True, out=given) is given
    torch.testing.assert_close(given, out, rtol=0, atol=0)
    # An out whose [b, s] dims cannot merge into one token dim (a transposed buffer).
    given = torch.full((b, hq, s, d), float("nan")).transpose(1, 2)
    assert xpu_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                           page_table=page_table, causal=True, out=given) is given
    torch.testing.assert_close(given, out, rtol=0, atol=0)


def test_wrapper_contiguous_cache_without_page_table():
    gen = torch.Generator().manual_seed(5)
    b, seqlen_k, hq, d = 2, 7, 2, 64
    k_cache, v_cache = (torch.randn(b, seqlen_k, hq, d, generator=gen) for _ in range(2))
    q = torch.randn(b, 3, hq, d, generator=gen)
    out = xpu_ops.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True)
    for r in range(b):
        mask = oracle.visible_mask(3, seqlen_k, causal=True)
        o, _ = oracle.attend(q[r], k_cache[r], v_cache[r], mask, scale=d ** -0.5)
        torch.testing.assert_close(out[r].double(), o, **OUT_TOL[torch.float32])


def test_wrapper_accepts_num_splits_as_a_hint():
    """sglang's FA3 backend passes num_splits (1 with deterministic inference) on every call,
    so any int >= 0 is accepted and changes the result by rounding at most (the reference:
    the same bits for 0 and n > 1; 1 runs each request on its own, batch invariant, see
    test_batch_invariance.py); the defaults of the unimplemented keywords pass too."""
    t, _, _ = _wrapper_inputs()
    ref = xpu_ops.flash_attn_with_kvcache(**t, causal=True)
    for num_splits in (0, 1, 4):
        hinted = xpu_ops.flash_attn_with_kvcache(**t, causal=True, num_splits=num_splits,
                                                 pack_gqa=None, sm_margin=0,
                                                 rotary_interleaved=True, attention_chunk=0)
        tol = 1e-5 if num_splits == 1 else 0
        torch.testing.assert_close(hinted, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("value, exc, match", [
    (-1, ValueError, r"num_splits is negative; expected 0 \(automatic\) or a split count >= 1, "
                     r"got -1\.$"),
    (1.5, TypeError, r"num_splits is not an integer; expected an int \(0: automatic\), got "
                     r"float\.$")])
def test_wrapper_rejects_bad_num_splits(value, exc, match):
    t, _, _ = _wrapper_inputs()
    with pytest.raises(exc, match=f"^flash_attn_with_kvcache: {match}"):
        xpu_ops.flash_attn_with_kvcache(**t, num_splits=value)


@pytest.mark.parametrize("keyword, value, rule, got", [
    ("attention_chunk", 8, "None or 0", "8"),     # the one FA3 keyword left (API.md)
])
def test_wrapper_unimplemented_keywords(keyword, value, rule, got):
    t, _, _ = _wrapper_inputs()
    with pytest.raises(NotImplementedError, match=f"keyword {keyword} is accepted for "
                       f"compatibility .* expected {rule} \\(its default\\), got {got}"):
        xpu_ops.flash_attn_with_kvcache(**t, **{keyword: value})


def test_wrapper_accepts_bidirectional_block_ids_none():
    # sglang 0.5.23's XPU backend passes bidirectional_block_ids=None on every extend call.
    t, _, _ = _wrapper_inputs()
    expected = xpu_ops.flash_attn_with_kvcache(**t)
    torch.testing.assert_close(xpu_ops.flash_attn_with_kvcache(**t, bidirectional_block_ids=None),
                               expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# Cases from public bug reports
# ----------------------------------------------------------------------------------------------

def _one_request(q_len, k_len, *, hq=2, hkv=2, d=64, page_size=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    (k_cache, v_cache), page_table, cache_seqlens = paged_kv_cache(
        gen, [k_len], page_size, [(hkv, d), (hkv, d)], dtype=torch.float32, device="cpu")
    q = torch.randn(q_len, hq, d, generator=gen)
    t = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
             page_table=page_table, cu_seqlens_q=torch.tensor([0, q_len], dtype=I32))
    keys = oracle.paged_keys(k_cache, page_table, 0, k_len)
    values = oracle.paged_keys(v_cache, page_table, 0, k_len)
    return t, keys, values


def _explicit_mask(q_len, k_len, allowed):
    """``allowed(pos) -> iterable of key indices``, API.md's ``pos = k_len - q_len + i``."""
    mask = torch.zeros(q_len, k_len, dtype=torch.bool)
    for i in range(q_len):
        for j in allowed(k_len - q_len + i):
            if 0 <= j < k_len:
                mask[i, j] = True
    return mask


@pytest.mark.parametrize("provider", PROVIDERS)
def test_hf_sliding_window(provider):
    q_len, k_len, w = 6, 11, 4
    t, keys, values = _one_request(q_len, k_len)
    mask = _explicit_mask(q_len, k_len, lambda pos: range(max(0, pos - w + 1), pos + 1))
    expected, _ = oracle.attend(t["q"], keys, values, mask, scale=64 ** -0.5)
    with xpu_ops.use_provider(provider):
        out = xpu_ops.flash_attn_with_kvcache(**t, causal=True, window_size=(w - 1, 0))
        assert_matches_oracle(out, expected, torch.float32)
        full = _explicit_mask(q_len, k_len, lambda pos: range(0, pos + 1))
        expected_full, _ = oracle.attend(t["q"], keys, values, full, scale=64 ** -0.5)
        assert not torch.allclose(expected_full, expected)   # the window matters here
        for window, causal in (((k_len - 1, 0), True), ((-1, 0), True), ((-1, -1), True),
                               ((-1, 0), False), ((k_len - 1, 0), False), ((-1, 3), True)):
            same = xpu_ops.flash_attn_with_kvcache(**t, causal=causal, window_size=window)
            assert_matches_oracle(same, expected_full, torch.float32)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_window_2_0_non_causal_means_right_zero(provider):
    q_len, k_len = 3, 9
    t, keys, values = _one_request(q_len, k_len, page_size=16)
    mask = _explicit_mask(q_len, k_len, lambda pos: range(pos - 2, pos + 1))
    expected, _ = oracle.attend(t["q"], keys, values, mask, scale=64 ** -0.5)
    with xpu_ops.use_provider(provider):
        out = xpu_ops.flash_attn_with_kvcache(**t, causal=False, window_size=(2, 0))
    assert_matches_oracle(out, expected, torch.float32)
    unbounded = _explicit_mask(q_len, k_len, lambda pos: range(pos - 2, k_len))
    assert not torch.allclose(oracle.attend(t["q"], keys, values, unbounded,
                                            scale=64 ** -0.5)[0], expected)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_nan_past_cache_seqlens_and_in_unused_pages(provider):
    gen = torch.Generator().manual_seed(7)
    page_size, hq, hkv, d = 16, 4, 2, 64
    k_lens, q_lens = [5, 20, 16, 1], [2, 3, 1, 1]
    (k_cache, v_cache), page_table, cache_seqlens = paged_kv_cache(
        gen, k_lens, page_size, [(hkv, d), (hkv, d)], dtype=torch.float32, device="cpu",
        spare_pages=2, extra_columns=2)
    assert k_cache.isnan().any()
    # Unused page-table entries point at a spare page that is all NaN, or out of range.
    spare = int(torch.nonzero(k_cache.isnan().flatten(1).all(dim=1))[0])
    for r, n in enumerate(k_lens):
        used = -(-n // page_size)
        page_table[r, used:] = torch.tensor([spare, 10 ** 6, -1, spare])[:page_table.shape[1]
                                                                             - used]
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    cu = torch.tensor([0, 2, 5, 6, 7], dtype=I32)
    with xpu_ops.use_provider(provider):
        out, lse = xpu_ops.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
            cu_seqlens_q=cu, max_seqlen_q=3, causal=True, return_softmax_lse=True)
    out64, lse64 = oracle.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens, page_table, cu, None, None, None, None, None, None,
        max_seqlen_q=3, softmax_scale=d ** -0.5, causal=True, window_size_left=-1,
        window_size_right=0, softcap=0.0)
    assert_matches_oracle(out, out64, torch.float32, lse, lse64)
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("q_len", [1, 3])
def test_sinks_closed_form(provider, q_len):
    k_len, hq, d = 16, 4, 64
    sinks = torch.tensor([0.5, 1.0, 2.0, 3.0])
    t, keys, values = _one_request(q_len, k_len, hq=hq, hkv=hq, d=d, page_size=16)
    t["q"] = torch.zeros(q_len, hq, d)
    t["v_cache"] = torch.where(t["v_cache"].isnan(), t["v_cache"], 1.0)  # V = 1, garbage kept
    with xpu_ops.use_provider(provider):
        out, lse = xpu_ops.flash_attn_with_kvcache(**t, sinks=sinks, return_softmax_lse=True)
    closed = (k_len / (k_len + torch.exp(sinks.double())))[None, :, None].expand(q_len, hq, d)
    expected, expected_lse = oracle.attend(t["q"], keys, torch.ones_like(values),
                                           torch.ones(q_len, k_len, dtype=torch.bool),
                                           scale=d ** -0.5, sinks=sinks)
    torch.testing.assert_close(expected, closed, rtol=1e-12, atol=1e-12)   # oracle == formula
    assert_matches_oracle(out, expected, torch.float32, lse, expected_lse)


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("arg", ["cu_seqlens_q", "cache_seqlens", "page_table"])
def test_int64_index_tensors_rejected_naming_the_argument(arg, fake):
    t, _, _ = _wrapper_inputs()
    t[arg] = t[arg].long()
    msg = error_message(lambda **kw: xpu_ops.flash_attn_with_kvcache(**kw, causal=True), t, fake)
    assert msg.startswith(f"ValueError: flash_attn_with_kvcache: {arg} has dtype torch.int64; "
                          f"expected torch.int32, got torch.int64."), msg
    assert msg == error_message(lambda **kw: xpu_ops.flash_attn_with_kvcache(**kw, causal=True), t,
                         not fake)


@pytest.mark.parametrize("hq,hkv", [(3, 2), (33, 2)])
def test_incompatible_head_counts(hq, hkv):
    t, _, _ = _one_request(2, 5, hq=hq, hkv=hkv)
    with pytest.raises(ValueError, match=f"head counts are incompatible.*Hq={hq}, Hkv={hkv}"):
        xpu_ops.flash_attn_with_kvcache(**t)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_out_under_compile_writes_the_callers_buffer(backend):
    t, args, kw = _wrapper_inputs()
    buffer = torch.full((t["q"].shape[0] + 3, *args[6].shape[1:]), float("nan"))

    def step(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out):
        o, lse = xpu_ops.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
            cu_seqlens_q=cu_seqlens_q, max_seqlen_q=kw["max_seqlen_q"], causal=True, out=out,
            return_softmax_lse=True)
        return o * 2, lse

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    view = buffer[: t["q"].shape[0]]
    doubled, lse = compiled(**t, out=view)
    expected_out = xpu_ops.flash_attn_with_kvcache(**t, causal=True)
    torch.testing.assert_close(view, expected_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(doubled, 2 * expected_out, rtol=1e-6, atol=1e-6)
    assert buffer[t["q"].shape[0]:].isnan().all()       # nothing past the view is touched


# ----------------------------------------------------------------------------------------------
# fp8 KV cache end to end: quantize through store_kv_cache, attend with descale
# ----------------------------------------------------------------------------------------------

# Against the unquantized float64 oracle: e4m3 keeps 3 mantissa bits (rounding error <= 2^-4
# relative), e5m2 keeps 2 (<= 2^-3), on keys (through the softmax) and values; the largest error
# measured on this data is 0.07 (e4m3) and 0.13 (e5m2), so the bound is twice that.
FP8_TOL = {torch.float8_e4m3fn: dict(atol=0.15, rtol=0.0),
           torch.float8_e5m2: dict(atol=0.3, rtol=0.0)}


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("fp8", list(FP8_TOL), ids=["e4m3", "e5m2"])
def test_fp8_cache_end_to_end(provider, fp8):
    gen = torch.Generator().manual_seed(13)
    page_size, hq, hkv, d, k_lens, q_lens = 4, 4, 2, 64, [9, 14], [2, 3]
    k_scale, v_scale = 0.5, 2.0
    (k_cache, v_cache), page_table, cache_seqlens = paged_kv_cache(
        gen, k_lens, page_size, [(hkv, d), (hkv, d)], dtype=fp8, device="cpu")
    loc = torch.cat([torch.tensor([int(page_table[r, j // page_size]) * page_size
                                   + j % page_size for j in range(n)])
                     for r, n in enumerate(k_lens)])
    k, v = (torch.randn(sum(k_lens), hkv, d, generator=gen) for _ in range(2))
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    cu = torch.tensor([0, 2, 5], dtype=I32)
    with xpu_ops.use_provider(provider):
        xpu_ops.store_kv_cache(k_cache, v_cache, loc, k, v, k_scale=k_scale, v_scale=v_scale)
        out = xpu_ops.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
            cu_seqlens_q=cu, causal=True, k_descale=torch.full((2, hkv), k_scale),
            v_descale=torch.full((2, hkv), v_scale))
    for r, (k0, k1) in enumerate(((0, 9), (9, 23))):
        mask = oracle.visible_mask(q_lens[r], k1 - k0, causal=True)
        expected, _ = oracle.attend(q[cu[r]:cu[r + 1]], k[k0:k1], v[k0:k1], mask,
                                    scale=d ** -0.5)
        try:
            torch.testing.assert_close(out[cu[r]:cu[r + 1]].double(), expected, **FP8_TOL[fp8])
        except AssertionError:
            if provider != "triton":
                raise
            # Triton 3.9's interpreter drops the carry when fp32 -> fp8 rounds up to the next
            # power of two (1.96 -> 1.0) in store_kv_cache; compiled kernels convert in hardware.
            pytest.xfail("Triton interpreter fp32->fp8 rounding bug (CPU only)")


@pytest.mark.parametrize("provider", PROVIDERS)
def test_strided_views(provider):
    """q sliced out of a fused qkv projection, K/V views of one combined KV buffer, and out a
    column slice or a transpose of a larger buffer: the values are read and written through the
    strides. A provider may decline a layout it cannot write (NotImplementedError); the default
    selection must then still give the right answer through the next provider."""
    gen = torch.Generator().manual_seed(14)
    page_size, hq, hkv, d = 4, 4, 2, 64
    (kc, vc), page_table, cache_seqlens = paged_kv_cache(
        gen, [9, 6], page_size, [(hkv, d), (hkv, d)], dtype=torch.float32, device="cpu")
    qkv = torch.randn(5, (hq + 2 * hkv) * d, generator=gen)
    q = qkv[:, :hq * d].view(5, hq, d)
    kv = torch.stack([kc, vc], dim=1)                          # [num_pages, 2, page_size, H, D]
    cu = torch.tensor([0, 2, 5], dtype=I32)
    kw = dict(cache_seqlens=cache_seqlens, page_table=page_table, cu_seqlens_q=cu, causal=True)
    expected, _ = oracle.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens, page_table, cu, None, None, None, None, None, None,
        max_seqlen_q=3, softmax_scale=d ** -0.5, causal=True, window_size_left=-1,
        window_size_right=0, softcap=0.0)
    assert not q.is_contiguous() and not kv[:, 0].is_contiguous()
    with xpu_ops.use_provider(provider):
        out = xpu_ops.flash_attn_with_kvcache(q, kv[:, 0], kv[:, 1], **kw)
    assert_matches_oracle(out, expected, torch.float32)
    wide = torch.full((5, hq, 2 * d), float("nan"))
    transposed = torch.full((5, d, hq), float("nan"))
    for buffer, out in ((wide, wide[..., :d]), (transposed, transposed.transpose(1, 2))):
        try:
            with xpu_ops.use_provider(provider):
                result = xpu_ops.flash_attn_with_kvcache(q, kc, vc, out=out, **kw)
        except NotImplementedError as e:
            assert provider != "reference" and "out" in str(e)
            result = xpu_ops.flash_attn_with_kvcache(q, kc, vc, out=out, **kw)
        assert result is out
        assert_matches_oracle(out, expected, torch.float32)
        assert buffer.isnan().sum() == buffer.numel() - out.numel()   # only the view is written
