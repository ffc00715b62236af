"""``store_kv_cache`` / ``store_mla_kv_cache``: only the addressed slots change (compared with a
slot-by-slot oracle), the caller's k/v are untouched, fp8 scaling, a compiled write-then-read
equals eager, and every argument check."""

from __future__ import annotations

import re

import pytest
import torch

import xpu_ops
from xpu_ops.testing import ATTENTION_CASES, attention_case_inputs

from . import oracle
from .utils import (FP8, bitwise_equal, clone, error_message, reseeded_sample, runnable_providers,
                    sample_indices)

STORE = torch.ops.xpu_ops.store_kv_cache
STORE_MLA = torch.ops.xpu_ops.store_mla_kv_cache


def _assert_cache(actual, expected, provider="reference"):
    if actual.dtype in FP8 and provider == "triton" and actual.device.type == "cpu":
        try:
            torch.testing.assert_close(actual.float(), expected.float(), rtol=0.25, atol=0.0)
        except AssertionError:
            # Triton 3.9's interpreter drops the carry when fp32 -> fp8 rounds up to the next
            # power of two (1.96 -> 1.0, not 2.0); compiled kernels convert in hardware.
            pytest.xfail("Triton interpreter fp32->fp8 rounding bug (CPU only)")
        return
    if actual.dtype in FP8:         # the oracle rounds float64 -> float32 -> fp8: allow 1 ulp
        torch.testing.assert_close(actual.float(), expected.float(), rtol=0.25, atol=0.0)
    else:
        assert bitwise_equal(actual, expected)


@pytest.mark.parametrize("provider", runnable_providers("store_kv_cache"))
@pytest.mark.parametrize("index", sample_indices(STORE))
def test_store_kv_cache_matches_oracle(provider, index):
    args = reseeded_sample(STORE, index, seed=6000 + index)
    k_cache, v_cache, loc, k, v, k_scale, v_scale = args
    expected_k = oracle.store_kv(k_cache, loc, k, None if k_scale is None else float(k_scale))
    expected_v = oracle.store_kv(v_cache, loc, v, None if v_scale is None else float(v_scale))
    k_before, v_before = clone((k, v))
    with xpu_ops.use_provider(provider):
        xpu_ops.store_kv_cache(*args)
    _assert_cache(k_cache, expected_k, provider)
    _assert_cache(v_cache, expected_v, provider)
    assert bitwise_equal(k, k_before) and bitwise_equal(v, v_before)


@pytest.mark.parametrize("provider", runnable_providers("store_mla_kv_cache"))
@pytest.mark.parametrize("index", sample_indices(STORE_MLA))
def test_store_mla_kv_cache_matches_oracle(provider, index):
    args = reseeded_sample(STORE_MLA, index, seed=7000 + index)
    kv_cache, loc, k_nope, k_rope = args
    expected = oracle.store_kv(kv_cache, loc, torch.cat([k_nope, k_rope], -1).flatten(1))
    with xpu_ops.use_provider(provider):
        xpu_ops.store_mla_kv_cache(kv_cache, loc, k_nope[:, 0], k_rope[:, 0])   # 2-D form
    _assert_cache(kv_cache, expected, provider)


