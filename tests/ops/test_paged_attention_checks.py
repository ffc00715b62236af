"""``flash_attn_with_kvcache``: every argument check of the wrapper, the op and the shared
checks it calls, eagerly and under ``FakeTensorMode`` (the same message both ways)."""

from __future__ import annotations

import re

import pytest
import torch

import xpu_ops
from xpu_ops.testing import ATTENTION_CASES, attention_case_inputs

from .utils import error_message


def _wrapper_inputs(index=1, seed=3):
    args, kw = attention_case_inputs(ATTENTION_CASES[index], "cpu",
                                     gen=torch.Generator().manual_seed(seed))
    names = ("q", "k_cache", "v_cache", "cache_seqlens", "page_table", "cu_seqlens_q")
    return dict(zip(names, args[:6])), args, kw


def _bad(t, args):
    """Mutations of valid wrapper arguments (case 1: 3 requests, Hq 6, Hkv 2, D 80, page 4)."""
    q, kc, vc = t["q"], t["k_cache"], t["v_cache"]
    fp8 = torch.float8_e4m3fn
    b, hkv, total_q = 3, 2, q.shape[0]
    ok_scale = torch.ones(b, hkv)
    return {
        "q not tensor": (dict(q=q.tolist()), TypeError, "q is not a tensor"),
        "q 2-D": (dict(q=q[0]), ValueError, r"q has the wrong number of dimensions; expected 3-D"),
        "q int": (dict(q=q.int()), ValueError, "q has dtype torch.int32"),
        "q 3-D no cu_seqlens_q": (dict(cu_seqlens_q=None), ValueError,
                                  "cu_seqlens_q is missing for a packed 3-D q"),
        "q 4-D with cu_seqlens_q": (dict(q=q[None]), ValueError,
                                    "cu_seqlens_q is given with a 4-D q"),
        "k_cache not tensor": (dict(k_cache=None), TypeError, "k_cache is not a tensor"),
        "k_cache 3-D": (dict(k_cache=kc[0]), ValueError,
                        r"k_cache has the wrong number of dimensions; expected 4-D: \[num_pages, "
                        r"page_size, Hkv, D\] with page_table, or \[b, seqlen_k, Hkv, D\] "
                        r"without page_table, got 3-D with shape \(4, 2, 80\)\. View a flat"),
        # The layout error of v_cache carries no dtype advice (it used to: fresh-user probe).
        "v_cache 3-D": (dict(v_cache=vc[0]), ValueError,
                        r"v_cache has the wrong number of dimensions; expected 4-D: .* got 3-D "
                        r"with shape \(4, 2, 80\)\. View a flat \[slots, Hkv, D\] pool as "
                        r"v_cache.view\(-1, page_size, Hkv, D\)\.$"),
        # A paged cache without page_table is read as a contiguous [b, seqlen_k, Hkv, D] cache:
        # the error names k_cache and both layouts, not the page_table the caller never passed.
        "paged cache, page_table None": (
            dict(page_table=None), ValueError,
            r"k_cache has 8 rows in dimension 0 for a batch of 3 requests and page_table is "
            r"None; expected a contiguous cache \[b, seqlen_k, Hkv, D\] \(the layout without "
            r"page_table\) with b = cache_seqlens.shape\[0\] = 3, got shape \(8, 4, 2, 80\)\. "
            r"For a paged cache \[num_pages, page_size, Hkv, D\], pass page_table"),
        "paged cache, page_table and cache_seqlens None": (
            dict(page_table=None, cache_seqlens=None), ValueError,
            r"k_cache has 8 rows .* with b = cu_seqlens_q.shape\[0\] - 1 = 3, got shape"),
        "paged cache, page_table None, 4-D q": (
            dict(q=q[:2][None].contiguous(), cu_seqlens_q=None, page_table=None,
                 cache_seqlens=None), ValueError,
            r"k_cache has 8 rows .* with b = q.shape\[0\] = 1, got shape"),
        "k_cache int": (dict(k_cache=kc.int(), v_cache=vc.int()), ValueError,
                        "k_cache has dtype torch.int32"),
        "v_cache dtype": (dict(v_cache=vc.half()), ValueError,
                          "v_cache has dtype torch.float16; expected torch.float32"),
        "kv dtype vs q": (dict(k_cache=kc.bfloat16(), v_cache=vc.bfloat16()), ValueError,
                          "k_cache has dtype torch.bfloat16; expected q's dtype torch.float32"),
        "fp8 q, float kv": (dict(q=q.to(fp8)), ValueError,
                            "k_cache has dtype torch.float32; expected q's dtype "
                            "torch.float8_e4m3fn or an fp8 dtype"),
        "q head dim": (dict(q=q[..., :64].contiguous()), ValueError,
                       r"q has the wrong size in dimension 2; expected k_cache.shape\[3\] \(D\)"),
        "v_cache pages": (dict(v_cache=vc[1:]), ValueError,
                          r"v_cache has the wrong size in dimension 0; expected "
                          r"k_cache.shape\[0\]"),
        "v_cache page_size": (dict(v_cache=vc[:, 1:]), ValueError,
                              r"v_cache has the wrong size in dimension 1; expected k_cache.shape"),
        "v_cache heads": (dict(v_cache=vc[:, :, :1]), ValueError,
                          r"v_cache has the wrong size in dimension 2; expected k_cache.shape"),
        "cache_seqlens missing": (dict(cache_seqlens=None), ValueError,
                                  "cache_seqlens is missing"),
        "cache_seqlens 2-D": (dict(cache_seqlens=t["cache_seqlens"][None]), ValueError,
                              "cache_seqlens has the wrong number of dimensions"),
        "cache_seqlens device": (dict(cache_seqlens=t["cache_seqlens"].to("meta")), ValueError,
                                 "cache_seqlens is on the wrong device; expected cpu"),
        "page_table 1-D": (dict(page_table=t["page_table"][0]), ValueError,
                           r"page_table has the wrong number of dimensions; expected 2-D, got "
                           r"1-D with shape \(4,\)\.$"),  # no dtype advice for a rank error
        "page_table batch": (dict(page_table=t["page_table"][1:]), ValueError,
                             r"page_table has the wrong size in dimension 0; expected "
                             r"cache_seqlens.shape\[0\] \(b\) = 3"),
        # A wrong-length cache_seqlens is named, not the page_table that agrees with
        # cu_seqlens_q (fresh-user report F14a).
        "cache_seqlens batch": (dict(cache_seqlens=torch.cat([t["cache_seqlens"]] * 2)[:4]),
                                ValueError,
                                r"cache_seqlens has the wrong size in dimension 0; expected "
                                r"page_table.shape\[0\] = cu_seqlens_q.shape\[0\] - 1 \(b\) = "
                                r"3, got shape \(4,\)\.$"),
        "cu_seqlens_q length": (dict(cu_seqlens_q=t["cu_seqlens_q"][1:]), ValueError,
                                r"cu_seqlens_q has the wrong size in dimension 0; expected "
                                r"b \+ 1 = 4"),
        "out shape": (dict(out=torch.empty(total_q, 6, 64)), ValueError,
                      r"out has the wrong shape; expected \[total_q, Hq, Dv\]"),
        "out dtype": (dict(out=torch.empty(total_q, 6, 80, dtype=torch.half)), ValueError,
                      "out has dtype torch.float16; expected torch.float32"),
        "out device": (dict(out=torch.empty(total_q, 6, 80, device="meta")), ValueError,
                       "out is on the wrong device"),
        "Hkv 0": (dict(k_cache=kc[:, :, :0], v_cache=vc[:, :, :0]), ValueError,
                  r"head counts are incompatible; expected Hkv >= 1 \(at least one KV head\) "
                  r"and Hq a multiple of Hkv, got Hq=6, Hkv=0\.$"),
        # Hq = Hkv = 0 asks for a KV head, not for a multiple (fresh10 finding 7).
        "Hq Hkv 0": (dict(q=q[:, :0], k_cache=kc[:, :, :0], v_cache=vc[:, :, :0]), ValueError,
                     r"head counts are incompatible; expected Hkv >= 1 .* got Hq=0, Hkv=0\.$"),
        # A page size of 0 is named as a head dim of 0 is (fresh10 finding 6): it crashed with
        # a RuntimeError in the provider, or returned zeros.
        "page_size 0": (dict(k_cache=kc[:, :0], v_cache=vc[:, :0]), ValueError,
                        r"k_cache has page size 0; expected k_cache.shape\[1\] \(page_size; a "
                        r"dense cache's seqlen_k\) >= 1, got shape \(\d+, 0, 2, 80\)\.$"),
        "qv dtype": (dict(qv=torch.zeros(total_q, 6, 80, dtype=torch.half)), ValueError,
                     "qv has dtype torch.float16"),
        "qv shape": (dict(qv=torch.zeros(total_q, 6, 64)), ValueError,
                     r"qv has the wrong shape; expected \[total_q, Hq, Dv\]"),
        "k_descale without fp8": (dict(k_descale=ok_scale), ValueError,
                                  "k_descale is given for a tensor that is not fp8"),
        "q_descale without fp8": (dict(q_descale=ok_scale), ValueError,
                                  "q_descale is given for a tensor that is not fp8"),
        "k_descale dtype": (dict(k_cache=kc.to(fp8), v_cache=vc.to(fp8),
                                 k_descale=ok_scale.double()), ValueError,
                            "k_descale has dtype torch.float64; expected torch.float32"),
        "v_descale shape": (dict(k_cache=kc.to(fp8), v_cache=vc.to(fp8),
                                 v_descale=torch.ones(b, 6)), ValueError,
                            r"v_descale has the wrong shape; expected \[1\], \[b\] or \[b, Hkv\] "
                            r"= \(1,\), \(3,\) or \(3, 2\)"),
        "sinks dtype": (dict(sinks=torch.zeros(6, dtype=torch.int32)), ValueError,
                        "sinks has dtype torch.int32; expected torch.float32 or torch.bfloat16"),
        "sinks size": (dict(sinks=torch.zeros(2)), ValueError,
                       r"sinks has the wrong size in dimension 0; expected Hq = 6"),
        "softcap negative": (dict(softcap=-1.0), ValueError, "softcap is negative or NaN"),
        "softcap NaN": (dict(softcap=float("nan")), ValueError, "softcap is negative or NaN"),
        "softcap str": (dict(softcap="big"), TypeError, "softcap is not a real number"),
        "softmax_scale str": (dict(softmax_scale="x"), TypeError,
                              "softmax_scale is not a real number"),
        "max_seqlen_q negative": (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q is negative"),
        "max_seqlen_q zero with tokens": (dict(max_seqlen_q=0), ValueError,
                                          "max_seqlen_q is 0 while q has"),
        "window not pair": (dict(window_size=3), TypeError, "window_size is not a pair"),
        "window 3 values": (dict(window_size=(1, 2, 3)), TypeError, "window_size is not a pair"),
        "window < -1": (dict(window_size=(-2, 0)), ValueError,
                        r"window_size has a negative bound; expected each side >= 0 or -1"),
        "q 5-D": (dict(q=q[None, None]), ValueError,
                  r"q has the wrong number of dimensions; expected 3-D \[total_q, Hq, D\] \(with "
                  r"cu_seqlens_q\) or 4-D \[b, s, Hq, D\], got 5-D"),
        "out 3-D for 4-D q": (dict(q=q[:2][None].contiguous(), cu_seqlens_q=None,
                                   out=torch.empty(2, 6, 80)), ValueError,
                              r"out has the wrong shape; expected \[b, s, Hq, Dv\] for a 4-D q"),
        "out 4-D wrong Dv": (dict(q=q[:3][None].contiguous(), cu_seqlens_q=None,
                                  page_table=t["page_table"][:1], cache_seqlens=t[
                                      "cache_seqlens"][:1], out=torch.empty(1, 3, 6, 64)),
                             ValueError, "out has the wrong shape"),
        "out 4-D wrong s": (dict(q=q[:3][None].contiguous(), cu_seqlens_q=None,
                                 page_table=t["page_table"][:1], cache_seqlens=t[
                                     "cache_seqlens"][:1], out=torch.empty(1, 2, 6, 80)),
                            ValueError, "out has the wrong shape"),
    }


_BAD_PARAMS = list(_bad(*_wrapper_inputs()[:2]))


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("name", _BAD_PARAMS)
def test_argument_errors(name, fake):
    t, args, _ = _wrapper_inputs()
    change, exc, match = _bad(t, args)[name]
    call = lambda **kw: xpu_ops.flash_attn_with_kvcache(**kw)  # noqa: E731
    msg = error_message(call, {**t, "causal": True, **change}, fake)
    assert msg.startswith(f"{exc.__name__}: flash_attn_with_kvcache: "), msg
    assert re.search(match, msg), (match, msg)
    if fake:
        assert msg == error_message(call, {**t, "causal": True, **change}, False)


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
def test_the_op_rejects_a_page_size_of_0(fake):
    """The op itself (its plain-form shortcut included) names a page size of 0, as the
    wrapper does."""
    _, args, kw = _wrapper_inputs()
    args = list(args)
    args[1], args[2] = args[1][:, :0], args[2][:, :0]
    call = lambda **k: torch.ops.xpu_ops.flash_attn_with_kvcache(*k.pop("args"), **k)  # noqa: E731
    msg = error_message(call, {"args": args, **kw}, False)
    assert msg.startswith("ValueError: flash_attn_with_kvcache: k_cache has page size 0; "), msg
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode
        mode = FakeTensorMode()
        fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with mode, pytest.raises(ValueError, match="k_cache has page size 0"):
            torch.ops.xpu_ops.flash_attn_with_kvcache(*fargs, **kw)
