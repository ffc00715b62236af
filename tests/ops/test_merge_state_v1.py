"""``merge_state`` (v1: base-2 LSEs, sgl-kernel / FlashInfer): numerics against the float64
oracle (the natural-log oracle on LSEs scaled by ln 2, which is the v1 contract exactly), empty
sides, the wrappers' LSE dtype conversion, checks eager and fake, a fullgraph trace."""

from __future__ import annotations

import math

import pytest
import torch

import xpu_ops

from . import oracle
from .utils import OUT_TOL, error_message, reseeded_sample, runnable_providers, sample_indices

OP = torch.ops.xpu_ops.merge_state
PROVIDERS = runnable_providers("merge_state")
LN2 = math.log(2.0)


def oracle_base2(v_a, s_a, v_b, s_b):
    """``m = max``, ``w = 2^(s - m)``, ``s = m + log2(w_a + w_b)``: the natural-log merge of
    ``s ln 2``, read back in log2 units (float64)."""
    v, s = oracle.merge_state(v_a, s_a.double() * LN2, v_b, s_b.double() * LN2)
    return v, s / LN2


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", sample_indices(OP))
def test_matches_oracle(provider, index):
    args = reseeded_sample(OP, index, seed=4100 + index)
    v_a, s_a, v_b, s_b, v_m, s_m = args
    with xpu_ops.use_provider(provider):
        OP(*args)
    v64, s64 = oracle_base2(v_a, s_a, v_b, s_b)
    assert not v_m.isnan().any() and not s_m.isnan().any()
    torch.testing.assert_close(v_m.double(), v64, **OUT_TOL[v_a.dtype])
    torch.testing.assert_close(s_m.double(), s64, atol=1e-5, rtol=1e-6)


def test_base2_differs_from_v2():
    """The two contracts are not the same function (a test that could not tell them apart would
    prove nothing): same inputs, different LSE."""
    gen = torch.Generator().manual_seed(3)
    v_a, v_b = torch.randn(4, 2, 8, generator=gen), torch.randn(4, 2, 8, generator=gen)
    s_a, s_b = torch.randn(4, 2, generator=gen), torch.randn(4, 2, generator=gen)
    _, s1 = xpu_ops.merge_state(v_a, s_a, v_b, s_b)
    _, s2 = xpu_ops.merge_state_v2(v_a, s_a, v_b, s_b)
    torch.testing.assert_close(s1.double(), torch.log2(2.0 ** s_a.double() + 2.0 ** s_b.double()))
    assert not torch.allclose(s1, s2)


@pytest.mark.parametrize("fn", [xpu_ops.merge_state, xpu_ops.merge_state_v2])
@pytest.mark.parametrize("lse_dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_wrappers_read_other_lse_dtypes_as_float32(fn, lse_dtype):
    gen = torch.Generator().manual_seed(5)
    v_a, v_b = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    s_a, s_b = (torch.randn(3, 2, generator=gen).to(lse_dtype) for _ in range(2))
    v, s = fn(v_a, s_a, v_b, s_b)
    v_ref, s_ref = fn(v_a, s_a.float(), v_b, s_b.float())
    assert s.dtype == torch.float32 and torch.equal(v, v_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("change,match", [
    (dict(v_b=torch.zeros(2, 2, 8)), r"merge_state: v_b has the wrong shape"),
    (dict(s_a=torch.zeros(3, 2, dtype=torch.int32)), r"merge_state: s_a has dtype torch.int32"),
    (dict(v_merged=torch.zeros(3, 2, 8, dtype=torch.half)), r"merge_state: v_merged has dtype"),
])
def test_checks_name_merge_state_and_are_runtime_errors(fake, change, match):
    kwargs = dict(v_a=torch.zeros(3, 2, 8), s_a=torch.zeros(3, 2), v_b=torch.zeros(3, 2, 8),
                  s_b=torch.zeros(3, 2), v_merged=torch.zeros(3, 2, 8), s_merged=torch.zeros(3, 2))
    kwargs.update(change)
    msg = error_message(lambda **kw: OP(**kw), kwargs, fake)
    assert msg.startswith("ValueError: ") and match.replace("\\", "") in msg.replace("\\", ""), msg
    with pytest.raises(RuntimeError, match=match):
        OP(**kwargs)


def test_strided_lse_and_fullgraph_trace():
    """A transposed ``[H, N]`` LSE (the attention ops' layout) and ``torch.compile(fullgraph)``
    give the eager result."""
    gen = torch.Generator().manual_seed(8)
    v_a, v_b = torch.randn(5, 3, 32, generator=gen), torch.randn(5, 3, 32, generator=gen)
    lse_a, lse_b = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    eager = xpu_ops.merge_state(v_a, lse_a.T, v_b, lse_b.T)
    v64, s64 = oracle_base2(v_a, lse_a.T, v_b, lse_b.T)
    torch.testing.assert_close(eager[0].double(), v64, **OUT_TOL[torch.float32])
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: xpu_ops.merge_state(*a), fullgraph=True,
                             backend="aot_eager")
    for got, want in zip(compiled(v_a, lse_a.T, v_b, lse_b.T), eager):
        torch.testing.assert_close(got, want)