@pytest.mark.parametrize("provider", runnable_providers("store_kv_cache"))
def test_store_kv_cache_python_float_scale(provider):
    gen = torch.Generator().manual_seed(12)
    k_cache = torch.zeros(8, 1, 4, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros(8, 1, 4, dtype=torch.float8_e4m3fn)
    k, v = torch.randn(2, 1, 4, generator=gen), torch.randn(2, 1, 4, generator=gen)
    loc = torch.tensor([6, 1])
    with xpu_ops.use_provider(provider):
        xpu_ops.store_kv_cache(k_cache, v_cache, loc, k, v, k_scale=2.0, v_scale=0.5)
    _assert_cache(k_cache, oracle.store_kv(torch.zeros_like(k_cache), loc, k, 2.0), provider)
    _assert_cache(v_cache, oracle.store_kv(torch.zeros_like(v_cache), loc, v, 0.5), provider)


def test_compiled_write_then_read_equals_eager():
    """The write op declares the caches it mutates, so Inductor keeps the read after it."""
    args, kw = attention_case_inputs(ATTENTION_CASES[1], "cpu",            # page 4, 3 requests
                                     gen=torch.Generator().manual_seed(8))
    q, k_cache, v_cache, cache_seqlens, page_table, cu_q = args[:6]
    page_size = k_cache.shape[1]
    # The newest token of every request, written through store_kv_cache, then attended to.
    last = cache_seqlens.long() - 1
    loc = page_table.long().gather(1, (last // page_size)[:, None])[:, 0] * page_size \
        + last % page_size
    new_k, new_v = torch.randn(3, *k_cache.shape[2:]), torch.randn(3, *v_cache.shape[2:])

    def step(k_cache, v_cache):
        xpu_ops.store_kv_cache(k_cache, v_cache, loc, new_k * 2, new_v)
        return xpu_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                               page_table=page_table, cu_seqlens_q=cu_q,
                                               max_seqlen_q=kw["max_seqlen_q"], causal=True)

    eager_caches = clone((k_cache, v_cache))
    expected = step(*eager_caches)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    caches = clone((k_cache, v_cache))
    out = compiled(*caches)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert bitwise_equal(caches[0], eager_caches[0]) and bitwise_equal(caches[1], eager_caches[1])
    flat = caches[0].flatten(0, 1)
    assert torch.equal(flat[loc], new_k * 2)       # the write happened before the read
    out64, _ = oracle.flash_attn_with_kvcache(q, *caches, cache_seqlens, page_table, cu_q,
                                              *args[6:], **kw)
    torch.testing.assert_close(out.double(), out64, atol=2e-5, rtol=2e-5)


def _valid_kv():
    return dict(k_cache=torch.randn(16, 2, 8), v_cache=torch.randn(16, 2, 4),
                loc=torch.tensor([3, 9]), k=torch.randn(2, 2, 8), v=torch.randn(2, 2, 4))


def _bad_kv(t):
    fp8 = torch.float8_e4m3fn
    return {
        "k 2-D": dict(k=t["k"][0]),
        "k int": dict(k=t["k"].int()),
        "v dtype": dict(v=t["v"].half()),
        "v tokens": dict(v=t["v"][:1]),
        "v heads": dict(v=t["v"][:, :1]),
        "loc float": dict(loc=t["loc"].float()),
        "loc 2-D": dict(loc=t["loc"][None]),
        "loc length": dict(loc=t["loc"][:1]),
        "k_cache 2-D": dict(k_cache=t["k_cache"][0]),
        "k_cache dtype": dict(k_cache=t["k_cache"].half()),
        "k_cache heads": dict(k_cache=t["k_cache"][:, :1]),
        "k_cache head dim": dict(k_cache=t["k_cache"][..., :4]),
        "v_cache head dim": dict(v_cache=t["v_cache"][..., :2]),
        "v_cache slots": dict(v_cache=t["v_cache"][:8]),
        "k_scale not fp8": dict(k_scale=torch.ones(1)),
        "k_scale dtype": dict(k_cache=t["k_cache"].to(fp8), k_scale=torch.ones(1).double()),
        "v_scale numel": dict(v_cache=t["v_cache"].to(fp8), v_scale=torch.ones(2)),
        # The argument that is off is named, not the first one compared (fresh-user probe).
        "k dtype vs caches": dict(k=t["k"].half()),
        "v_cache dtype": dict(v_cache=t["v_cache"].half()),
        "rows dtype, fp8 caches": dict(k_cache=t["k_cache"].to(fp8), v_cache=t["v_cache"].to(fp8),
                                       v=t["v"].half()),
        "k tokens": dict(k=t["k"][:1]),
        "k heads": dict(k=t["k"][:, :1]),
        "v_cache heads": dict(v_cache=t["v_cache"][:, :1]),
        "k head dim": dict(k=t["k"][..., :4]),
        "loc sparse": dict(loc=t["loc"].to_sparse()),
    }


MATCH_KV = {"k 2-D": "k has the wrong number of dimensions", "k int": "k has dtype torch.int32",
            "v dtype": "v has dtype torch.float16", "v tokens": "v has the wrong size in dim",
            "v heads": "v has the wrong size in dimension 1", "loc float": "loc has dtype",
            "loc 2-D": "loc has the wrong number", "loc length": "loc has the wrong size",
            "k_cache 2-D": "k_cache has the wrong number of dimensions; expected 3-D or 4-D",
            "k_cache dtype": "k_cache has dtype torch.float16",
            "k_cache heads": "k_cache has the wrong size in dimension -2",
            "k_cache head dim": r"k_cache has the wrong size in dimension -1 \(D\); expected "
                                r"D = 8 as in k.shape\[2\], got shape \(16, 2, 4\)",
            "v_cache head dim": r"v_cache has the wrong size in dimension -1 \(Dv\); expected "
                                r"Dv = 4 as in v.shape\[2\]",
            "v_cache slots": "v_cache has a different number of token slots than k_cache",
            "k_scale not fp8": "k_scale is given for a cache that is not fp8",
            "k_scale dtype": "k_scale has dtype torch.float64",
            "v_scale numel": "v_scale has more than one element",
            "k dtype vs caches": r"k has dtype torch.float16; expected k_cache's dtype "
                                 r"torch.float32 \(the cache is not fp8\), got torch.float16",
            "v_cache dtype": r"v_cache has dtype torch.float16; expected k's and v's dtype "
                             r"torch.float32 or an fp8 dtype, got torch.float16",
            "rows dtype, fp8 caches": r"v has dtype torch.float16; expected k's dtype "
                                      r"torch.float32",
            "k tokens": r"k has the wrong size in dimension 0 \(N\); expected N = 2 as in "
                        r"v.shape\[0\], loc.shape\[0\], got shape \(1, 2, 8\)",
            "k heads": r"k has the wrong size in dimension 1 \(Hkv\); expected Hkv = 2 as in "
                       r"v.shape\[1\], k_cache.shape\[-2\], v_cache.shape\[-2\]",
            "v_cache heads": r"v_cache has the wrong size in dimension -2 \(Hkv\); expected "
                             r"Hkv = 2",
            "k head dim": r"k_cache has the wrong size in dimension -1 \(D\); expected D = 4 "
                          r"as in k.shape\[2\], got shape \(16, 2, 8\)",
            "loc sparse": r"loc is not a dense tensor; expected layout torch.strided, got "
                          r"torch.sparse_coo"}


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("name", list(MATCH_KV))
def test_store_kv_cache_argument_errors(name, fake):
    t = _valid_kv()
    kwargs = {**t, **_bad_kv(t)[name]}
    msg = error_message(lambda **kw: xpu_ops.store_kv_cache(**kw), kwargs, fake)
    assert msg.startswith("ValueError: store_kv_cache: ") and re.search(MATCH_KV[name], msg), msg
    if fake:
        assert msg == error_message(lambda **kw: xpu_ops.store_kv_cache(**kw), kwargs, False)


def _valid_mla():
    return dict(kv_cache=torch.randn(16, 1, 12), loc=torch.tensor([3, 9]),
                k_nope=torch.randn(2, 1, 8), k_rope=torch.randn(2, 1, 4))


BAD_MLA = {
    "k_nope 1-D": (lambda t: dict(k_nope=t["k_nope"][0, 0]), "k_nope has the wrong number"),
    "k_nope heads": (lambda t: dict(k_nope=t["k_nope"].expand(2, 2, 8)),
                     "k_nope has the wrong size in dimension 1; expected one latent head"),
    "k_nope int": (lambda t: dict(k_nope=t["k_nope"].int()), "k_nope has dtype torch.int32"),
    "k_rope dtype": (lambda t: dict(k_rope=t["k_rope"].half()), "k_rope has dtype"),
    "k_rope tokens": (lambda t: dict(k_rope=t["k_rope"][:1]), "k_rope has the wrong size in "
                                                              "dimension 0"),
    "loc dtype": (lambda t: dict(loc=t["loc"].float()), "loc has dtype torch.float32"),
    "loc length": (lambda t: dict(loc=t["loc"][:1]), "loc has the wrong size"),
    "kv_cache dtype": (lambda t: dict(kv_cache=t["kv_cache"].half()), "kv_cache has dtype"),
    "kv_cache width": (lambda t: dict(kv_cache=t["kv_cache"][..., :10]),
                       r"kv_cache has the wrong size in dimension -1; expected k_nope.shape\[2\] "
                       r"\+ k_rope.shape\[2\] \(R \+ r\) = 8 \+ 4 = 12, got shape \(16, 1, 10\)"),
    # The argument that is off is named, not the first one compared (fresh-user probe).
    "k_nope dtype vs cache": (lambda t: dict(k_nope=t["k_nope"].half()),
                              r"k_nope has dtype torch.float16; expected kv_cache's dtype "
                              r"torch.float32"),
    "kv_cache dtype vs parts": (lambda t: dict(kv_cache=t["kv_cache"].half()),
                                r"kv_cache has dtype torch.float16; expected k_nope's and "
                                r"k_rope's dtype torch.float32 or an fp8 dtype"),
    "k_nope tokens": (lambda t: dict(k_nope=t["k_nope"][:1]),
                      r"k_nope has the wrong size in dimension 0 \(N\); expected N = 2 as in "
                      r"k_rope.shape\[0\], loc.shape\[0\]"),
    "kv_cache 4-D heads": (lambda t: dict(kv_cache=t["kv_cache"].view(4, 4, 1, 12)
                                          .expand(4, 4, 2, 12)),
                           r"kv_cache has the wrong size in dimension 2; expected one latent "
                           r"head = 1, got shape \(4, 4, 2, 12\)"),
}


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("name", list(BAD_MLA))
def test_store_mla_kv_cache_argument_errors(name, fake):
    t = _valid_mla()
    change, match = BAD_MLA[name]
    kwargs = {**t, **change(t)}
    msg = error_message(lambda **kw: xpu_ops.store_mla_kv_cache(**kw), kwargs, fake)
    assert msg.startswith("ValueError: store_mla_kv_cache: ") and re.search(match, msg), msg
    if fake:
        assert msg == error_message(lambda **kw: xpu_ops.store_mla_kv_cache(**kw), kwargs, False)
