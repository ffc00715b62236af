"""The argument forms sgl-kernel and sgl-kernel-xpu accept beside the canonical ones: sinks in any
float dtype, fp8 descales ``[1]``/``[b]``/``[b, Hkv]`` (expanded too), ``ver=3|4``, and house
errors that are also ``RuntimeError`` (what ``pytest.raises(RuntimeError)`` in their tests
expects). Numerics against the float64 oracle; the oracle broadcasts a 1-D descale itself."""

from __future__ import annotations

import pytest
import torch

import xpu_ops
from xpu_ops._checks import XpuOpsTypeError, XpuOpsValueError
from xpu_ops.testing import ATTENTION_CASES, CLIENT_FORM_CASES, attention_case_inputs, \
    client_forms, op_name, varlen_case_inputs

from ..markers import GPU_DEVICE

from . import oracle
from .utils import assert_matches_oracle, case_id, fake_like, runnable_providers

KVCACHE = torch.ops.xpu_ops.flash_attn_with_kvcache
VARLEN = torch.ops.xpu_ops.flash_attn_varlen_func
PARAMS = [pytest.param(i, v, id=f"{case_id(ATTENTION_CASES[i])}-v{v}")
          for i in CLIENT_FORM_CASES for v in (0, 1)]


def _kvcache_inputs(index, variant, seed):
    args, kw = attention_case_inputs(ATTENTION_CASES[index], "cpu",
                                     gen=torch.Generator().manual_seed(seed))
    return client_forms(args, variant), kw


@pytest.mark.parametrize("provider", runnable_providers("flash_attn_with_kvcache"))
@pytest.mark.parametrize("index,variant", PARAMS)
def test_kvcache_client_forms_match_oracle(provider, index, variant):
    args, kw = _kvcache_inputs(index, variant, seed=500 + index)
    sinks = args[11]
    assert sinks is None or sinks.dtype == torch.bfloat16
    assert args[9] is None or tuple(args[9].shape) == (1,)
    with xpu_ops.use_provider(provider):
        lse = KVCACHE(*args, **kw)
    out64, lse64 = oracle.flash_attn_with_kvcache(*args, **kw)
    assert_matches_oracle(args[6], out64, args[6].dtype, lse, lse64)


@pytest.mark.parametrize("provider", runnable_providers("flash_attn_varlen_func"))
@pytest.mark.parametrize("index,variant", PARAMS)
def test_varlen_client_forms_match_oracle(provider, index, variant):
    args, kw = varlen_case_inputs(ATTENTION_CASES[index], "cpu",
                                  gen=torch.Generator().manual_seed(700 + index))
    args = client_forms(args, variant)
    with xpu_ops.use_provider(provider):
        lse = VARLEN(*args, **kw)
    q, k, v, cu_q, cu_k, out, seqused_k, qv, q_d, k_d, v_d, sinks, seqused_q = args
    out64, lse64 = oracle.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, causal=kw["causal"], window_size_left=kw["window_size_left"],
        window_size_right=kw["window_size_right"], softmax_scale=kw["softmax_scale"],
        softcap=kw["softcap"], sinks=sinks, qv=qv, seqused_k=seqused_k, q_descale=q_d,
        k_descale=k_d, v_descale=v_d, seqused_q=seqused_q)
    assert_matches_oracle(out, out64, out.dtype, lse, lse64)


def test_client_forms_equal_the_canonical_forms():
    """A bf16 sink and a ``[1]``/``[b]`` descale give exactly the result of the float32 sink
    and the ``[b, Hkv]`` descale holding the same values (same provider)."""
    index = next(i for i in CLIENT_FORM_CASES if ATTENTION_CASES[i].kv_dtype is not None
                 and ATTENTION_CASES[i].q_fp8)
    args, kw = _kvcache_inputs(index, 0, seed=11)
    b, hkv = args[3].shape[0], args[1].shape[2]
    canonical = list(args)
    canonical[8:11] = [t.reshape(-1, 1).expand(b, hkv).contiguous() for t in args[8:11]]
    canonical[6] = args[6].clone()
    lse_a = KVCACHE(*args, **kw)
    lse_b = KVCACHE(*canonical, **kw)
    assert torch.equal(args[6], canonical[6]) and torch.equal(lse_a, lse_b)


