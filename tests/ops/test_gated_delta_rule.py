"""Gated delta rule ops: every sample (contiguous and strided) against the float64 token-by-token
oracle, with NaN in every state slot not read and around every state view; chunked == recurrent
== transformers' torch functions; chunk-size independence; verify rollback through the
intermediate states; every argument check; a fullgraph trace."""

from __future__ import annotations

import re

import pytest

from .triton_mode import (interpret_while_module_runs, provider_params,  # noqa: F401  first
                          rerun_in_subprocess, running)
import torch

import xpu_ops
from xpu_ops.testing import sample_inputs
from xpu_ops.testing_layouts import outside_view_unchanged

from . import oracle_linear_attention as oracle
from .utils import clone, error_message

PROVIDERS = provider_params()
test_rerun_in_subprocess = rerun_in_subprocess(__file__)

GATING = torch.ops.xpu_ops.fused_gdn_gating
CHUNK = torch.ops.xpu_ops.chunk_gated_delta_rule
RECURRENT = torch.ops.xpu_ops.fused_recurrent_gated_delta_rule
LAYOUTS = ["contiguous", "strided"]
# Outputs are rounded once to their dtype; float32 leaves room for the chunked solve.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
STATE_TOL = dict(atol=1e-4, rtol=1e-4, equal_nan=True)


def _count(op) -> int:
    return len(list(sample_inputs(op, "cpu")))


def _sample(op, index, seed, layout):
    return list(sample_inputs(op, "cpu", seed=seed, layout=layout))[index][0]


def _base(t: torch.Tensor) -> torch.Tensor:
    return (t._base if t._base is not None else t).clone()


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("index", range(_count(GATING)))
def test_gating_matches_oracle(provider, layout, index):
    args = _sample(GATING, index, 300 + index, layout)
    with running(provider):
        g, beta = GATING(*args)
    g64, beta64 = oracle.gdn_gating(*args)
    assert g.dtype == beta.dtype == torch.float32
    torch.testing.assert_close(g.double(), g64, atol=1e-5, rtol=1e-5)
    ulp = torch.finfo(args[3].dtype).eps           # beta is rounded to b's dtype: 1 ulp apart
    torch.testing.assert_close(beta.double(), beta64, atol=ulp, rtol=0)


def _check_against_oracle(out, states, before, expected):
    expected_out, expected_states = expected[:2]
    assert not out.isnan().any(), "output holds NaN"
    torch.testing.assert_close(out.double(), expected_out, **TOL[out.dtype])
    torch.testing.assert_close(states.double(), expected_states, **STATE_TOL)
    assert outside_view_unchanged(states, before)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("index", range(_count(CHUNK)))
def test_chunk_matches_oracle(provider, layout, index):
    args = _sample(CHUNK, index, 400 + index, layout)
    q, k, v, g, beta, scale, states, slots, init, cu, l2, _ = clone(args)
    expected = oracle.gated_delta_rule(q, k, v, g, beta, scale, states, slots, cu, l2,
                                       has_initial_state=init)
    before = _base(args[6])
    with running(provider):
        out = CHUNK(*args)
    _check_against_oracle(out, args[6], before, expected)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("index", range(_count(RECURRENT)))
def test_recurrent_matches_oracle(provider, layout, index):
    args = _sample(RECURRENT, index, 500 + index, layout)
    q, k, v, g, beta, scale, states, slots, cu, l2, inter, disable = clone(args)
    expected = oracle.gated_delta_rule(q, k, v, g, beta, scale, states, slots, cu, l2,
                                       intermediate_states=inter, disable_state_update=disable)
    before = _base(args[6])
    inter_before = None if args[10] is None else _base(args[10])
    with running(provider):
        out = RECURRENT(*args)
    _check_against_oracle(out, args[6], before, expected)
    if args[10] is not None:
        torch.testing.assert_close(args[10].double(), expected[2], **STATE_TOL)
        assert outside_view_unchanged(args[10], inter_before)


# ----------------------------------------------------------------------------------------------
# Chunked == recurrent == transformers; chunk size; rollback
# ----------------------------------------------------------------------------------------------

