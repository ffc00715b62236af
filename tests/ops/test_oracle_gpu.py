"""Every provider that runs on the GPU against the float64 oracle, on ``xpu_ops.testing``'s
samples built on the device, plus opcheck there. Marked ``gpu``: CI deselects it; run with
``pytest -m gpu tests/ops/test_oracle_gpu.py`` on the GPU machine. Last run: H200, torch
2.11.0+cu130, Triton 3.6.0: 207 passed (reference and triton, every sample; opcheck on cuda),
69 skipped (sgl_kernel absent)."""

from __future__ import annotations

import pytest
import torch

import xpu_ops
from xpu_ops import providers
from xpu_ops.testing import REGISTERED_OPS, op_name, sample_inputs

from . import dsa_oracle, oracle, oracle_flash_mla
from .test_merge_state_v1 import oracle_base2
from .test_sparse_attn import oracle as sparse_attn_oracle
from .test_store_cache import oracle_store
from . import oracle_linear_attention as linear_oracle
from .utils import FP8, LSE_TOL, OPCHECK_UTILS, OUT_TOL, has_fp8
from ..markers import GPU_DEVICE, requires_gpu

DEVICE = GPU_DEVICE
pytestmark = requires_gpu
# fp32 inputs may go through TF32 tensor cores on the GPU (10-bit mantissa): bf16-like bounds.
GPU_OUT_TOL = {**OUT_TOL, torch.float32: dict(atol=2e-3, rtol=2e-3)}
GPU_LSE_TOL = {**LSE_TOL, torch.float32: dict(atol=2e-3, rtol=2e-3)}


def _params():
    out = []
    for op in REGISTERED_OPS:
        name = op_name(op)
        for prov, reason in providers.candidates(name, DEVICE or "cuda"):
            n = len(list(sample_inputs(op, "cpu")))
            for i in range(n):
                out.append(pytest.param(op, prov, i, id=f"{name}-{prov}-{i}", marks=() if
                                        reason is None else pytest.mark.skip(reason=reason)))
    return out


def _cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


def _close(actual, expected, dtype, tol=GPU_OUT_TOL):
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.cpu().double(), expected, **tol[dtype])


def _check(name, args, kwargs, result, inputs):
    """Compare ``result``/mutated ``args`` (run on the device) with the oracle of ``inputs``
    (CPU copies taken before the call)."""
    if name == "flash_attn_with_kvcache":
        out64, lse64 = oracle.flash_attn_with_kvcache(*inputs, **kwargs)
        _close(args[6], out64, args[6].dtype)
        _close(result, lse64, args[6].dtype, GPU_LSE_TOL)
    elif name == "flash_attn_varlen_func":
        q, k, v, cu_q, cu_k, out, seqused_k, qv, qd, kd, vd, sinks, seqused_q = inputs
        out64, lse64 = oracle.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, causal=kwargs["causal"], window_size_left=kwargs[
                "window_size_left"], window_size_right=kwargs["window_size_right"],
            softmax_scale=kwargs["softmax_scale"], softcap=kwargs["softcap"], sinks=sinks, qv=qv,
            seqused_k=seqused_k, q_descale=qd, k_descale=kd, v_descale=vd, seqused_q=seqused_q)
        _close(args[5], out64, args[5].dtype)
        _close(result, lse64, args[5].dtype, GPU_LSE_TOL)
    elif name == "merge_state_v2":
        v64, s64 = oracle.merge_state(*inputs[:4])
        _close(args[4], v64, args[4].dtype)
        _close(args[5], s64, torch.float32, GPU_LSE_TOL)
    elif name == "flash_mla_decode":
        _close(result, oracle.flash_mla_decode(*inputs[:5], inputs[6]), result.dtype)
    elif name == "flash_mla_prefill":
        q_nope, q_pe, kv_cache, cu_q, seq_lens_k, page_table = inputs[:6]
        _close(result, oracle.flash_mla_prefill(q_nope, q_pe, kv_cache, cu_q, seq_lens_k,
                                                page_table, sm_scale=kwargs["sm_scale"],
                                                causal=kwargs["causal"]), result.dtype)
    elif name == "store_kv_cache":
        k_cache, v_cache, loc, k, v, ks, vs = inputs
        for got, cache, src, scale in ((args[0], k_cache, k, ks), (args[1], v_cache, v, vs)):
            want = oracle.store_kv(cache, loc, src, None if scale is None else float(scale))
            _cache_equal(got.cpu(), want)
    elif name == "store_mla_kv_cache":
        kv_cache, loc, k_nope, k_rope = inputs
        _cache_equal(args[0].cpu(), oracle.store_kv(kv_cache, loc,
                                                    torch.cat([k_nope, k_rope], -1).flatten(1)))
    elif name == "prepare_swa_spec_page_table":
        page_table, prefix_lens, draft_slots, mask = inputs
        table, lens = (t.cpu() for t in result)
        row = 0
        for r in range(page_table.shape[0]):
            for i in range(draft_slots.shape[1]):
                want = page_table[r, :int(prefix_lens[r])].tolist() + [
                    int(draft_slots[r, j]) for j in range(draft_slots.shape[1]) if mask[r, i, j]]
                assert int(lens[row]) == len(want) and table[row, :len(want)].tolist() == want
                row += 1
    elif name == "apply_rotary_emb":
        _close(result, oracle.apply_rotary_emb(*inputs, **kwargs), result.dtype)
    elif name == "flash_mla_with_kvcache":
        out64, lse64 = oracle_flash_mla.flash_mla_with_kvcache(*inputs)
        _close(result[0], out64, result[0].dtype)
        _close(result[1], lse64, result[0].dtype, GPU_LSE_TOL)
    elif name == "flash_mla_sparse_fwd":
        out64, max64, lse64 = oracle_flash_mla.flash_mla_sparse_fwd(*inputs)
        _close(result[0], out64, result[0].dtype)
        for got, want in zip(result[1:], (max64, lse64)):
            _close(got, want, result[0].dtype, GPU_LSE_TOL)
    elif name in _LINEAR:
        _check_linear_attention(name, args, result, inputs)
    elif name in _CLIENT_OPS:
        _check_client_op(name, args, kwargs, result, inputs)
    elif not dsa_oracle.compare(name, args, result, inputs):
        raise AssertionError(f"no oracle for {name}")