def _wrapper_args(index):
    args, _ = attention_case_inputs(ATTENTION_CASES[index], "cpu",
                                    gen=torch.Generator().manual_seed(5))
    names = ("q", "k_cache", "v_cache", "cache_seqlens", "page_table", "cu_seqlens_q")
    return dict(zip(names, args[:6]), causal=True, max_seqlen_q=int(
        (args[5][1:] - args[5][:-1]).max()))


SINK_CASE = next(i for i in CLIENT_FORM_CASES if ATTENTION_CASES[i].sinks
                 and ATTENTION_CASES[i].dtype == torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_wrapper_sinks_any_float_dtype_read_as_float32(dtype):
    t = _wrapper_args(SINK_CASE)
    sinks = torch.randn(t["q"].shape[1], generator=torch.Generator().manual_seed(2)).to(dtype)
    out = xpu_ops.flash_attn_with_kvcache(**t, sinks=sinks)
    ref = xpu_ops.flash_attn_with_kvcache(**t, sinks=sinks.float())
    assert torch.equal(out, ref)


@pytest.mark.parametrize("fn", ["flash_attn_with_kvcache", "flash_attn_varlen_func"])
def test_ver_4_runs_the_same_math(fn):
    t = _wrapper_args(SINK_CASE)
    if fn == "flash_attn_varlen_func":
        q = t["q"]
        k = torch.randn(q.shape[0], 3, q.shape[2])
        t = dict(q=q, k=k, v=torch.randn_like(k), cu_seqlens_q=t["cu_seqlens_q"],
                 cu_seqlens_k=t["cu_seqlens_q"], causal=True)
    call = getattr(xpu_ops, fn)
    assert torch.equal(call(**t, ver=4), call(**t, ver=3))
    assert torch.equal(call(**t, ver=3), call(**t))


@pytest.mark.parametrize("fn", ["flash_attn_with_kvcache", "flash_attn_varlen_func"])
@pytest.mark.parametrize("ver,exc,match", [
    (2, XpuOpsValueError, r"ver is not a FlashAttention version; expected 3 or 4, got 2"),
    (True, XpuOpsTypeError, r"ver is not an integer; expected 3 or 4"),
    ("4", XpuOpsTypeError, r"ver is not an integer")])
def test_bad_ver_is_a_value_or_type_error_and_a_runtime_error(fn, ver, exc, match):
    t = _wrapper_args(0)
    if fn == "flash_attn_varlen_func":
        t = dict(q=t["q"], k=t["q"], v=t["q"], cu_seqlens_q=t["cu_seqlens_q"],
                 cu_seqlens_k=t["cu_seqlens_q"])
    for caught in (exc, RuntimeError, exc.__mro__[1]):
        with pytest.raises(caught, match=f"^{fn}: {match}"):
            getattr(xpu_ops, fn)(**t, ver=ver)


def _fp8_case():
    index = next(i for i in CLIENT_FORM_CASES if ATTENTION_CASES[i].kv_dtype is not None
                 and not ATTENTION_CASES[i].q_fp8)
    return attention_case_inputs(ATTENTION_CASES[index], "cpu")


@pytest.mark.parametrize("where", ["eager", "fake"])
@pytest.mark.parametrize("bad,match", [
    ("b_plus_1", r"k_descale has the wrong shape; expected \[1\], \[b\] or \[b, Hkv\] = "
                 r"\(1,\), \(\d+,\) or \(\d+, \d+\), got \(\d+,\)"),
    ("3d", r"k_descale has the wrong number of dimensions; expected 1-D or 2-D"),
    ("half", r"k_descale has dtype torch.float16; expected torch.float32"),
    ("sinks_int", r"sinks has dtype torch.int32; expected torch.float32 or torch.bfloat16")])
def test_bad_extras_raise_house_errors_eager_and_fake(where, bad, match):
    args, kw = _fp8_case()
    args = list(args)
    b, hkv = args[3].shape[0], args[1].shape[2]
    args[9] = {"b_plus_1": torch.ones(b + 1), "3d": torch.ones(b, hkv, 1),
               "half": torch.ones(1, dtype=torch.half)}.get(bad, args[9])
    if bad == "sinks_int":
        args[11] = torch.zeros(args[0].shape[1], dtype=torch.int32)
    if where == "fake":
        mode = torch._subclasses.fake_tensor.FakeTensorMode()
        args = [fake_like(mode, a) for a in args]
        with mode, pytest.raises(RuntimeError, match=match) as info:
            KVCACHE(*args, **kw)
    else:
        with pytest.raises(RuntimeError, match=match) as info:
            KVCACHE(*args, **kw)
    assert isinstance(info.value, ValueError)


def test_house_errors_are_builtin_errors_and_runtime_errors():
    assert issubclass(XpuOpsValueError, ValueError) and issubclass(XpuOpsValueError, RuntimeError)
    assert issubclass(XpuOpsTypeError, TypeError) and issubclass(XpuOpsTypeError, RuntimeError)
    with pytest.raises(XpuOpsTypeError):   # a check that names a non-tensor argument
        xpu_ops.merge_state_v2(1, torch.zeros(1, 1), torch.zeros(1, 1, 1), torch.zeros(1, 1))


def test_fullgraph_trace_with_client_forms():
    """bf16 sinks and ``[1]``/``[b]`` descales through ``torch.compile(fullgraph=True)``: same
    result as eager (the broadcast happens inside the op, nothing breaks the graph)."""
    index = next(i for i in CLIENT_FORM_CASES if ATTENTION_CASES[i].kv_dtype is not None
                 and not ATTENTION_CASES[i].q_fp8)
    args, kw = _kvcache_inputs(index, 1, seed=3)
    sinks = torch.randn(args[0].shape[1]).to(torch.bfloat16)
    q, k_cache, v_cache, cache_seqlens, page_table, cu_q = args[:6]

    def step(q, k_descale, v_descale, sinks):
        return xpu_ops.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
            cu_seqlens_q=cu_q, max_seqlen_q=kw["max_seqlen_q"], k_descale=k_descale,
            v_descale=v_descale, sinks=sinks, causal=True, ver=4)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager = step(q, args[9], args[10], sinks)
    torch.testing.assert_close(compiled(q, args[9], args[10], sinks), eager)