def _batch(seed, lens=(21, 1, 40), hk=2, hv=4, k_dim=8, v_dim=6, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, hk, k_dim, generator=gen).to(dtype)
    k = torch.randn(total, hk, k_dim, generator=gen).to(dtype)
    v = torch.randn(total, hv, v_dim, generator=gen).to(dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(total, hv, generator=gen) + 2)
    beta = torch.rand(total, hv, generator=gen)
    states = torch.randn(len(lens) + 2, hv, k_dim, v_dim, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    slots = torch.arange(len(lens), dtype=torch.int32).flip(0) + 1
    return q, k, v, g, beta, states, slots, cu


@pytest.mark.parametrize("provider", PROVIDERS)
def test_chunked_equals_recurrent_for_every_chunk_size(provider):
    q, k, v, g, beta, states, slots, cu = _batch(1)
    init = torch.ones(slots.shape[0], dtype=torch.bool)
    recurrent_states = states.clone()
    with running(provider):
        expected = xpu_ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta, 0.3,
                                                            recurrent_states, slots, cu)
        for chunk_size in (1, 2, 16, 32, 64):
            chunk_states = states.clone()
            out = xpu_ops.chunk_gated_delta_rule(q, k, v, g, beta, 0.3, chunk_states, slots,
                                                 init, cu, chunk_size=chunk_size)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(chunk_states, recurrent_states, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("use_initial", [False, True])
def test_matches_transformers(provider, use_initial):
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta, states, _, _ = _batch(2, lens=(35,))
    slot = torch.tensor([2], dtype=torch.int32)
    cu = torch.tensor([0, 35], dtype=torch.int32)
    initial = states[2].clone()[None] if use_initial else None
    batch = lambda t: t[None]   # noqa: E731  transformers takes [batch, seq, heads, dim]
    hf_chunk, hf_final = hf.torch_chunk_gated_delta_rule(
        batch(q), batch(k), batch(v), batch(g), batch(beta), chunk_size=4,
        initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    hf_rec, hf_rec_final = hf.torch_recurrent_gated_delta_rule(
        batch(q), batch(k), batch(v), batch(g), batch(beta), initial_state=initial,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    scale = q.shape[-1] ** -0.5                       # transformers' fixed scale
    with running(provider):
        chunk_states = states.clone()
        out = xpu_ops.chunk_gated_delta_rule(q, k, v, g, beta, None, chunk_states, slot,
                                             torch.tensor([use_initial]), cu, chunk_size=16)
        rec_states = states.clone()
        if not use_initial:
            rec_states[2] = 0
        rec = xpu_ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, rec_states,
                                                       slot, cu)
    for ours, theirs in ((out, hf_chunk[0]), (rec, hf_rec[0]), (out, hf_rec[0])):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)
    for ours, theirs in ((chunk_states[2], hf_final[0]), (rec_states[2], hf_rec_final[0])):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_verify_rolls_back_to_accepted_token(provider):
    # Verify 4 drafts per request without touching ssm_states, then accept `accepted[r]` of
    # them: intermediate_states[r, accepted - 1] is the state a plain run over them ends with.
    q, k, v, g, beta, states, _, _ = _batch(3, lens=(4, 4))
    slots = torch.tensor([1, 2], dtype=torch.int32)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    inter = torch.full((3, 4) + states.shape[1:], float("nan"))
    pool = states.clone()
    with running(provider):
        xpu_ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta, 0.5, pool, slots, cu,
                                                 intermediate_states=inter,
                                                 disable_state_update=True)
        assert torch.equal(pool, states)
        assert inter[2].isnan().all()                 # the spare row is not written
        for r, accepted in ((0, 1), (1, 3)):
            plain = states.clone()
            rows = slice(4 * r, 4 * r + accepted)
            xpu_ops.fused_recurrent_gated_delta_rule(
                q[rows], k[rows], v[rows], g[rows], beta[rows], 0.5, plain, slots[r:r + 1],
                torch.tensor([0, accepted], dtype=torch.int32))
            torch.testing.assert_close(inter[r, accepted - 1], plain[slots[r]], atol=1e-6,
                                       rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# Argument checks (eager and fake); a rejected call writes nothing
# ----------------------------------------------------------------------------------------------

def _gdn_kwargs(recurrent: bool, **over):
    q, k, v, g, beta, states, slots, cu = _batch(4, lens=(2, 3))
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, scale=0.5, ssm_states=states, cache_indices=slots,
              cu_seqlens=cu)
    if not recurrent:
        kw["has_initial_state"] = torch.tensor([True, False])
    kw.update(over)
    return kw


