"""``xpu_ops.plan`` validates once per call signature: a plan of an already validated signature
must run with its own tensors (metadata included), any change of a shape, stride, dtype, scalar
or the provider state validates again, and a rejected call raises on every plan.

Samples with seed 0 and seed 1 have equal signatures and other values (page tables, slots,
scales); the second plan of each pair must hit the cache and still equal the op called directly
on the second sample.
"""

from __future__ import annotations

import warnings

import pytest

from .triton_mode import INTERPRETED  # first: Triton in interpreter mode

import torch  # noqa: E402

import xpu_ops  # noqa: E402
from xpu_ops import providers  # noqa: E402
from xpu_ops import sgl_kernel as sk  # noqa: E402
from xpu_ops import plan as xpu_plan  # noqa: E402
from xpu_ops.plan import OpPlan, clear_validation_cache, validation_cache_info  # noqa: E402
from xpu_ops.testing import sample_inputs  # noqa: E402

from .native_sgl_kernel import define_native_library  # noqa: E402
from .utils import clone as clone_args  # noqa: E402

ATTN, STORE = "flash_attn_with_kvcache", "store_kv_cache"
# Only the per-layer tensors are slots: metadata, scales, descales, sinks and qv are bound by
# each plan, so a plan that kept another plan's tensors would compute something else.
SLOTS = {ATTN: (0, 1, 2, 6), STORE: (0, 1, 3, 4)}


@pytest.fixture(autouse=True)
def empty_cache(monkeypatch):
    monkeypatch.delenv("XPU_OPS_PROVIDER", raising=False)
    clear_validation_cache()
    yield
    clear_validation_cache()


def _counts() -> tuple[int, int]:
    info = validation_cache_info()
    return info["hits"], info["misses"]


def _outputs(op, args):
    return [args[6]] if op == ATTN else [args[0], args[1]]


@pytest.mark.parametrize("provider", ["reference", "triton"])
@pytest.mark.parametrize("op", [ATTN, STORE])
def test_a_cached_signature_plan_runs_with_its_own_tensors(op, provider, monkeypatch):
    if provider == "triton":
        if not INTERPRETED:
            pytest.skip("Triton was imported in compile mode first (see tests/ops/triton_mode.py)")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    pairs = zip(sample_inputs(op, "cpu", seed=0), sample_inputs(op, "cpu", seed=1))
    for i, ((args0, kwargs0), (args1, kwargs1)) in enumerate(pairs):
        with xpu_ops.use_provider(provider):
            OpPlan(op, args0, kwargs0, SLOTS[op])
            hits, misses = _counts()
            plan = OpPlan(op, args1, kwargs1, SLOTS[op])
            assert _counts() == (hits + 1, misses), f"sample {i}: expected a cache hit"
            want_args = clone_args(args1)
            getattr(torch.ops.xpu_ops, op)(*want_args, **kwargs1)
        plan.run(*[args1[j] for j in SLOTS[op]])
        for got, want in zip(_outputs(op, args1), _outputs(op, want_args)):
            torch.testing.assert_close(got, want, equal_nan=True, atol=0, rtol=0,
                                       msg=lambda m: f"sample {i}: {m}")


def _wider_table(page_table: torch.Tensor) -> torch.Tensor:
    """``page_table``'s values as a view with other strides (columns of a wider table)."""
    wide = torch.zeros(page_table.shape[0], page_table.shape[1] + 3, dtype=page_table.dtype)
    wide[:, :page_table.shape[1]] = page_table
    return wide[:, :page_table.shape[1]]


def test_any_change_of_the_signature_validates_again(monkeypatch):
    samples = sample_inputs(ATTN, "cpu")
    args, kwargs = next(samples)
    other_shapes = next(samples)
    with_table = list(args)
    with_table[4] = _wider_table(args[4])
    bf16 = tuple(a.to(torch.bfloat16) if i in SLOTS[ATTN] else a for i, a in enumerate(args))
    variants = {
        "shapes": other_shapes,
        "dtypes": (bf16, kwargs),
        "softmax_scale": (args, dict(kwargs, softmax_scale=kwargs["softmax_scale"] / 2)),
        "softcap": (args, dict(kwargs, softcap=1.5)),
        "causal": (args, dict(kwargs, causal=not kwargs["causal"], window_size_right=-1)),
        "page_table strides": (tuple(with_table), kwargs),
        "slots": (args, kwargs),  # with other slots, below
    }
    OpPlan(ATTN, args, kwargs, SLOTS[ATTN])
    for name, (a, kw) in variants.items():
        slots = (0, 6) if name == "slots" else SLOTS[ATTN]
        hits, misses = _counts()
        OpPlan(ATTN, a, kw, slots)
        assert _counts() == (hits, misses + 1), f"{name}: expected a new validation"
        OpPlan(ATTN, a, kw, slots)
        assert _counts() == (hits + 1, misses + 1), f"{name}: expected a cache hit"
    hits, misses = _counts()
    with xpu_ops.use_provider("reference"):  # the forced provider is part of the signature
        OpPlan(ATTN, args, kwargs, SLOTS[ATTN])
    monkeypatch.setenv("XPU_OPS_PROVIDER", "reference")
    OpPlan(ATTN, args, kwargs, SLOTS[ATTN])
    assert _counts() == (hits + 1, misses + 1)


