"""``flash_attn_varlen_func``: numerics against the float64 oracle (ragged K/V, ``seqused_k``
with NaN past it), wrapper defaults, and every argument check of its own."""

from __future__ import annotations

import re

import pytest
import torch

import xpu_ops
from xpu_ops.testing import ATTENTION_CASES, varlen_case_inputs

from . import oracle
from .utils import assert_matches_oracle, case_id, error_message, runnable_providers

OP = torch.ops.xpu_ops.flash_attn_varlen_func
PROVIDERS = runnable_providers("flash_attn_varlen_func")
NAMES = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "out", "seqused_k", "qv", "q_descale",
         "k_descale", "v_descale", "sinks")


def _oracle(args, kw):
    a = dict(zip(NAMES, args))
    return oracle.flash_attn_varlen_func(
        a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], causal=kw["causal"],
        window_size_left=kw["window_size_left"], window_size_right=kw["window_size_right"],
        softmax_scale=kw["softmax_scale"], softcap=kw["softcap"], sinks=a["sinks"], qv=a["qv"],
        seqused_k=a["seqused_k"], q_descale=a["q_descale"], k_descale=a["k_descale"],
        v_descale=a["v_descale"])


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", range(len(ATTENTION_CASES)),
                         ids=[case_id(c) for c in ATTENTION_CASES])
def test_matches_oracle(provider, index):
    gen = torch.Generator().manual_seed(3000 + index)
    args, kw = varlen_case_inputs(ATTENTION_CASES[index], "cpu", gen=gen, seqused=index % 2 == 0)
    with xpu_ops.use_provider(provider):
        lse = OP(*args, **kw)
    out64, lse64 = _oracle(args, kw)
    assert_matches_oracle(args[5], out64, args[5].dtype, lse, lse64)


def test_wrapper_defaults_and_dv_differs():
    gen = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(5, 4, 64, generator=gen), torch.randn(9, 2, 64, generator=gen), \
        torch.randn(9, 2, 32, generator=gen)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 9],
                                                                          dtype=torch.int32)
    out, lse = xpu_ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True,
                                              return_softmax_lse=True)
    out64, lse64 = oracle.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True,
                                                 softmax_scale=64 ** -0.5)
    assert out.shape == (5, 4, 32)
    assert_matches_oracle(out, out64, torch.float32, lse, lse64)
    given = torch.full_like(out, float("nan"))
    assert xpu_ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True, out=given) is given
    torch.testing.assert_close(given, out, rtol=0, atol=0)