COMMON_BAD = [
    (dict(q=torch.randn(5, 2, 8).double()), r"q has dtype torch.float64"),
    (dict(k=torch.randn(5, 2, 7)), r"k has the wrong shape; expected q's shape"),
    (dict(v=torch.randn(5, 3, 6)), r"q/v head counts are incompatible; expected Hk >= 1 and Hv "
     r"a multiple of Hk .*got Hk=2, Hv=3"),
    (dict(v=torch.randn(4, 4, 6)), r"v has the wrong size in dimension 0"),
    (dict(g=torch.randn(5, 4).half()), r"g has dtype torch.float16; expected torch.float32"),
    (dict(beta=torch.rand(5, 2)), r"beta has the wrong shape; expected \[T, Hv\]"),
    (dict(ssm_states=torch.randn(4, 4, 8, 6).half()), r"ssm_states has dtype torch.float16"),
    (dict(ssm_states=torch.randn(4, 4, 6, 8)), r"ssm_states has the wrong size in dimension 2"),
    (dict(cache_indices=torch.tensor([0, 1])), r"cache_indices has dtype torch.int64"),
    (dict(cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)), r"cu_seqlens has the wrong size"),
    (dict(scale=float("nan")), r"scale is not finite"),
    (dict(scale="1"), r"scale is not a real number"),
    (dict(use_qk_l2norm_in_kernel="yes"), r"use_qk_l2norm_in_kernel is not a bool"),
]
CHUNK_BAD = COMMON_BAD + [
    (dict(has_initial_state=torch.tensor([1, 0])), r"has_initial_state has dtype torch.int64"),
    (dict(has_initial_state=torch.tensor([True])), r"has_initial_state has the wrong size"),
    (dict(chunk_size=0), r"chunk_size is not positive"),
    (dict(chunk_size=2.0), r"chunk_size is not an integer"),
]
RECURRENT_BAD = COMMON_BAD + [
    (dict(intermediate_states=torch.zeros(1, 3, 4, 8, 6)),
     r"intermediate_states has fewer rows than requests"),
    (dict(intermediate_states=torch.zeros(2, 3, 4, 8, 5)),
     r"intermediate_states has the wrong size in dimension 4"),
    (dict(intermediate_states=torch.zeros(2, 3, 4, 8)),
     r"intermediate_states has the wrong number of dimensions"),
    (dict(disable_state_update=None), r"disable_state_update is not a bool"),
]


REJECTS = ([pytest.param(xpu_ops.chunk_gated_delta_rule, over, pattern, id=f"chunk-{i}")
            for i, (over, pattern) in enumerate(CHUNK_BAD)]
           + [pytest.param(xpu_ops.fused_recurrent_gated_delta_rule, over, pattern,
                           id=f"recurrent-{i}") for i, (over, pattern) in enumerate(RECURRENT_BAD)])


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("call,over,pattern", REJECTS)
def test_gated_delta_rule_rejects(call, over, pattern, fake):
    kw = _gdn_kwargs(call is xpu_ops.fused_recurrent_gated_delta_rule, **over)
    before = kw["ssm_states"].clone()
    message = error_message(call, kw, fake)
    assert re.search(f"{call.__name__}: " + pattern, message), message
    assert torch.equal(kw["ssm_states"], before)   # a rejected call writes nothing


GATING_BAD = [
    (dict(a=torch.randn(3)), r"a has the wrong number of dimensions"),
    (dict(b=torch.randn(3, 5)), r"b has the wrong shape; expected a's shape"),
    (dict(A_log=torch.randn(5)), r"A_log has the wrong size in dimension 0; expected a.shape\[1\]"),
    (dict(dt_bias=torch.randn(4).to(torch.int32)), r"dt_bias has dtype torch.int32"),
]


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("over,pattern", GATING_BAD, ids=[f"gating-{i}" for i in
                                                          range(len(GATING_BAD))])
def test_gating_rejects(over, pattern, fake):
    kw = dict(A_log=torch.randn(4), a=torch.randn(3, 4), dt_bias=torch.randn(4),
              b=torch.randn(3, 4))
    kw.update(over)
    message = error_message(xpu_ops.fused_gdn_gating, kw, fake)
    assert re.search("fused_gdn_gating: " + pattern, message), message