def test_a_rejected_call_raises_on_every_plan():
    samples = list(sample_inputs(ATTN, "cpu"))
    args, kwargs = next((a, kw) for a, kw in samples if kw["max_seqlen_q"] == 1)
    OpPlan(ATTN, args, kwargs, SLOTS[ATTN])  # the valid signature is cached
    bad = list(args)
    bad[4] = args[4].long()  # page_table must be int32
    for _ in range(3):
        with pytest.raises(ValueError, match="page_table has dtype torch.int64"):
            OpPlan(ATTN, bad, kwargs, SLOTS[ATTN])
    # Equal (and equally hashed) values of another type: True == 1, 1 == True.
    for _ in range(2):
        with pytest.raises(TypeError, match="causal must be bool, got int 1"):
            OpPlan(ATTN, args, dict(kwargs, causal=int(kwargs["causal"])), SLOTS[ATTN])
        with pytest.raises(TypeError, match="max_seqlen_q must be int, got bool True"):
            OpPlan(ATTN, args, dict(kwargs, max_seqlen_q=True), SLOTS[ATTN])
    with pytest.raises(ValueError, match="slot 7 must be the position of a tensor"):
        OpPlan(ATTN, args, kwargs, SLOTS[ATTN] + (7,))
    assert validation_cache_info()["size"] == 1


def test_a_forced_provider_that_cannot_run_raises_after_the_signature_was_cached(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args, kwargs = next(sample_inputs(ATTN, "cpu"))
    OpPlan(ATTN, args, kwargs, SLOTS[ATTN])
    with xpu_ops.use_provider("triton"), pytest.raises(RuntimeError, match="cannot run on cpu"):
        OpPlan(ATTN, args, kwargs, SLOTS[ATTN])
    monkeypatch.setenv("XPU_OPS_PROVIDER", "bogus")
    with pytest.raises(ValueError, match="'bogus' is not a provider"):
        OpPlan(ATTN, args, kwargs, SLOTS[ATTN])


def test_registering_an_implementation_validates_again():
    args, kwargs = next(sample_inputs(ATTN, "cpu"))
    OpPlan(ATTN, args, kwargs, SLOTS[ATTN])
    hits, misses = _counts()
    providers.invalidate_cache()  # what register() does
    OpPlan(ATTN, args, kwargs, SLOTS[ATTN])
    assert _counts() == (hits, misses + 1)


def test_fallbacks_are_counted_for_every_plan(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args, kwargs = next((a, kw) for a, kw in sample_inputs(ATTN, "cpu")
                        if a[0].dtype == torch.float32)
    with sk.bound_to(define_native_library("xpu_ops_plan_cache_native")):
        reason = "the native kernel takes float16/bfloat16 queries, got torch.float32"
        key = (ATTN, "sgl_kernel", reason)
        before = providers.fallbacks().get(key, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # warned once per process, maybe earlier
            plans = [OpPlan(ATTN, args, kwargs, SLOTS[ATTN]) for _ in range(3)]
        assert _counts() == (2, 1)
        assert providers.fallbacks()[key] == before + 3
        assert all(plan._fn is providers._registry[ATTN]["reference"].fn for plan in plans)


def test_the_cache_keeps_a_bounded_number_of_signatures(monkeypatch):
    monkeypatch.setattr(xpu_plan, "_VALIDATED_MAX", 2)
    args, kwargs = next(sample_inputs(ATTN, "cpu"))
    scales = (0.5, 0.25, 0.125)
    for scale in scales:
        OpPlan(ATTN, args, dict(kwargs, softmax_scale=scale), SLOTS[ATTN])
    assert validation_cache_info()["size"] == 2
    hits, misses = _counts()
    OpPlan(ATTN, args, dict(kwargs, softmax_scale=scales[-1]), SLOTS[ATTN])  # kept
    OpPlan(ATTN, args, dict(kwargs, softmax_scale=scales[0]), SLOTS[ATTN])   # the oldest: gone
    assert _counts() == (hits + 1, misses + 1)