_CLIENT_OPS = ("merge_state", "store_cache", "sparse_attn_func", "convert_vertical_slash_indexes")


def _check_client_op(name, args, kwargs, result, inputs):
    """sgl-kernel-xpu's own forms: each against the float64 oracle of its CPU test file; the
    index converter (integers only) against the same op run on the CPU copies."""
    if name == "merge_state":
        v64, s64 = oracle_base2(*inputs[:4])
        _close(args[4], v64, args[4].dtype)
        torch.testing.assert_close(args[5].cpu().double(), s64, atol=1e-5, rtol=1e-6)
    elif name == "store_cache":
        k, v, k_cache, v_cache, indices = inputs
        for got, cache, rows in ((args[2], k_cache, k), (args[3], v_cache, v)):
            assert torch.equal(got.cpu().double(), oracle_store(cache, rows, indices))
    elif name == "sparse_attn_func":
        out64, lse64 = sparse_attn_oracle(*inputs[:7], **kwargs)
        _close(args[7], out64, args[7].dtype)
        torch.testing.assert_close(result.cpu().double(), lse64, atol=2e-5, rtol=2e-5)
    else:
        cpu_args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in inputs)
        with xpu_ops.use_provider("reference"):
            want = torch.ops.xpu_ops.convert_vertical_slash_indexes(*cpu_args, **kwargs)
        got = result if isinstance(result, (tuple, list)) else (result,)
        want = want if isinstance(want, (tuple, list)) else (want,)
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w)
        for g, w in zip(args, cpu_args):  # written arguments, if any
            if isinstance(g, torch.Tensor):
                assert torch.equal(g.cpu(), w)


_LINEAR = ("causal_conv1d_fn", "causal_conv1d_update", "fused_gdn_gating",
           "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
_STATE_TOL = dict(atol=2e-3, rtol=2e-3, equal_nan=True)


def _check_linear_attention(name, args, result, inputs):
    """The linear-attention ops: outputs and every state pool they write (NaN slots stay NaN)."""
    if name == "fused_gdn_gating":
        g64, beta64 = linear_oracle.gdn_gating(*inputs)
        _close(result[0], g64, torch.float32)
        _close(result[1], beta64, inputs[3].dtype)   # beta is rounded to b's dtype
        return
    if name in ("causal_conv1d_fn", "causal_conv1d_update"):
        fn = getattr(linear_oracle, name)
        out64, states64 = fn(*inputs)
        pools = [(args[3] if name == "causal_conv1d_fn" else args[1], states64)]
    else:
        q, k, v, g, beta, scale, states, slots = inputs[:8]
        if name == "chunk_gated_delta_rule":
            extra = dict(has_initial_state=inputs[8])
            cu, l2 = inputs[9], inputs[10]
        else:
            cu, l2 = inputs[8], inputs[9]
            extra = dict(intermediate_states=inputs[10], disable_state_update=inputs[11])
        out64, states64, inter64 = linear_oracle.gated_delta_rule(q, k, v, g, beta, scale, states,
                                                                  slots, cu, l2, **extra)
        pools = [(args[6], states64)] + ([(args[10], inter64)] if inter64 is not None else [])
    _close(result, out64, result.dtype)
    for got, want in pools:
        torch.testing.assert_close(got.cpu().double(), want, **_STATE_TOL)


def _cache_equal(got, want):
    if got.dtype in FP8:
        torch.testing.assert_close(got.float(), want.float(), rtol=0.25, atol=0.0)
    else:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("op,provider,index", _params())
def test_provider_matches_oracle_on_device(op, provider, index):
    args, kwargs = list(sample_inputs(op, DEVICE, seed=9000 + index))[index]
    inputs = tuple(_cpu(a) for a in args)
    inputs = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in inputs)
    with xpu_ops.use_provider(provider):
        result = op(*args, **kwargs)
    _check(op_name(op), args, kwargs, result, inputs)


@pytest.mark.parametrize("op,index", [pytest.param(op, i, id=f"{op_name(op)}-{i}")
                                      for op in REGISTERED_OPS
                                      for i in range(len(list(sample_inputs(op, "cpu"))))])
def test_opcheck_on_device(op, index):
    args, kwargs = list(sample_inputs(op, DEVICE))[index]
    utils = tuple(u for u in OPCHECK_UTILS if not (has_fp8(args) and u == "test_schema"))
    torch.library.opcheck(op.default, args, kwargs, test_utils=utils)
