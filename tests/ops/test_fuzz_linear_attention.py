"""Hypothesis fuzzing of the linear-attention ops, bounded for a 2-core CI (derandomized;
``XPU_OPS_HYPOTHESIS_EXAMPLES=500`` explores more, randomly): random request lengths (0
included), key/value head ratios, state slots (-1, out of range, repeated never), initial-state
flags, chunk sizes, conv widths and layouts, on both providers, against the float64 oracle, with
NaN in every slot not read and nothing written outside the state views."""

from __future__ import annotations

import os

import pytest

from .triton_mode import provider_params, rerun_in_subprocess, running  # first

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import xpu_ops  # noqa: E402
from xpu_ops.testing_layouts import outside_view_unchanged, strided_view  # noqa: E402

from . import oracle_linear_attention as oracle  # noqa: E402

_EXAMPLES = int(os.environ.get("XPU_OPS_HYPOTHESIS_EXAMPLES", "0"))
PROVIDERS = provider_params()
test_rerun_in_subprocess = rerun_in_subprocess(__file__)
I32 = torch.int32


def _settings(examples: int):
    return settings(max_examples=_EXAMPLES or examples, deadline=None,
                    derandomize=not _EXAMPLES, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


lengths = st.lists(st.integers(0, 20), min_size=1, max_size=3)
slot_kinds = st.lists(st.sampled_from(["slot", "none", "outside"]), min_size=3, max_size=3)


def _slots(kinds, batch, num_slots, gen):
    """Distinct slots in ``[0, num_slots)``, -1 or an out-of-range id, per ``kinds``."""
    order = torch.randperm(num_slots, generator=gen).tolist()
    pick = {"none": lambda r: -1, "outside": lambda r: num_slots + 3, "slot": lambda r: order[r]}
    return torch.tensor([pick[kinds[r]](r) for r in range(batch)], dtype=I32)


def _pool(num_slots, shape, slots, reads, gen):
    pool = torch.full((num_slots, *shape), float("nan"))
    for s, read in zip(slots.tolist(), reads):
        if 0 <= s < num_slots and read:
            pool[s] = torch.randn(*shape, generator=gen)
    return pool


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=I32)


@pytest.mark.parametrize("provider", PROVIDERS)
@_settings(12)
@given(lens=lengths, kinds=slot_kinds, heads=st.sampled_from([(1, 1), (1, 3), (2, 4)]),
       chunk=st.sampled_from([1, 5, 16, 64]), recurrent=st.booleans(), strided=st.booleans(),
       l2=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_gated_delta_rule_fuzz(provider, lens, kinds, heads, chunk, recurrent, strided, l2, seed):
    gen = torch.Generator().manual_seed(seed)
    hk, hv = heads
    total, batch, k_dim, v_dim = sum(lens), len(lens), 8, 4
    q = torch.randn(total, hk, k_dim, generator=gen)
    k = torch.randn(total, hk, k_dim, generator=gen)
    if not l2:
        k = k * k_dim ** -0.5
    v = torch.randn(total, hv, v_dim, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(total, hv, generator=gen) + 2)
    beta = torch.rand(total, hv, generator=gen)
    slots = _slots(kinds, batch, 4, gen)
    init = torch.randint(0, 2, (batch,), generator=gen).bool()
    reads = [True] * batch if recurrent else init.tolist()
    pool = _pool(4, (hv, k_dim, v_dim), slots, reads, gen)
    if strided:
        q, v, pool = strided_view(q), strided_view(v), strided_view(pool)
    before = (pool._base if pool._base is not None else pool).clone()
    cu = _cu(lens)
    expected = oracle.gated_delta_rule(q, k, v, g, beta, 0.4, pool, slots, cu, l2,
                                       has_initial_state=None if recurrent else init)
    with running(provider):
        if recurrent:
            out = xpu_ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta, 0.4, pool, slots,
                                                           cu, use_qk_l2norm_in_kernel=l2)
        else:
            out = xpu_ops.chunk_gated_delta_rule(q, k, v, g, beta, 0.4, pool, slots, init, cu,
                                                 use_qk_l2norm_in_kernel=l2, chunk_size=chunk)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool.double(), expected[1], atol=1e-4, rtol=1e-4, equal_nan=True)
    assert outside_view_unchanged(pool, before)


@pytest.mark.parametrize("provider", PROVIDERS)
@_settings(12)
@given(lens=lengths, kinds=slot_kinds, width=st.sampled_from([1, 2, 4]), update=st.booleans(),
       strided=st.booleans(), silu=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_causal_conv1d_fuzz(provider, lens, kinds, width, update, strided, silu, seed):
    gen = torch.Generator().manual_seed(seed)
    batch, dim = len(lens), 6
    act = "silu" if silu else None
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    slots = _slots(kinds, batch, 4, gen)
    if update:
        steps = max(1, lens[0])
        x = torch.randn(batch, steps, dim, generator=gen)
        pool = _pool(4, (dim, width - 1), slots, [True] * batch, gen)
    else:
        x = torch.randn(sum(lens), dim, generator=gen)
        init = torch.randint(0, 2, (batch,), generator=gen).bool()
        pool = _pool(4, (dim, width - 1), slots, init.tolist(), gen)
    if strided:
        x, pool = strided_view(x), strided_view(pool)
    before = (pool._base if pool._base is not None else pool).clone()
    if update:
        expected = oracle.causal_conv1d_update(x, pool, weight, bias, act, slots)
    else:
        expected = oracle.causal_conv1d_fn(x, weight, bias, pool, _cu(lens), slots, init, act)
    with running(provider):
        if update:
            out = xpu_ops.causal_conv1d_update(x, pool, weight, bias, act, slots)
        else:
            out = xpu_ops.causal_conv1d_fn(x, weight, bias, pool, _cu(lens), slots, init, act)
    torch.testing.assert_close(out.double(), expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.double(), expected[1], atol=0, rtol=0, equal_nan=True)
    assert outside_view_unchanged(pool, before)