def test_wrapper_num_splits_and_speed_hints_keep_the_result():
    """num_splits (any int >= 0), pack_gqa and sm_margin change speed only (API.md); bad kinds
    and negative counts raise naming the keyword."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(n, h, 32, generator=gen) for n, h in ((5, 4), (9, 2), (9, 2)))
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 2, 5], [0, 4, 9]))
    ref = xpu_ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True)
    for num_splits in (0, 1, 3):
        out = xpu_ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True,
                                             num_splits=num_splits, pack_gqa=None, sm_margin=0)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="flash_attn_varlen_func: num_splits is negative"):
        xpu_ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, num_splits=-1)
    for keyword, value in (("pack_gqa", True), ("pack_gqa", False), ("sm_margin", 1)):
        out = xpu_ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True, **{keyword: value})
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for keyword, value, exc, match in (
            ("pack_gqa", 1, TypeError, "pack_gqa is not a bool; expected None, True or False"),
            ("sm_margin", -1, ValueError, "sm_margin is negative; expected sm_margin >= 0"),
            ("sm_margin", 0.5, TypeError, "sm_margin is not an integer; expected an int >= 0")):
        with pytest.raises(exc, match=f"^flash_attn_varlen_func: {match}, got "):
            xpu_ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, **{keyword: value})


def _bad(t):
    q, k, v = t["q"], t["k"], t["v"]
    i64 = torch.int64
    return {
        "k 2-D": (dict(k=k[0]), ValueError, "k has the wrong number of dimensions"),
        "v dtype": (dict(v=v.half()), ValueError, "v has dtype torch.float16"),
        "k dtype vs q": (dict(k=k.half(), v=v.half()), ValueError, "k has dtype torch.float16"),
        "q head dim": (dict(q=q[..., :32].contiguous()), ValueError,
                       r"q has the wrong size in dimension 2; expected k.shape\[2\] \(D\)"),
        "v total_k": (dict(v=v[1:]), ValueError, r"v has the wrong size in dimension 0"),
        "v heads": (dict(v=v[:, :1]), ValueError, r"v has the wrong size in dimension 1"),
        "cu_seqlens_q int64": (dict(cu_seqlens_q=t["cu_seqlens_q"].to(i64)), ValueError,
                               "cu_seqlens_q has dtype torch.int64"),
        "cu_seqlens_k int64": (dict(cu_seqlens_k=t["cu_seqlens_k"].to(i64)), ValueError,
                               "cu_seqlens_k has dtype torch.int64"),
        "cu_seqlens_k length": (dict(cu_seqlens_k=t["cu_seqlens_k"][1:]), ValueError,
                                r"cu_seqlens_k has the wrong size in dimension 0; expected b \+ 1"),
        "seqused_k int64": (dict(seqused_k=torch.ones(3, dtype=i64)), ValueError,
                            "seqused_k has dtype torch.int64"),
        "seqused_k length": (dict(seqused_k=torch.ones(2, dtype=torch.int32)), ValueError,
                             "seqused_k has the wrong size in dimension 0"),
        "max_seqlen_k negative": (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k is negative"),
        "out shape": (dict(out=torch.empty(q.shape[0], q.shape[1], 7)), ValueError,
                      "out has the wrong shape"),
        "heads 3/2": (dict(q=q[:, :3].contiguous(), k=k[:, :2].contiguous(),
                           v=v[:, :2].contiguous()), ValueError,
                      "head counts are incompatible.*Hq=3, Hkv=2"),
    }


def _valid():
    args, kw = varlen_case_inputs(ATTENTION_CASES[1], "cpu")   # 3 requests, Hq 6, Hkv 2, D 80
    return dict(zip(NAMES[:5], args[:5]))


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("name", list(_bad(_valid())))
def test_argument_errors(name, fake):
    t = _valid()
    change, exc, match = _bad(t)[name]
    kwargs = {**t, "causal": True, **change}
    msg = error_message(lambda **kw: xpu_ops.flash_attn_varlen_func(**kw), kwargs, fake)
    assert msg.startswith(f"{exc.__name__}: flash_attn_varlen_func: "), msg
    assert re.search(match, msg), (match, msg)
    if fake:
        assert msg == error_message(lambda **kw: xpu_ops.flash_attn_varlen_func(**kw), kwargs,
                                    False)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_strided_qkv_views(provider):
    """q, k and v as views into one fused qkv projection (strided token dimension)."""
    gen = torch.Generator().manual_seed(16)
    qkv = torch.randn(7, (4 + 2 + 2) * 32, generator=gen)
    q, k, v = qkv[:, :128].view(7, 4, 32), qkv[:, 128:192].view(7, 2, 32), \
        qkv[:, 192:].view(7, 2, 32)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with xpu_ops.use_provider(provider):
        out, lse = xpu_ops.flash_attn_varlen_func(q, k, v, cu, cu, causal=True,
                                                  return_softmax_lse=True)
    out64, lse64 = oracle.flash_attn_varlen_func(q, k, v, cu, cu, causal=True,
                                                 softmax_scale=32 ** -0.5)
    assert_matches_oracle(out, out64, torch.float32, lse, lse64)


def test_flashattention_4_paged_form_matches_the_oracle():
    """``page_table=`` (FlashAttention-4's varlen over paged caches, sgl-kernel-xpu's
    ``test_flash_attention_4.py``): 4-D queries, cache lengths in ``seqused_k``, a sink."""
    from xpu_ops.testing import paged_kv_cache
    gen = torch.Generator().manual_seed(12)
    (k_cache, v_cache), table, lens = paged_kv_cache(gen, (9, 5), 4, [(1, 16), (1, 16)],
                                                     dtype=torch.float32, device="cpu")
    q = torch.randn(2, 3, 2, 16, generator=gen)
    sinks = torch.randn(2, generator=gen)
    out, lse = xpu_ops.flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=lens,
        page_table=table, causal=True, window_size=(None, None), sinks=sinks,
        return_softmax_lse=True, ver=4)
    cu_q = torch.tensor([0, 3, 6], dtype=torch.int32)
    want, _ = oracle.flash_attn_with_kvcache(
        q.reshape(6, 2, 16), k_cache, v_cache, lens, table, cu_q, None, None, None, None, None,
        sinks, max_seqlen_q=3, softmax_scale=16 ** -0.5, causal=True, window_size_left=-1,
        window_size_right=0, softcap=0.0)
    assert out.shape == (2, 3, 2, 16)
    torch.testing.assert_close(out.reshape(6, 2, 16).double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="flash_attn_varlen_func: cu_seqlens_k does not fit the "
                                         "paged form"):
        xpu_ops.flash_attn_varlen_func(q, k_cache, v_cache, None, cu_q, seqused_k=lens,
                                       page_table=table)
