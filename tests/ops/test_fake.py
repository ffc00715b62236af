"""Fake (meta) implementations: same output metadata as the real op, symbolic token counts,
device ``xpu`` without an Intel GPU, and every ``return_softmax_lse`` x ``out=`` combination."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._pytree import tree_flatten, tree_map

import xpu_ops
from xpu_ops.testing import ATTENTION_CASES, attention_case_inputs, varlen_case_inputs

from .utils import all_sample_params, fake_like, sample


def _meta(x):
    return [(tuple(t.shape), t.stride(), t.dtype, t.device.type) if isinstance(t, torch.Tensor)
            else t for t in tree_flatten(x)[0]]


@pytest.mark.parametrize("op,index", all_sample_params())
def test_fake_matches_real(op, index):
    args, kwargs = sample(op, index)
    real = op(*args, **kwargs)
    mode = FakeTensorMode()
    fargs = tree_map(lambda t: fake_like(mode, t), args)
    with mode:
        fake = op(*fargs, **kwargs)
    assert _meta(fake) == _meta(real)
    assert _meta(fargs) == _meta(args)           # mutated arguments keep their layout


# ----------------------------------------------------------------------------------------------
# Tracing the public wrappers with symbolic token counts, on cpu and on a fake xpu device
# ----------------------------------------------------------------------------------------------

def _symbolic(tensors: dict, dynamic: dict, device=None):
    mode = FakeTensorMode(shape_env=ShapeEnv())
    return mode, {k: fake_like(mode, t, dynamic.get(k, ()), device) for k, t in tensors.items()}


def _is_symbol_of(size, ref) -> bool:
    return isinstance(size, torch.SymInt) and str(size.node.expr) == str(ref.node.expr)


def _paged_kwargs(case_index=1):
    args, kw = attention_case_inputs(ATTENTION_CASES[case_index], "cpu")
    q, k_cache, v_cache, cache_seqlens, page_table, cu_q = args[:6]
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                page_table=page_table, cu_seqlens_q=cu_q), kw


@pytest.mark.parametrize("device", [None, "xpu"], ids=["cpu", "xpu"])
def test_trace_flash_attn_with_kvcache_symbolic(device):
    tensors, kw = _paged_kwargs()
    # Token count, batch and page counts symbolic; head counts and head dims static.
    mode, f = _symbolic(tensors, dict(q=(0,), k_cache=(0,), v_cache=(0,), cache_seqlens=(0,),
                                      page_table=(0, 1), cu_seqlens_q=(0,)), device)
    with mode:
        out, lse = xpu_ops.flash_attn_with_kvcache(
            **f, max_seqlen_q=kw["max_seqlen_q"], causal=True, return_softmax_lse=True)
    total_q = f["q"].shape[0]
    assert _is_symbol_of(out.shape[0], total_q) and _is_symbol_of(lse.shape[1], total_q)
    assert out.shape[1:] == tensors["q"].shape[1:2] + tensors["v_cache"].shape[3:]
    assert out.device == f["q"].device and lse.dtype == torch.float32
    assert out.is_contiguous() and lse.is_contiguous()


@pytest.mark.parametrize("device", [None, "xpu"], ids=["cpu", "xpu"])
def test_trace_flash_attn_with_kvcache_4d_symbolic(device):
    q = torch.randn(3, 5, 4, 64)
    tensors = dict(q=q, k_cache=torch.randn(7, 16, 2, 64), v_cache=torch.randn(7, 16, 2, 64),
                   cache_seqlens=torch.full((3,), 9, dtype=torch.int32),
                   page_table=torch.zeros(3, 2, dtype=torch.int32))
    mode, f = _symbolic(tensors, dict(q=(0, 1), cache_seqlens=(0,), page_table=(0,)), device)
    with mode:
        out, lse = xpu_ops.flash_attn_with_kvcache(**f, causal=True, return_softmax_lse=True)
    b, s = f["q"].shape[:2]
    assert _is_symbol_of(out.shape[0], b) and _is_symbol_of(out.shape[1], s)
    assert _is_symbol_of(lse.shape[0], b) and _is_symbol_of(lse.shape[2], s)


@pytest.mark.parametrize("device", [None, "xpu"], ids=["cpu", "xpu"])
def test_trace_varlen_symbolic(device):
    args, kw = varlen_case_inputs(ATTENTION_CASES[1], "cpu")
    tensors = dict(zip(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"), args[:5]))
    mode, f = _symbolic(tensors, dict(q=(0,), k=(0,), v=(0,), cu_seqlens_q=(0,),
                                      cu_seqlens_k=(0,)), device)
    with mode:
        out, lse = xpu_ops.flash_attn_varlen_func(**f, max_seqlen_q=kw["max_seqlen_q"],
                                                  max_seqlen_k=kw["max_seqlen_k"], causal=True,
                                                  return_softmax_lse=True)
    assert _is_symbol_of(out.shape[0], f["q"].shape[0])
    assert _is_symbol_of(lse.shape[1], f["q"].shape[0])


@pytest.mark.parametrize("device", [None, "xpu"], ids=["cpu", "xpu"])
def test_trace_other_ops_symbolic(device):
    n, h = 6, 4
    tensors = dict(v_a=torch.randn(n, h, 32), s_a=torch.randn(n, h), v_b=torch.randn(n, h, 32),
                   s_b=torch.randn(n, h), k_cache=torch.randn(40, 2, 16),
                   v_cache=torch.randn(40, 2, 16), loc=torch.arange(5), k=torch.randn(5, 2, 16),
                   v=torch.randn(5, 2, 16), q_nope=torch.randn(3, h, 64),
                   q_rope=torch.randn(3, h, 16), kv=torch.randn(5, 16, 80),
                   seqlens=torch.full((3,), 20, dtype=torch.int32),
                   table=torch.zeros(3, 2, dtype=torch.int32),
                   workspace=torch.empty(xpu_ops.flash_mla_get_workspace_size(32, 3, h),
                                         dtype=torch.uint8),
                   mla_cache=torch.randn(40, 1, 80), k_nope=torch.randn(5, 1, 64),
                   k_rope=torch.randn(5, 1, 16))
    dyn = dict(v_a=(0,), s_a=(0,), v_b=(0,), s_b=(0,), loc=(0,), k=(0,), v=(0,),
               q_nope=(0,), q_rope=(0,), seqlens=(0,), table=(0,), k_nope=(0,), k_rope=(0,))
    mode, f = _symbolic(tensors, dyn, device)
    with mode:
        v_m, s_m = xpu_ops.merge_state_v2(f["v_a"], f["s_a"], f["v_b"], f["s_b"])
        xpu_ops.store_kv_cache(f["k_cache"], f["v_cache"], f["loc"], f["k"], f["v"])
        xpu_ops.store_mla_kv_cache(f["mla_cache"], f["loc"], f["k_nope"], f["k_rope"])
        o = xpu_ops.flash_mla_decode(f["q_nope"], f["q_rope"], f["kv"], f["seqlens"], f["table"],
                                     f["workspace"], 0.1)
    assert _is_symbol_of(v_m.shape[0], f["v_a"].shape[0])
    assert _is_symbol_of(s_m.shape[0], f["v_a"].shape[0]) and s_m.dtype == torch.float32
    assert _is_symbol_of(o.shape[0], f["q_nope"].shape[0]) and o.shape[1:] == (h, 64)
    assert o.device == f["q_nope"].device


@pytest.mark.parametrize("device", [None, "xpu"], ids=["cpu", "xpu"])
def test_trace_swa_spec_symbolic(device):
    i32 = dict(dtype=torch.int32)
    tensors = dict(page_table=torch.zeros(3, 8, **i32), prefix_lens=torch.ones(3, **i32),
                   draft_slots=torch.zeros(3, 4, **i32),
                   custom_mask=torch.ones(3, 4, 4, dtype=torch.bool))
    mode, f = _symbolic(tensors, dict(page_table=(0, 1), prefix_lens=(0,), draft_slots=(0,),
                                      custom_mask=(0,)), device)
    with mode:
        table, lens = xpu_ops.prepare_swa_spec_page_table(**f)
    b, width = f["page_table"].shape
    assert str(table.shape[0].node.expr) == str((b * 4).node.expr)
    assert str(table.shape[1].node.expr) == str((width + 4).node.expr)
    assert table.dtype == lens.dtype == torch.int32


# ----------------------------------------------------------------------------------------------
# return_softmax_lse x out=, eager and fake, 3-D and 4-D q, paged and varlen
# ----------------------------------------------------------------------------------------------

def _call(kind, t, out, lse):
    if kind == "paged":
        return xpu_ops.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"],
                                               cache_seqlens=t["cache_seqlens"],
                                               page_table=t["page_table"],
                                               cu_seqlens_q=t.get("cu_seqlens_q"), causal=True,
                                               return_softmax_lse=lse, out=out)
    return xpu_ops.flash_attn_varlen_func(t["q"], t["k"], t["v"], t["cu_seqlens_q"],
                                          t["cu_seqlens_k"], causal=True, return_softmax_lse=lse,
                                          out=out)


def _tensors(kind):
    if kind == "varlen":
        args, _ = varlen_case_inputs(ATTENTION_CASES[1], "cpu")
        return dict(zip(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"), args[:5]))
    tensors, _ = _paged_kwargs(1 if kind == "paged" else 0)
    if kind == "paged4d":       # case 0 is decode: q [b, 1, Hq, D] without cu_seqlens_q
        b = tensors["cache_seqlens"].shape[0]
        tensors["q"] = tensors["q"].view(b, 1, *tensors["q"].shape[1:])
        del tensors["cu_seqlens_q"]
    return tensors


@pytest.mark.parametrize("kind", ["paged", "paged4d", "varlen"])
@pytest.mark.parametrize("lse,given_out", list(itertools.product([False, True], repeat=2)))
def test_fake_matches_real_for_lse_and_out(kind, lse, given_out):
    tensors = _tensors(kind)
    out_shape = (*tensors["q"].shape[:-1], tensors["v_cache" if "v_cache" in tensors
                                                   else "v"].shape[-1])
    out = torch.full(out_shape, float("nan")) if given_out else None
    real = _call("varlen" if kind == "varlen" else "paged", tensors, out, lse)
    mode = FakeTensorMode()
    f = {k: fake_like(mode, t) for k, t in tensors.items()}
    fout = fake_like(mode, out) if given_out else None
    with mode:
        fake = _call("varlen" if kind == "varlen" else "paged", f, fout, lse)
    assert _meta(fake) == _meta(real)
    assert isinstance(real, tuple) == lse
    if given_out:
        assert (real[0] if lse else real) is out and (fake[0] if lse else fake) is fout
        assert not out.isnan().any()


def test_compile_dynamic_token_counts_one_graph():
    """Dynamo + AOTAutograd over the real fakes: with the token, batch and page dimensions marked
    dynamic, varying them reuses one graph (no guard on their values), and every run matches
    eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True)
    def step(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q):
        return xpu_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                               page_table=page_table, cu_seqlens_q=cu_seqlens_q,
                                               max_seqlen_q=8, causal=True,
                                               return_softmax_lse=True)

    torch._dynamo.reset()
    # Token counts, batch sizes and page counts all change; dtype and head shapes stay.
    for reqs in (((3, 7), (1, 4)), ((2, 2), (5, 9), (1, 12)), ((1, 3), (4, 4), (2, 6), (6, 6))):
        case = dataclasses.replace(ATTENTION_CASES[1], reqs=reqs)
        args, _ = attention_case_inputs(case, "cpu")
        tensors = dict(zip(("q", "k_cache", "v_cache", "cache_seqlens", "page_table",
                            "cu_seqlens_q"), args[:6]))
        for name, dims in (("q", (0,)), ("k_cache", (0,)), ("v_cache", (0,)),
                           ("cache_seqlens", (0,)), ("page_table", (0, 1)),
                           ("cu_seqlens_q", (0,))):
            torch._dynamo.mark_dynamic(tensors[name], dims)
        out, lse = step(**tensors)
        ref, ref_lse = xpu_ops.flash_attn_with_kvcache(**tensors, causal=True,
                                                       return_softmax_lse=True)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    assert counter.frame_count == 1   # one graph for every size
