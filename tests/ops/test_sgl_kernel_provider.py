"""Glue tests of the ``sgl_kernel`` provider (``xpu_ops/sgl_kernel/``), not hardware results.

The provider runs against ``tests/ops/native_sgl_kernel.py``: sgl-kernel-xpu's native schemas,
implemented on CPU with the reference provider. Equality with the reference therefore checks the
*argument mapping* (cache_seqlens in the cu_seqlens_k slot, LSE layout, out written in place,
both calling conventions, declined cases), never the speed or numerics of the Intel GPU kernels.
"""

from __future__ import annotations

import io
import sys
import types
import warnings

import pytest
import torch

import xpu_ops
from xpu_ops import providers
from xpu_ops import sgl_kernel as sk
from xpu_ops.__main__ import info
from xpu_ops.testing import paged_kv_cache

from .native_sgl_kernel import define_native_library

CONVENTIONS = ("writes", "returns")


@pytest.fixture(params=CONVENTIONS)
def native(request):
    namespace = define_native_library(f"xpu_ops_glue_provider_{request.param}", request.param)
    with sk.bound_to(namespace):
        yield namespace


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _paged_call(gen, *, k_lens, q_lens, page_size=64, hq=4, hkv=2, d=64, dtype=torch.bfloat16):
    (k_cache, v_cache), page_table, cache_seqlens = paged_kv_cache(
        gen, k_lens, page_size, [(hkv, d), (hkv, d)], dtype=dtype, device="cpu")
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], hq, d, generator=gen).to(dtype)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                page_table=page_table, cu_seqlens_q=_i32(cu), max_seqlen_q=max(q_lens))


def _both(fn, **kwargs):
    """Run ``fn`` forced onto the native provider, then onto the reference provider."""
    with xpu_ops.use_provider("sgl_kernel"):
        native_result = fn(**kwargs)
    with xpu_ops.use_provider("reference"):
        reference_result = fn(**kwargs)
    return native_result, reference_result


PAGED_CASES = {   # name: (call shape, extra keywords)
    "decode_gqa_causal": (dict(k_lens=(70, 1, 129), q_lens=(1, 1, 1)), dict(causal=True)),
    "extend_window_softcap": (dict(k_lens=(40, 90), q_lens=(5, 17), page_size=16),
                              dict(causal=True, window_size=(31, 0), softcap=30.0)),
    "decode_sinks_d64_fp16": (dict(k_lens=(3, 200), q_lens=(1, 1), page_size=128,
                                   dtype=torch.float16), dict(causal=True, sinks="yes")),
    "prefill_noncausal_d128": (dict(k_lens=(33,), q_lens=(33,), page_size=32, d=128, hq=2),
                               dict(causal=False)),
}


@pytest.mark.parametrize("case", sorted(PAGED_CASES))
def test_glue_paged_attention_equals_reference(native, case):
    shape, extra = PAGED_CASES[case]
    gen = torch.Generator().manual_seed(7)
    kwargs = dict(_paged_call(gen, **shape), **extra, return_softmax_lse=True)
    if kwargs.get("sinks") == "yes":
        kwargs["sinks"] = torch.randn(kwargs["q"].shape[1], generator=gen)
    (out, lse), (ref_out, ref_lse) = _both(xpu_ops.flash_attn_with_kvcache, **kwargs)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    assert lse.shape == (kwargs["q"].shape[1], kwargs["q"].shape[0])      # [Hq, total_q]


