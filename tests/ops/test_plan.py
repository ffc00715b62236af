"""``xpu_ops.plan``: a plan validates once and re-runs the op with new slot tensors.

Every sample of the two per-layer ops is planned on one set of tensors and run with other slot
tensors (same shapes, other values; NaN-poisoned slots and outputs stay NaN); the result must
equal the op called directly on a copy of the second set. Bad plans raise the op's own errors; mismatched slot tensors raise
(``run``) or re-plan (``planned_call``).
"""

from __future__ import annotations

import pytest

from .triton_mode import INTERPRETED  # first: Triton in interpreter mode

import torch  # noqa: E402

import xpu_ops  # noqa: E402
from xpu_ops.plan import (OpPlan, plan_applies, planned_call, planned_run,  # noqa: E402
                          plans_enabled)
from xpu_ops.testing import sample_inputs  # noqa: E402

from .utils import clone as clone_args  # noqa: E402

# The tensors that change from layer to layer (positions in the op's arguments).
SLOTS = {"flash_attn_with_kvcache": (0, 1, 2, 6), "store_kv_cache": (0, 1, 3, 4)}
PROVIDERS = ["reference", "triton"]


def _other_values(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A tensor like ``t`` with other values; NaN stays NaN (poisoned cache slots, outputs)."""
    noise = torch.randn(t.shape, generator=gen)
    return (t.float() + noise).to(t.dtype).as_strided(t.shape, t.stride())


def _slots(op, args):
    """SLOTS plus every optional per-layer tensor the sample has (qv, descales, sinks), as the
    backend plans them."""
    optional = (7, 8, 9, 10, 11) if op == "flash_attn_with_kvcache" else (5, 6)
    return SLOTS[op] + tuple(i for i in optional if args[i] is not None)


def _pairs(op):
    gen = torch.Generator().manual_seed(1)
    pairs = []
    for args, kwargs in sample_inputs(op, "cpu"):
        other = list(args)
        for j in _slots(op, args):
            other[j] = _other_values(args[j], gen)
        pairs.append(((args, kwargs), (tuple(other), kwargs)))
    return pairs


def _outputs(op, args):
    return [args[6]] if op == "flash_attn_with_kvcache" else [args[0], args[1]]


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("op", sorted(SLOTS))
def test_plan_reruns_with_new_tensors_like_the_op(op, provider, monkeypatch):
    if provider == "triton":
        if not INTERPRETED:
            pytest.skip("Triton was imported in compile mode first (see tests/ops/triton_mode.py)")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    for i, ((args0, kwargs), (args1, _)) in enumerate(_pairs(op)):
        slots = _slots(op, args0)
        with xpu_ops.use_provider(provider):
            plan = OpPlan(op, args0, kwargs, slots)
        want_args = clone_args(args1)
        with xpu_ops.use_provider(provider):
            want = getattr(torch.ops.xpu_ops, op)(*want_args, **kwargs)
        got = plan.run(*[args1[j] for j in slots])
        for g, w in zip(_outputs(op, args1), _outputs(op, want_args)):
            torch.testing.assert_close(g, w, equal_nan=True, atol=0, rtol=0,
                                       msg=lambda m: f"sample {i}: {m}")
            if g.numel() and op == "flash_attn_with_kvcache":
                assert not g.isnan().any(), f"sample {i}: an output row was never written"
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, equal_nan=True, atol=0, rtol=0)


def test_plan_runs_the_ops_checks():
    (args, kwargs), = [s for s in [next(sample_inputs("flash_attn_with_kvcache", "cpu"))]]
    bad = list(args)
    bad[3] = bad[3].long()  # cache_seqlens must be int32
    with pytest.raises(ValueError, match="cache_seqlens"):
        OpPlan("flash_attn_with_kvcache", bad, kwargs, SLOTS["flash_attn_with_kvcache"])


def test_run_rejects_a_tensor_unlike_the_planned_one():
    args, kwargs = next(sample_inputs("flash_attn_with_kvcache", "cpu"))
    plan = OpPlan("flash_attn_with_kvcache", args, kwargs, SLOTS["flash_attn_with_kvcache"])
    q, k_cache, v_cache, out = (args[j] for j in SLOTS["flash_attn_with_kvcache"])
    with pytest.raises(ValueError, match=r"run: q has shape .* expected the planned"):
        plan.run(q[:-1], k_cache, v_cache, out)
    with pytest.raises(ValueError, match=r"run: out has shape .*torch.float64"):
        plan.run(q, k_cache, v_cache, out.double())
    with pytest.raises(TypeError, match=r"one tensor per slot \['q', 'k_cache', 'v_cache', "
                                        r"'out'\], got \['Tensor'\]"):
        plan.run(q)


def test_plan_checks_slots_and_scalar_types():
    args, kwargs = next(sample_inputs("flash_attn_with_kvcache", "cpu"))
    slots = SLOTS["flash_attn_with_kvcache"]
    with pytest.raises(TypeError, match="causal must be bool, got str 'yes'"):
        OpPlan("flash_attn_with_kvcache", args, dict(kwargs, causal="yes"), slots)
    with pytest.raises(TypeError, match="max_seqlen_q must be int, got float 1.5"):
        OpPlan("flash_attn_with_kvcache", args, dict(kwargs, max_seqlen_q=1.5), slots)
    with pytest.raises(ValueError, match="slot 7 must be the position of a tensor.*NoneType"):
        OpPlan("flash_attn_with_kvcache", args, kwargs, (0, 7))
    with pytest.raises(ValueError, match="slot 40 .* out of range"):
        OpPlan("flash_attn_with_kvcache", args, kwargs, (0, 40))


def test_plans_do_not_apply_where_the_op_would_not_run_its_kernel_now():
    t = torch.zeros(2)
    assert plan_applies(t)
    with xpu_ops.debug_checks():  # value checks run only in the public ops
        assert not plan_applies(t)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        assert not plan_applies(mode.from_tensor(t))
    assert not plan_applies(torch.nn.Parameter(t))  # a subclass: not a plain tensor
    seen = []
    torch.compile(lambda x: seen.append((plan_applies(x), plans_enabled())) or x + 1,
                  backend="eager")(t)
    assert seen == [(False, False)]
    assert plans_enabled()
    with xpu_ops.debug_checks():
        assert not plans_enabled()


def test_matches_compares_shape_strides_dtype_and_every_slot():
    args, kwargs = next(sample_inputs("store_kv_cache", "cpu"))
    slots = SLOTS["store_kv_cache"]
    plan = OpPlan("store_kv_cache", args, kwargs, slots)
    tensors = [args[j] for j in slots]
    assert plan.matches(tensors)
    k = tensors[2]
    other_strides = k.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, other strides
    assert other_strides.shape == k.shape and other_strides.stride() != k.stride()
    for i, bad in ((2, other_strides), (2, k.double()), (2, k[:0]), (3, k.new_empty(0))):
        assert not plan.matches(tensors[:i] + [bad] + tensors[i + 1:]), i
    assert not plan.matches(tensors[:3])  # a missing slot never matches


def test_planned_run_builds_the_call_only_for_a_new_plan():
    plans: dict = {}
    samples = list(sample_inputs("store_kv_cache", "cpu"))
    slots = SLOTS["store_kv_cache"]
    built = []

    def run(args, kwargs):
        want = clone_args(args)
        torch.ops.xpu_ops.store_kv_cache(*want, **kwargs)
        planned_run(plans, "store", [args[j] for j in slots],
                    lambda: built.append(1) or ("store_kv_cache", args, kwargs, slots))
        torch.testing.assert_close(args[0], want[0], atol=0, rtol=0)
    for args, kwargs in (samples[0], samples[0], samples[1]):
        run(args, kwargs)
    assert len(built) == 2  # a new plan for the first call and for the new cache shape


def test_planned_run_rejects_tensors_other_than_the_calls_slots():
    args, kwargs = next(sample_inputs("store_kv_cache", "cpu"))
    slots = SLOTS["store_kv_cache"]
    tensors = [args[j] for j in slots]
    for bad in (tensors[:3], [t.clone() for t in tensors]):
        with pytest.raises(ValueError, match=r"planned_run\(store_kv_cache\): tensors must be "
                                             r"args\[i\] for i in slots \(0, 1, 3, 4\)"):
            planned_run({}, "store", bad, lambda: ("store_kv_cache", args, kwargs, slots))


def test_planned_call_replans_when_a_slot_changes_shape():
    plans: dict = {}
    samples = list(sample_inputs("store_kv_cache", "cpu"))
    (a0, kw0), (a1, kw1) = samples[0], samples[1]  # different cache shapes
    for args, kwargs in ((a0, kw0), (a0, kw0), (a1, kw1)):
        want = clone_args(args)
        torch.ops.xpu_ops.store_kv_cache(*want, **kwargs)
        planned_call(plans, "store", "store_kv_cache", args, kwargs, SLOTS["store_kv_cache"])
        torch.testing.assert_close(args[0], want[0], atol=0, rtol=0)
        torch.testing.assert_close(args[1], want[1], atol=0, rtol=0)
    assert list(plans) == ["store"]
    assert plans["store"].matches([a1[j] for j in SLOTS["store_kv_cache"]])