# ----------------------------------------------------------------------------------------------
# Tracing
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("provider", PROVIDERS)
def test_fullgraph_trace_matches_eager(provider):
    q, k, v, _, _, states, slots, cu = _batch(5)
    gen = torch.Generator().manual_seed(6)
    a, b = torch.randn(q.shape[0], 4, generator=gen), torch.randn(q.shape[0], 4, generator=gen)
    A_log, dt_bias = torch.rand(4, generator=gen), torch.randn(4, generator=gen)
    init = torch.tensor([True, False, True])
    decode_cu = torch.arange(4, dtype=torch.int32)

    def layer(q, k, v, states):
        g, beta = xpu_ops.fused_gdn_gating(A_log, a, dt_bias, b)
        o = xpu_ops.chunk_gated_delta_rule(q, k, v, g, beta, None, states, slots, init, cu)
        step = xpu_ops.fused_recurrent_gated_delta_rule(q[:3], k[:3], v[:3], g[:3], beta[:3],
                                                        None, states, slots, decode_cu)
        return o, step

    eager_states, traced_states = states.clone(), states.clone()
    with running(provider):
        expected = layer(q, k, v, eager_states)
        torch._dynamo.reset()
        got = torch.compile(layer, backend="aot_eager", fullgraph=True)(q, k, v, traced_states)
    for x, y in zip(got, expected):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    torch.testing.assert_close(traced_states, eager_states, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# Inconsistent metadata: clamped without debug checks (every provider alike), named with them
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("provider", PROVIDERS)
def test_out_of_range_slots_act_as_no_state(provider):
    q, k, v, g, beta, states, _, cu = _batch(7, lens=(3, 2, 4))
    bad = torch.tensor([99, -5, -1], dtype=torch.int32)
    none = torch.full((3,), -1, dtype=torch.int32)
    init = torch.ones(3, dtype=torch.bool)
    with running(provider):
        for call, extra in ((xpu_ops.chunk_gated_delta_rule, (init,)),
                            (xpu_ops.fused_recurrent_gated_delta_rule, ())):
            pool = states.clone()
            got = call(q, k, v, g, beta, 0.5, pool, bad, *extra, cu)
            want = call(q, k, v, g, beta, 0.5, states.clone(), none, *extra, cu)
            assert torch.equal(pool, states)
            torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_prefix_sums_past_the_tokens_are_clamped(provider):
    # cu_seqlens [0, 3, 50]: request 1 owns rows [3, T) only, as with [0, 3, T].
    q, k, v, g, beta, states, _, _ = _batch(8, lens=(3, 6))
    slots = torch.tensor([0, 1], dtype=torch.int32)
    with running(provider):
        pool_a, pool_b = states.clone(), states.clone()
        got = xpu_ops.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, 0.5, pool_a, slots, torch.tensor([0, 3, 50], dtype=torch.int32))
        want = xpu_ops.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, 0.5, pool_b, slots, torch.tensor([0, 3, 9], dtype=torch.int32))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(pool_a, pool_b, atol=0, rtol=0)


DEBUG_BAD = [
    (dict(cache_indices=torch.tensor([1, 4], dtype=torch.int32)),
     r"cache_indices has a state slot out of range; expected -1 \(no state\) or 0 <= "
     r"cache_indices < 4 .*got cache_indices\[1\] = 4"),
    (dict(cache_indices=torch.tensor([-2, 0], dtype=torch.int32)),
     r"cache_indices has a state slot out of range"),
    (dict(cache_indices=torch.tensor([1, 1], dtype=torch.int32)),
     r"cache_indices has a repeated state slot"),
    (dict(cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32)),
     r"cu_seqlens does not end at the number of tokens"),
    (dict(cu_seqlens=torch.tensor([0, 3, 2], dtype=torch.int32)), r"cu_seqlens decreases"),
    (dict(intermediate_states=torch.zeros(2, 2, 4, 8, 6)),
     r"intermediate_states has fewer steps than the longest request; expected "
     r"intermediate_states.shape\[1\] >= 3 tokens, got 2"),
]


@pytest.mark.parametrize("over,pattern", DEBUG_BAD, ids=[f"debug-{i}" for i in
                                                         range(len(DEBUG_BAD))])
def test_debug_checks_name_inconsistent_metadata(over, pattern):
    kw = _gdn_kwargs(True, **over)
    before = kw["ssm_states"].clone()
    with xpu_ops.debug_checks(), pytest.raises(ValueError, match=pattern):
        xpu_ops.fused_recurrent_gated_delta_rule(**kw)
    assert torch.equal(kw["ssm_states"], before)
    if "intermediate_states" not in over:
        kw = _gdn_kwargs(False, **over)
        with xpu_ops.debug_checks(), pytest.raises(ValueError, match=pattern):
            xpu_ops.chunk_gated_delta_rule(**kw)
        assert torch.equal(kw["ssm_states"], before)