def test_glue_strided_metadata_made_contiguous(native):
    """API.md "Layouts": a column-sliced page table, strided lengths and prefix sums and an
    expanded sink reach the native kernel dense (it indexes them so)."""
    gen = torch.Generator().manual_seed(2)
    kwargs = _paged_call(gen, k_lens=(40, 9), q_lens=(3, 1))
    table = kwargs["page_table"]
    wide = torch.full((table.shape[0], 2 * table.shape[1]), 2 ** 30 - 1, dtype=table.dtype)
    wide[:, ::2] = table
    kwargs.update(page_table=wide[:, ::2],
                  cache_seqlens=kwargs["cache_seqlens"].repeat_interleave(2)[::2],
                  cu_seqlens_q=kwargs["cu_seqlens_q"].repeat_interleave(2)[::2],
                  sinks=torch.tensor([0.5]).expand(kwargs["q"].shape[1]), causal=True,
                  return_softmax_lse=True)
    (out, lse), (ref_out, ref_lse) = _both(xpu_ops.flash_attn_with_kvcache, **kwargs)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


def test_glue_out_buffer_written_in_place(native):
    gen = torch.Generator().manual_seed(1)
    kwargs = _paged_call(gen, k_lens=(65, 7), q_lens=(1, 1))
    q = kwargs["q"]
    buffer = torch.full((q.shape[0], q.shape[1], 2 * q.shape[2]), float("nan"), dtype=q.dtype)
    out = buffer[..., ::2]                                       # non-contiguous view
    with xpu_ops.use_provider("sgl_kernel"):
        result = xpu_ops.flash_attn_with_kvcache(**kwargs, out=out, causal=True)
    with xpu_ops.use_provider("reference"):
        expected = xpu_ops.flash_attn_with_kvcache(**kwargs, causal=True)
    assert result is out
    # Two algorithms: the native stand-in runs the reference's general kernel, the reference
    # provider's decode path one torch SDPA call; each output is a bf16 rounding of a float32
    # result, so they may differ by a few bf16 ulps (2 ** -7 at |x| in [1, 2)).
    torch.testing.assert_close(out, expected, rtol=0, atol=2 ** -6)
    assert torch.isnan(buffer[..., 1::2]).all()                 # nothing else written


def test_glue_varlen_equals_reference(native):
    gen = torch.Generator().manual_seed(2)
    q_lens, k_lens = (3, 1, 6), (5, 9, 6)
    q = torch.randn(sum(q_lens), 4, 80, generator=gen).bfloat16()
    k = torch.randn(sum(k_lens), 1, 80, generator=gen).bfloat16()
    v = torch.randn(sum(k_lens), 1, 80, generator=gen).bfloat16()
    cu_q, cu_k = _i32([0, 3, 4, 10]), _i32([0, 5, 14, 20])
    kwargs = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6,
                  max_seqlen_k=9, causal=True, return_softmax_lse=True)
    (out, lse), (ref_out, ref_lse) = _both(xpu_ops.flash_attn_varlen_func, **kwargs)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


def test_glue_merge_state_v2_transposed_lse(native):
    gen = torch.Generator().manual_seed(3)
    v_a, v_b = (torch.randn(6, 4, 64, generator=gen).half() for _ in range(2))
    lse_a, lse_b = (torch.randn(4, 6, generator=gen) for _ in range(2))     # [H, N] as returned
    lse_a[1, 2] = float("-inf")
    s_merged = torch.empty(4, 6).T                                          # non-contiguous out
    kwargs = dict(v_a=v_a, s_a=lse_a.T, v_b=v_b, s_b=lse_b.T)
    (v, s), (ref_v, ref_s) = _both(xpu_ops.merge_state_v2, **kwargs)
    torch.testing.assert_close(v, ref_v, rtol=0, atol=0)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    with xpu_ops.use_provider("sgl_kernel"):
        _, s_out = xpu_ops.merge_state_v2(**kwargs, s_merged=s_merged)
    assert s_out is s_merged
    torch.testing.assert_close(s_merged, ref_s, rtol=0, atol=0)


