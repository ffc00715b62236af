"""``causal_conv1d_fn`` / ``causal_conv1d_update``: every sample (contiguous and strided) against
the float64 oracle with NaN in every slot not read, slot -1, update == fn, transformers' torch
functions, every argument check, and a fullgraph trace."""

from __future__ import annotations

import pytest

from .triton_mode import (interpret_while_module_runs, provider_params,  # noqa: F401  first
                          rerun_in_subprocess, running)
import torch

import xpu_ops
from xpu_ops.testing import sample_inputs
from xpu_ops.testing_layouts import outside_view_unchanged

from . import oracle_linear_attention as oracle
from .utils import OUT_TOL, clone, error_message

PROVIDERS = provider_params()
test_rerun_in_subprocess = rerun_in_subprocess(__file__)

FN = torch.ops.xpu_ops.causal_conv1d_fn
UPDATE = torch.ops.xpu_ops.causal_conv1d_update
LAYOUTS = ["contiguous", "strided"]
N_FN = len(list(sample_inputs(FN, "cpu")))
N_UPDATE = len(list(sample_inputs(UPDATE, "cpu")))


def _base(t: torch.Tensor) -> torch.Tensor:
    return (t._base if t._base is not None else t).clone()


def assert_states(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Conv states are copies of inputs: bit-exact, NaN (slots not written) included."""
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=0, atol=0, equal_nan=True)


def run_checked(op, args, state_index, expected_fn, provider):
    """Run ``op(*args)`` under ``provider``; compare out and the state pool with the oracle and
    check nothing outside the pool's view was written."""
    expected_out, expected_states = expected_fn(*clone(args))
    states = args[state_index]
    before = _base(states)
    with running(provider):
        out = op(*args)
    assert not out.isnan().any(), "output holds NaN"
    torch.testing.assert_close(out.double(), expected_out, **OUT_TOL[out.dtype])
    assert_states(states, expected_states)
    assert outside_view_unchanged(states, before)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("index", range(N_FN))
def test_fn_matches_oracle(provider, layout, index):
    args, _ = list(sample_inputs(FN, "cpu", seed=100 + index, layout=layout))[index]
    run_checked(FN, args, 3, oracle.causal_conv1d_fn, provider)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("index", range(N_UPDATE))
def test_update_matches_oracle(provider, layout, index):
    args, _ = list(sample_inputs(UPDATE, "cpu", seed=200 + index, layout=layout))[index]
    run_checked(UPDATE, args, 1, oracle.causal_conv1d_update, provider)


def _request(gen, dim=6, width=4, length=7):
    x = torch.randn(length, dim, generator=gen)
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    return x, weight, bias, torch.randn(3, dim, width - 1, generator=gen)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_update_in_steps_equals_fn(provider):
    # Prefill 3 tokens, then decode 1, then verify 3: the same outputs and state as one prefill.
    x, weight, bias, states = _request(torch.Generator().manual_seed(1))
    whole = states.clone()
    one = torch.tensor([2], dtype=torch.int32)
    with running(provider):
        expected = xpu_ops.causal_conv1d_fn(x, weight, bias, whole, torch.tensor(
            [0, 7], dtype=torch.int32), one, torch.tensor([True]))
        parts = [xpu_ops.causal_conv1d_fn(x[:3], weight, bias, states, torch.tensor(
            [0, 3], dtype=torch.int32), one, torch.tensor([True]))]
        parts.append(xpu_ops.causal_conv1d_update(x[3:4], states, weight, bias,
                                                  conv_state_indices=one))
        parts.append(xpu_ops.causal_conv1d_update(x[None, 4:], states, weight, bias,
                                                  conv_state_indices=one)[0])
    torch.testing.assert_close(torch.cat(parts), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(states, whole, atol=0, rtol=0)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_matches_transformers(provider):
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x, weight, bias, states = _request(torch.Generator().manual_seed(2))
    with running(provider):
        out = xpu_ops.causal_conv1d_fn(x, weight, bias, states, torch.tensor(
            [0, 7], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
            torch.tensor([False]))
    hf = qwen3_next.causal_conv1d_fn(x.T[None], weight, bias, activation="silu")[0].T
    torch.testing.assert_close(out, hf, atol=1e-5, rtol=1e-5)
    hf_state = states[0].clone()[None]
    token = torch.randn(1, x.shape[1])
    with running(provider):
        step = xpu_ops.causal_conv1d_update(token, states, weight, bias,
                                            conv_state_indices=torch.tensor([0], dtype=torch.int32))
    # transformers keeps the whole window (width entries); ours keeps width - 1.
    window = torch.cat([torch.zeros(1, x.shape[1], 1), hf_state], dim=2)
    hf_step = qwen3_next.causal_conv1d_update(token[:, :, None], window, weight, bias, "silu")
    torch.testing.assert_close(step, hf_step[:, :, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[0], window[0, :, 1:], atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# Argument checks (eager and fake)
# ----------------------------------------------------------------------------------------------

def _fn_kwargs(**over):
    kw = dict(x=torch.randn(5, 4), weight=torch.randn(4, 3), bias=torch.randn(4),
              conv_states=torch.randn(2, 4, 2), query_start_loc=torch.tensor([0, 2, 5],
                                                                             dtype=torch.int32),
              cache_indices=torch.tensor([0, 1], dtype=torch.int32),
              has_initial_state=torch.tensor([True, False]), activation="silu")
    kw.update(over)
    return kw


FN_BAD = [
    (dict(x=torch.randn(5, 4, 1)), r"causal_conv1d_fn: x has the wrong number of dimensions; "
     r"expected 2-D"),
    (dict(x=torch.randn(5, 4).to(torch.int32)), r"x has dtype torch.int32"),
    (dict(weight=torch.randn(3, 3)), r"weight has the wrong size in dimension 0; expected "
     r"x.shape\[-1\] \(dim\) = 4"),
    (dict(weight=torch.randn(4, 0), conv_states=torch.randn(2, 4, -1 + 1)), r"weight has no taps"),
    (dict(bias=torch.randn(3)), r"bias has the wrong size in dimension 0"),
    (dict(conv_states=torch.randn(2, 4, 3)), r"conv_states has the wrong size in dimension 2; "
     r"expected weight.shape\[1\] - 1 = 2"),
    (dict(conv_states=torch.randn(2, 5, 2)), r"conv_states has the wrong size in dimension 1"),
    (dict(cache_indices=torch.tensor([0, 1])), r"cache_indices has dtype torch.int64; expected "
     r"torch.int32"),
    (dict(query_start_loc=torch.tensor([0, 5], dtype=torch.int32)),
     r"query_start_loc has the wrong size in dimension 0; expected b \+ 1 = 3"),
    (dict(has_initial_state=torch.tensor([1, 0], dtype=torch.int32)),
     r"has_initial_state has dtype torch.int32; expected torch.bool"),
    (dict(has_initial_state=torch.tensor([True])), r"has_initial_state has the wrong size"),
    (dict(activation="gelu"), r"activation is not supported; expected None, 'silu' or 'swish', "
     r"got 'gelu'"),
    (dict(activation=1), r"activation is not a str"),
    (dict(x=[[1.0]]), r"causal_conv1d_fn: x is not a tensor"),
]


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("over,pattern", FN_BAD, ids=[f"fn-{i}" for i in range(len(FN_BAD))])
def test_fn_rejects(over, pattern, fake):
    kw = _fn_kwargs(**over)
    if fake and not all(isinstance(v, torch.Tensor) or v is None or isinstance(v, str)
                        for v in kw.values()):
        pytest.skip("a non-tensor argument has no fake")
    before = kw["conv_states"].clone()
    import re
    assert re.search(pattern, error_message(xpu_ops.causal_conv1d_fn, kw, fake))
    assert torch.equal(kw["conv_states"], before)   # a rejected call writes nothing


def _update_kwargs(**over):
    kw = dict(x=torch.randn(2, 4), conv_state=torch.randn(3, 4, 2), weight=torch.randn(4, 3),
              bias=None, activation=None, conv_state_indices=torch.tensor([2, -1],
                                                                          dtype=torch.int32))
    kw.update(over)
    return kw


UPDATE_BAD = [
    (dict(x=torch.randn(4)), r"causal_conv1d_update: x has the wrong number of dimensions; "
     r"expected 2-D or 3-D"),
    (dict(conv_state_indices=torch.tensor([0], dtype=torch.int32)),
     r"conv_state_indices has the wrong size in dimension 0; expected x.shape\[0\] \(b\) = 2"),
    (dict(conv_state=torch.randn(1, 4, 2), conv_state_indices=None),
     r"conv_state has fewer slots than requests"),
    (dict(conv_state=torch.randn(3, 4, 2).double()), r"conv_state has dtype torch.float64"),
    (dict(weight=torch.randn(4, 3, 1)), r"weight has the wrong number of dimensions"),
    (dict(activation="relu"), r"activation is not supported"),
]


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("over,pattern", UPDATE_BAD,
                         ids=[f"update-{i}" for i in range(len(UPDATE_BAD))])
def test_update_rejects(over, pattern, fake):
    import re
    kw = _update_kwargs(**over)
    before = kw["conv_state"].clone()
    assert re.search(pattern, error_message(xpu_ops.causal_conv1d_update, kw, fake))
    assert torch.equal(kw["conv_state"], before)


# ----------------------------------------------------------------------------------------------
# Tracing
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("provider", PROVIDERS)
def test_fullgraph_trace_matches_eager(provider):
    x, weight, bias, states = _request(torch.Generator().manual_seed(3))
    qsl = torch.tensor([0, 4, 7], dtype=torch.int32)
    slots = torch.tensor([1, 0], dtype=torch.int32)
    init = torch.tensor([True, False])

    def step(x, states):
        out = xpu_ops.causal_conv1d_fn(x, weight, bias, states, qsl, slots, init)
        return out, xpu_ops.causal_conv1d_update(out[-2:], states, weight, bias,
                                                 conv_state_indices=slots)

    eager_states, traced_states = states.clone(), states.clone()
    with running(provider):
        expected = step(x, eager_states)
        torch._dynamo.reset()
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(x, traced_states)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(traced_states, eager_states, atol=0, rtol=0)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_out_of_range_slots_act_as_no_state(provider):
    x, weight, bias, states = _request(torch.Generator().manual_seed(4))
    qsl = torch.tensor([0, 3, 7], dtype=torch.int32)
    init = torch.tensor([True, True])
    with running(provider):
        pool = states.clone()
        got = xpu_ops.causal_conv1d_fn(x, weight, bias, pool, qsl,
                                       torch.tensor([3, -7], dtype=torch.int32), init)
        want = xpu_ops.causal_conv1d_fn(x, weight, bias, states.clone(), qsl,
                                        torch.tensor([-1, -1], dtype=torch.int32), init)
        assert torch.equal(pool, states)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        step = xpu_ops.causal_conv1d_update(
            x[:2], pool, weight, bias, conv_state_indices=torch.tensor([5, -1], dtype=torch.int32))
        assert torch.equal(pool, states)
        torch.testing.assert_close(step[0], torch.nn.functional.silu(bias + weight[:, -1] * x[0]),
                                   atol=1e-6, rtol=1e-6)   # zeros before the token


@pytest.mark.parametrize("call,kwargs,pattern", [
    (xpu_ops.causal_conv1d_fn, _fn_kwargs(cache_indices=torch.tensor([0, 2], dtype=torch.int32)),
     r"causal_conv1d_fn: cache_indices has a state slot out of range"),
    (xpu_ops.causal_conv1d_fn, _fn_kwargs(cache_indices=torch.tensor([1, 1], dtype=torch.int32)),
     r"causal_conv1d_fn: cache_indices has a repeated state slot"),
    (xpu_ops.causal_conv1d_fn, _fn_kwargs(query_start_loc=torch.tensor([0, 2, 4],
                                                                         dtype=torch.int32)),
     r"causal_conv1d_fn: query_start_loc does not end at the number of tokens"),
    (xpu_ops.causal_conv1d_update, _update_kwargs(conv_state_indices=torch.tensor(
        [3, -1], dtype=torch.int32)), r"causal_conv1d_update: conv_state_indices has a state "
     r"slot out of range"),
], ids=["fn-slot", "fn-repeat", "fn-cu", "update-slot"])
def test_debug_checks_name_inconsistent_metadata(call, kwargs, pattern):
    states = kwargs.get("conv_states", kwargs.get("conv_state"))
    before = states.clone()
    with xpu_ops.debug_checks(), pytest.raises(ValueError, match=pattern):
        call(**kwargs)
    assert torch.equal(states, before)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_expanded_inputs_match_contiguous_copies(provider):
    x, weight, bias, states = _request(torch.Generator().manual_seed(5))
    expanded = dict(x=x[:1].expand(x.shape[0], -1), weight=weight[:1].expand(x.shape[1], -1),
                    bias=bias[:1].expand(x.shape[1]))
    dense = {name: t.contiguous() for name, t in expanded.items()}
    qsl = torch.tensor([0, 3, 7], dtype=torch.int32)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    results = []
    for inputs in (expanded, dense):
        pool = states.clone()
        with running(provider):
            out = xpu_ops.causal_conv1d_fn(inputs["x"], inputs["weight"], inputs["bias"], pool,
                                           qsl, slots, torch.tensor([True, False]))
            step = xpu_ops.causal_conv1d_update(inputs["x"][:2, None].expand(-1, 3, -1), pool,
                                                inputs["weight"], inputs["bias"],
                                                conv_state_indices=slots)
        results.append((out, step, pool))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("device", [None, "xpu"], ids=["cpu", "xpu"])
def test_fakes_keep_symbolic_token_counts(device):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from .utils import fake_like
    x, weight, bias, states = _request(torch.Generator().manual_seed(6))
    mode = FakeTensorMode(shape_env=ShapeEnv())
    real = dict(x=x, weight=weight, bias=bias, states=states,
                qsl=torch.tensor([0, 3, 7], dtype=torch.int32),
                slots=torch.tensor([0, 2], dtype=torch.int32), init=torch.tensor([True, False]),
                step=torch.randn(2, 3, x.shape[1]))
    dynamic = {"x": (0,), "qsl": (0,), "slots": (0,), "init": (0,), "step": (0, 1)}
    f = {name: fake_like(mode, t, dynamic.get(name, ()), device) for name, t in real.items()}
    with mode:
        out = xpu_ops.causal_conv1d_fn(f["x"], f["weight"], f["bias"], f["states"], f["qsl"],
                                       f["slots"], f["init"])
        step = xpu_ops.causal_conv1d_update(f["step"], f["states"], f["weight"], f["bias"],
                                            conv_state_indices=f["slots"])
    assert isinstance(out.shape[0], torch.SymInt) and str(out.shape[0]) == str(f["x"].shape[0])
    assert [str(s) for s in step.shape] == [str(s) for s in f["step"].shape]
    assert out.device == step.device == f["x"].device and out.dtype == x.dtype


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("token_programs", [1, 3])
def test_long_requests_share_few_token_programs(provider, token_programs, monkeypatch):
    # Triton's prefill launch has about TOKEN_PROGRAMS token-block programs in all; with 1 or
    # 3 each program strides over several 16-token blocks of its request.
    if provider == "triton":
        from xpu_ops.triton import causal_conv1d as triton_conv
        monkeypatch.setattr(triton_conv, "TOKEN_PROGRAMS", token_programs)
    gen = torch.Generator().manual_seed(7)
    lens, dim, width = (40, 3, 0, 33), 5, 4
    x, weight = torch.randn(sum(lens), dim, generator=gen), torch.randn(dim, width, generator=gen)
    states = torch.randn(4, dim, width - 1, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    slots = torch.tensor([2, 0, -1, 3], dtype=torch.int32)
    init = torch.tensor([True, False, True, True])
    expected_out, expected_states = oracle.causal_conv1d_fn(x, weight, None, states, qsl, slots,
                                                            init, "silu")
    with running(provider):
        out = xpu_ops.causal_conv1d_fn(x, weight, None, states, qsl, slots, init)
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states.double(), expected_states, atol=0, rtol=0)