def test_debug_checks_accept_slot_minus_one():
    kw = _gdn_kwargs(True, cache_indices=torch.tensor([-1, 2], dtype=torch.int32))
    with xpu_ops.debug_checks(), running("reference"):
        xpu_ops.fused_recurrent_gated_delta_rule(**kw)


# ----------------------------------------------------------------------------------------------
# Expanded (stride-0) inputs give what their contiguous copies give
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("provider", PROVIDERS)
def test_expanded_inputs_match_contiguous_copies(provider):
    q, k, v, g, beta, states, slots, cu = _batch(9, lens=(3, 5))
    gen = torch.Generator().manual_seed(10)
    expanded = dict(
        q=q[:, :1].expand(-1, q.shape[1], -1),                     # one key head broadcast
        g=g[:, :1].expand(-1, g.shape[1]),                          # one decay for every head
        beta=torch.rand(1, 1, generator=gen).expand(g.shape),       # one beta everywhere
        A_log=torch.rand(1, generator=gen).expand(4),
        dt_bias=torch.randn(1, generator=gen).expand(4),
        a=torch.randn(1, 4, generator=gen).expand(q.shape[0], -1),
        b=torch.randn(q.shape[0], 4, generator=gen))
    dense = {name: t.contiguous() for name, t in expanded.items()}
    init = torch.tensor([True, False])
    results = []
    for inputs in (expanded, dense):
        with running(provider):
            gating = xpu_ops.fused_gdn_gating(inputs["A_log"], inputs["a"], inputs["dt_bias"],
                                              inputs["b"])
            pool_c, pool_r = states.clone(), states.clone()
            o_c = xpu_ops.chunk_gated_delta_rule(inputs["q"], k, v, inputs["g"], inputs["beta"],
                                                 None, pool_c, slots, init, cu, chunk_size=16)
            o_r = xpu_ops.fused_recurrent_gated_delta_rule(inputs["q"], k, v, inputs["g"],
                                                           inputs["beta"], None, pool_r, slots, cu)
        results.append((*gating, o_c, pool_c, o_r, pool_r))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# Symbolic token counts: the fakes keep T symbolic and need no value
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", [None, "xpu"], ids=["cpu", "xpu"])
def test_fakes_keep_symbolic_token_counts(device):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from .utils import fake_like
    q, k, v, g, beta, states, slots, cu = _batch(11, lens=(3, 4))
    a, b = torch.randn(7, 4), torch.randn(7, 4)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    token_dim = {"q": (0,), "k": (0,), "v": (0,), "g": (0,), "beta": (0,), "a": (0,), "b": (0,),
                 "slots": (0,), "cu": (0,)}
    real = dict(q=q, k=k, v=v, g=g, beta=beta, a=a, b=b, states=states, slots=slots, cu=cu,
                A_log=torch.rand(4), dt_bias=torch.randn(4))
    f = {name: fake_like(mode, t, token_dim.get(name, ()), device) for name, t in real.items()}
    with mode:
        gate_g, gate_beta = xpu_ops.fused_gdn_gating(f["A_log"], f["a"], f["dt_bias"], f["b"])
        init = torch.ones(f["slots"].shape, dtype=torch.bool, device=f["q"].device)
        o = xpu_ops.chunk_gated_delta_rule(f["q"], f["k"], f["v"], f["g"], f["beta"], None,
                                           f["states"], f["slots"], init, f["cu"])
        o_rec = xpu_ops.fused_recurrent_gated_delta_rule(f["q"], f["k"], f["v"], f["g"],
                                                         f["beta"], None, f["states"], f["slots"],
                                                         f["cu"])
    tokens = f["q"].shape[0]
    assert isinstance(tokens, torch.SymInt)
    for out in (o, o_rec):
        assert str(out.shape[0]) == str(tokens) and tuple(out.shape[1:]) == (4, 6)
        assert out.dtype == v.dtype and out.device == f["q"].device and out.is_contiguous()
    assert str(gate_g.shape[0]) == str(f["a"].shape[0]) and gate_beta.dtype == torch.float32