def test_glue_merge_state_v2_posinf_lse_is_empty(native):
    # API.md: +inf (FlashAttention's LSE of an empty row) is an empty state on every provider.
    gen = torch.Generator().manual_seed(4)
    v_a, v_b = (torch.randn(5, 2, 32, generator=gen).half() for _ in range(2))
    s_a, s_b = (torch.randn(5, 2, generator=gen) for _ in range(2))
    s_a[0], s_b[1], s_a[2], s_b[2] = float("inf"), float("inf"), float("inf"), float("-inf")
    (v, s), (ref_v, ref_s) = _both(xpu_ops.merge_state_v2, v_a=v_a, s_a=s_a, v_b=v_b, s_b=s_b)
    torch.testing.assert_close(v, ref_v, rtol=0, atol=0)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    assert torch.equal(v[0], v_b[0]) and torch.equal(s[0], s_b[0])


def _mla_call(gen, *, heads=4, page_size=64, k_lens=(70, 5), native_sized=True):
    (kv_cache,), page_table, cache_seqlens = paged_kv_cache(
        gen, k_lens, page_size, [(576,)], dtype=torch.bfloat16, device="cpu", extra_columns=0)
    b = len(k_lens)
    sizing = (sk.limits.native_mla_workspace_bytes if native_sized
              else xpu_ops.flash_mla_get_workspace_size)
    size = sizing(page_table.shape[1] * page_size, b, heads, page_size, -1)
    return dict(q_nope=torch.randn(b, heads, 512, generator=gen).bfloat16(),
                q_rope=torch.randn(b, heads, 64, generator=gen).bfloat16(), kv_cache=kv_cache,
                cache_seqlens=cache_seqlens, page_table=page_table,
                workspace=torch.empty(size, dtype=torch.uint8),
                softmax_scale=0.07)


def test_glue_flash_mla_decode_equals_reference(native):
    kwargs = _mla_call(torch.Generator().manual_seed(4))
    out, ref = _both(xpu_ops.flash_mla_decode, **kwargs)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def _op_args(kwargs):
    """Op-level arguments of ``flash_attn_with_kvcache`` for calling a ``supports`` hook."""
    q = kwargs["q"]
    return ((q, kwargs["k_cache"], kwargs["v_cache"], kwargs["cache_seqlens"],
             kwargs["page_table"], kwargs["cu_seqlens_q"], torch.empty_like(q),
             kwargs.get("qv"), None, None, None, kwargs.get("sinks"), kwargs.get("cache_leftpad"),
             kwargs.get("bidirectional_block_ids")),
            dict(max_seqlen_q=kwargs["max_seqlen_q"], softmax_scale=0.1, causal=True,
                 window_size_left=-1, window_size_right=0, softcap=0.0, num_splits=0))


DECLINED = {   # name: (call shape, overrides, part of the reason)
    "decode_page_size_16": (dict(k_lens=(20,), q_lens=(1,), page_size=16), {}, "page_size"),
    "decode_head_dim_80": (dict(k_lens=(20,), q_lens=(1,), d=80), {}, "head dim"),
    "decode_query_group_3": (dict(k_lens=(20,), q_lens=(1,), hq=6), {}, "Hq/Hkv"),
    "prefill_head_dim_72": (dict(k_lens=(20,), q_lens=(4,), d=72), {}, "head dim"),
    "sinks_head_dim_128": (dict(k_lens=(20,), q_lens=(1,), d=128), {"sinks": torch.zeros(4)},
                           "sinks"),
    "qv": (dict(k_lens=(20,), q_lens=(1,)), {"qv": torch.zeros(1, 4, 64)}, "qv"),
    "fp32_query": (dict(k_lens=(20,), q_lens=(1,), dtype=torch.float32), {}, "float16/bfloat16"),
    "decode_leftpad": (dict(k_lens=(20,), q_lens=(1,), page_size=64),
                       {"cache_leftpad": torch.ones(1, dtype=torch.int32)}, "cache_leftpad"),
    "bidirectional_block_ids": (dict(k_lens=(4,), q_lens=(4,)), {
        "bidirectional_block_ids": torch.tensor([-1, 0, 0, -1], dtype=torch.int32)},
        "bidirectional_block_ids"),
}