@pytest.mark.gpu
@pytest.mark.skipif(GPU_DEVICE is None, reason="needs a CUDA or XPU device")
@pytest.mark.parametrize("op", [KVCACHE, VARLEN], ids=["kvcache", "varlen"])
@pytest.mark.parametrize("index,variant", PARAMS)
def test_client_forms_on_the_gpu_match_oracle(op, index, variant):
    """Every provider that runs on the device, on the client forms (bf16 sinks, ``[1]``/``[b]``
    descales, stride-0 views)."""
    make = attention_case_inputs if op is KVCACHE else varlen_case_inputs
    cpu_args, kw = make(ATTENTION_CASES[index], "cpu", gen=torch.Generator().manual_seed(9))
    cpu_args = client_forms(cpu_args, variant)
    ran = 0
    for name, reason in xpu_ops.providers.candidates(op_name(op), GPU_DEVICE):
        if reason is not None:
            continue
        args = tuple(a.to(GPU_DEVICE) if isinstance(a, torch.Tensor) else a for a in cpu_args)
        with xpu_ops.use_provider(name):
            lse = op(*args, **kw)
        out = args[6 if op is KVCACHE else 5]
        expected = (oracle.flash_attn_with_kvcache(*cpu_args, **kw) if op is KVCACHE
                    else _varlen_oracle(cpu_args, kw))
        assert_matches_oracle(out.cpu(), expected[0], out.dtype, lse.cpu(), expected[1])
        ran += 1
    assert ran >= 2   # reference and triton at least


def _varlen_oracle(args, kw):
    q, k, v, cu_q, cu_k, out, seqused_k, qv, q_d, k_d, v_d, sinks, seqused_q = args
    return oracle.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, causal=kw["causal"], window_size_left=kw["window_size_left"],
        window_size_right=kw["window_size_right"], softmax_scale=kw["softmax_scale"],
        softcap=kw["softcap"], sinks=sinks, qv=qv, seqused_k=seqused_k, q_descale=q_d,
        k_descale=k_d, v_descale=v_d, seqused_q=seqused_q)
