"""``gdn_attention`` (a gated-delta-net layer's core in one op): every sample against the
float64 oracle (conv, gating and delta rule of ``oracle_linear_attention``, token by token),
NaN in every state slot the call does not read and untouched where it writes nothing; the
Triton provider on two samples; the ``sgl_kernel`` glue against a stand-in of sgl-kernel-xpu's
fused native op (its schema, layouts and input contract: ``native_gdn``), equal to the
reference provider, declines included; argument checks; a fullgraph trace."""

from __future__ import annotations

import re

import pytest

from .triton_mode import (interpret_while_module_runs, provider_params,  # noqa: F401  first
                          rerun_in_subprocess, running)
import torch

import xpu_ops
from xpu_ops import sgl_kernel as sk
from xpu_ops.testing import sample_inputs

from . import native_gdn
from . import oracle_linear_attention as oracle
from .native_sgl_kernel import define_native_library
from .utils import clone, error_message

OP = torch.ops.xpu_ops.gdn_attention
SAMPLES = list(sample_inputs(OP, "cpu"))
test_rerun_in_subprocess = rerun_in_subprocess(__file__)
TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}


def _sample(index: int, seed: int) -> list:
    return list(list(sample_inputs(OP, "cpu", seed=seed))[index][0])


def expected(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Oracle ``(o, conv_states, ssm_states)`` in float64 (the op's definition, step by step)."""
    (mixed, a, b, weight, bias, A_log, dt_bias, conv, ssm, cu, slots, init, hk, k_dim,
     activation, _) = clone(args)
    x, conv_after = oracle.causal_conv1d_fn(mixed, weight, bias, conv, cu, slots, init,
                                            activation)
    t, hv, qk = mixed.shape[0], a.shape[1], hk * k_dim
    x = x.to(mixed.dtype)  # the conv's output is rounded to the input dtype before the rule
    g, beta = oracle.gdn_gating(A_log, a, dt_bias, b)
    o, ssm_after, _ = oracle.gated_delta_rule(
        x[:, :qk].reshape(t, hk, k_dim), x[:, qk:2 * qk].reshape(t, hk, k_dim),
        x[:, 2 * qk:].reshape(t, hv, -1) if t else x[:, 2 * qk:].reshape(0, hv, ssm.shape[3]),
        g, beta, k_dim ** -0.5, ssm, slots, cu, True, has_initial_state=init)
    return o, conv_after, ssm_after


def _check(out, args, want) -> None:
    o, conv_after, ssm_after = want
    assert not out.isnan().any(), "output holds NaN"
    torch.testing.assert_close(out.double(), o, **TOL[out.dtype])
    torch.testing.assert_close(args[7].double(), conv_after, equal_nan=True, **TOL[args[7].dtype])
    # the states see the conv's output rounded to the input dtype: one ulp there moves them
    torch.testing.assert_close(args[8].double(), ssm_after, equal_nan=True, **TOL[out.dtype])


@pytest.mark.parametrize("index", range(len(SAMPLES)))
def test_reference_matches_oracle(index):
    args = _sample(index, 700 + index)
    want = expected(args)
    with xpu_ops.use_provider("reference"):
        out = OP(*args)
    _check(out, args, want)


@pytest.mark.parametrize("provider", provider_params()[1:])
@pytest.mark.parametrize("index", [1, 3])        # a decode (-1 slot) and a float32 decode
def test_triton_matches_oracle(provider, index):
    args = _sample(index, 720 + index)
    want = expected(args)
    with running(provider):
        out = OP(*args)
    _check(out, args, want)


@pytest.fixture
def native():
    with sk.bound_to(define_native_library("xpu_ops_glue_gdn", "writes")):
        xpu_ops.refresh()
        native_gdn.CALLS.clear()
        yield native_gdn.CALLS
    xpu_ops.refresh()


@pytest.mark.parametrize("index", [1, 2])        # bf16 decode, fp16 extend (70 tokens)
def test_glue_equals_reference_through_the_native_op(native, index):
    args = _sample(index, 740 + index)
    ref_args = clone(args)
    with xpu_ops.use_provider("reference"):
        want = OP(*ref_args)
    with xpu_ops.use_provider("sgl_kernel"):
        got = OP(*args)
    batch, decode = args[10].shape[0], args[15]
    assert native == [(0, batch, True) if decode else (batch, 0, True)]
    torch.testing.assert_close(got, want, **TOL[got.dtype])
    torch.testing.assert_close(args[7], ref_args[7], equal_nan=True, **TOL[args[7].dtype])
    torch.testing.assert_close(args[8], ref_args[8], equal_nan=True, atol=1e-4, rtol=1e-4)
    _check(got, args, expected(_sample(index, 740 + index)))


def test_glue_declines_what_the_native_kernels_do_not_serve(native):
    args = _sample(0, 760)                        # float32, K = 8
    with xpu_ops.use_provider("sgl_kernel"), pytest.raises(NotImplementedError,
                                                          match="float32"):
        OP(*args)
    assert native == []                           # declined before the native op ran


def _kwargs(**over):
    gen = torch.Generator().manual_seed(3)
    hk, hv, k_dim, v_dim, width, t = 1, 2, 4, 4, 4, 3
    dim = 2 * hk * k_dim + hv * v_dim
    kw = dict(mixed_qkv=torch.randn(t, dim, generator=gen), a=torch.randn(t, hv, generator=gen),
              b=torch.randn(t, hv, generator=gen), conv_weights=torch.randn(dim, width),
              conv_bias=None, A_log=torch.zeros(hv), dt_bias=torch.zeros(hv),
              conv_states=torch.zeros(2, dim, width - 1), ssm_states=torch.zeros(2, hv, k_dim,
                                                                                 v_dim),
              query_start_loc=torch.tensor([0, 1, t], dtype=torch.int32),
              cache_indices=torch.tensor([0, 1], dtype=torch.int32),
              has_initial_state=torch.tensor([True, False]), num_k_heads=hk, head_k_dim=k_dim)
    kw.update(over)
    return kw


BAD = [
    (dict(mixed_qkv=torch.randn(3, 15)), r"mixed_qkv has a width that does not split into q, "
     r"k and v"),
    (dict(a=torch.randn(3, 3), b=torch.randn(3, 3), num_k_heads=2, head_k_dim=2),
     r"a has a head count that is not a multiple of num_k_heads"),
    (dict(b=torch.randn(2, 2)), r"b has the wrong size in dimension 0"),
    (dict(ssm_states=torch.zeros(2, 2, 4, 4).half()), r"ssm_states has dtype torch.float16"),
    (dict(ssm_states=torch.zeros(2, 2, 4, 5)), r"ssm_states has the wrong size in dimension 3"),
    (dict(conv_states=torch.zeros(2, 16, 2)), r"conv_states has the wrong size in dimension 2"),
    (dict(cache_indices=torch.tensor([0, 1])), r"cache_indices has dtype torch.int64"),
    (dict(has_initial_state=torch.tensor([True])), r"has_initial_state has the wrong size"),
    (dict(A_log=torch.zeros(3)), r"A_log has the wrong size in dimension 0"),
    (dict(num_k_heads=1.0), r"num_k_heads is not an integer"),
    (dict(decode=True), r"decode is True for a batch that is not one token per request"),
    (dict(activation="relu"), r"activation is not supported"),
    # an expanded pool: every slot one memory (silently overwritten by each request before)
    (dict(conv_states=torch.zeros(1, 16, 3).expand(2, 16, 3)),
     r"conv_states has elements that share memory"),
    (dict(ssm_states=torch.zeros(1, 2, 4, 4).expand(2, 2, 4, 4)),
     r"ssm_states has elements that share memory"),
    # the conv's checks name this op's arguments, not causal_conv1d's (weight, bias, x)
    (dict(conv_weights=torch.randn(15, 4)), r"conv_weights has the wrong size in dimension 0; "
     r"expected mixed_qkv.shape\[-1\] \(dim\) = 16"),
    (dict(conv_weights=torch.randn(16, 0), conv_states=torch.zeros(2, 16, 0)),
     r"conv_weights has no taps"),
    (dict(conv_bias=torch.randn(15)), r"conv_bias has the wrong size in dimension 0"),
    (dict(conv_bias=torch.randn(16).long()), r"conv_bias has dtype torch.int64"),
    (dict(conv_states=torch.zeros(2, 16, 2)), r"conv_states has the wrong size in dimension 2; "
     r"expected conv_weights.shape\[1\] - 1 = 3"),
]


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("over,pattern", BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_rejects_and_writes_nothing(over, pattern, fake):
    kw = _kwargs(**over)
    before = (kw["conv_states"].clone(), kw["ssm_states"].clone())
    message = error_message(xpu_ops.gdn_attention, kw, fake)
    assert re.search("gdn_attention: " + pattern, message), message
    assert torch.equal(kw["conv_states"], before[0]) and torch.equal(kw["ssm_states"], before[1])


def test_debug_checks_refuse_a_decode_with_a_fresh_request():
    kw = _kwargs(mixed_qkv=torch.randn(2, 16), a=torch.randn(2, 2), b=torch.randn(2, 2),
                 query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32), decode=True)
    with xpu_ops.debug_checks(), pytest.raises(ValueError, match="has_initial_state has a "
                                               "False entry"):
        xpu_ops.gdn_attention(**kw)


def test_fullgraph_trace_matches_eager():
    args = _sample(0, 780)
    eager_args, traced_args = clone(args), clone(args)

    def layer(*a):
        return xpu_ops.gdn_attention(*a) * 2

    with xpu_ops.use_provider("reference"):
        want = layer(*eager_args)
        torch._dynamo.reset()
        got = torch.compile(layer, backend="aot_eager", fullgraph=True)(*traced_args)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    for i in (7, 8):
        torch.testing.assert_close(traced_args[i], eager_args[i], atol=0, rtol=0, equal_nan=True)