@pytest.mark.parametrize("case", sorted(DECLINED))
def test_glue_declined_cases_name_the_reason(native, case):
    shape, overrides, reason = DECLINED[case]
    kwargs = dict(_paged_call(torch.Generator().manual_seed(5), **shape), **overrides)
    args, scalars = _op_args(kwargs)
    assert reason in sk.limits.flash_attn_with_kvcache(*args, **scalars)


def test_glue_fp8_query_declined(native):
    kwargs = _paged_call(torch.Generator().manual_seed(6), k_lens=(20,), q_lens=(1,))
    kwargs["q"] = kwargs["q"].to(torch.float8_e4m3fn)
    args, scalars = _op_args(kwargs)
    assert "fp8 query" in sk.limits.flash_attn_with_kvcache(*args, **scalars)


def test_glue_decline_falls_back_and_info_says_why(native):
    kwargs = _paged_call(torch.Generator().manual_seed(8), k_lens=(20, 3), q_lens=(1, 1),
                         page_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = xpu_ops.flash_attn_with_kvcache(**kwargs, causal=True)     # not forced
    with xpu_ops.use_provider("reference"):
        torch.testing.assert_close(out, xpu_ops.flash_attn_with_kvcache(**kwargs, causal=True))
    reasons = [r for (op, name, r) in providers.fallbacks()
               if op == "flash_attn_with_kvcache" and name == "sgl_kernel"]
    assert any("page_size in (64, 128), got 16" in r for r in reasons)
    text = io.StringIO()
    info(["cpu"], out=text)
    assert "flash_attn_with_kvcache        -> sgl_kernel" in text.getvalue()
    assert "sgl_kernel declined" in text.getvalue() and "got 16" in text.getvalue()
    with xpu_ops.use_provider("sgl_kernel"), pytest.raises(NotImplementedError, match="page_size"):
        xpu_ops.flash_attn_with_kvcache(**kwargs, causal=True)


def test_glue_mla_workspace_sized_by_xpu_ops_only_is_declined(native):
    kwargs = _mla_call(torch.Generator().manual_seed(9), native_sized=False)
    with xpu_ops.use_provider("sgl_kernel"), pytest.raises(NotImplementedError, match="workspace"):
        xpu_ops.flash_mla_decode(**kwargs)


def test_glue_availability_reasons(monkeypatch):
    namespace = define_native_library("xpu_ops_glue_provider_writes", "writes")
    with sk.bound_to(namespace, package="xpu_ops_glue_missing_pkg"):
        assert "`import xpu_ops_glue_missing_pkg` failed" in sk.native.unavailable("fwd", "cpu")
    monkeypatch.setitem(sys.modules, "xpu_ops_glue_present_pkg",
                        types.ModuleType("xpu_ops_glue_present_pkg"))
    with sk.bound_to(namespace, package="xpu_ops_glue_present_pkg"):
        assert sk.native.unavailable("fwd", "cpu") is None
        assert "has no XPU kernel" in sk.native.unavailable("fwd", "xpu")
        assert "has no CUDA kernel" in sk.native.unavailable("fwd", "cuda")
        assert "has no op flash_mla_prefill" in sk.native.unavailable("flash_mla_prefill", "cpu")
    shim = types.ModuleType("xpu_ops_glue_shim_pkg")
    shim.__xpu_ops_shim__ = True
    monkeypatch.setitem(sys.modules, "xpu_ops_glue_shim_pkg", shim)
    with sk.bound_to(namespace, package="xpu_ops_glue_shim_pkg"):
        assert "compatibility shim" in sk.native.unavailable("fwd", "cpu")


def test_glue_forced_provider_without_native_says_what_is_missing():
    if sk.native.unavailable("fwd", "cpu") is None:
        pytest.skip("a native sgl_kernel with CPU kernels is installed")
    q = torch.randn(2, 1, 64)
    with xpu_ops.use_provider("sgl_kernel"), pytest.raises(RuntimeError, match="sgl_kernel"):
        xpu_ops.merge_state_v2(q, torch.zeros(2, 1), q, torch.zeros(2, 1))
