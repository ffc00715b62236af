"""``merge_state_v2``: numerics against the float64 oracle (empty sides, far-apart LSEs), the
bug-report cases for empty states, and every argument check."""

from __future__ import annotations

import math
import re

import pytest
import torch

import xpu_ops

from . import oracle
from .utils import OUT_TOL, error_message, reseeded_sample, runnable_providers, sample_indices

OP = torch.ops.xpu_ops.merge_state_v2
PROVIDERS = runnable_providers("merge_state_v2")


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", sample_indices(OP))
def test_matches_oracle(provider, index):
    args = reseeded_sample(OP, index, seed=4000 + index)
    v_a, s_a, v_b, s_b, v_m, s_m = args
    with xpu_ops.use_provider(provider):
        OP(*args)
    v64, s64 = oracle.merge_state(v_a, s_a, v_b, s_b)
    assert not v_m.isnan().any() and not s_m.isnan().any()
    torch.testing.assert_close(v_m.double(), v64, **OUT_TOL[v_a.dtype])
    torch.testing.assert_close(s_m.double(), s64, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("empty_lse", [float("-inf"), float("inf")], ids=["neginf", "posinf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_empty_states(provider, dtype, empty_lse):
    # API.md: -inf and +inf (FlashAttention's LSE of an empty row) both mean an empty state.
    gen = torch.Generator().manual_seed(11)
    v_a, v_b = (torch.randn(3, 2, 64, generator=gen).to(dtype) for _ in range(2))
    s = torch.randn(3, 2, generator=gen)
    empty = torch.full((3, 2), empty_lse)
    with xpu_ops.use_provider(provider):
        v, lse = xpu_ops.merge_state_v2(v_a, empty, v_b, empty)
        expected_v, expected_s = oracle.merge_state(v_a, empty, v_b, empty)
        torch.testing.assert_close(v.double(), expected_v, rtol=0, atol=0)   # exactly 0
        assert torch.isneginf(lse).all() and torch.isneginf(expected_s).all()
        # One empty side: the other state comes back bit-exactly, on either side.
        for args, (v_keep, s_keep) in (((v_a, s, v_b, empty), (v_a, s)),
                                       ((v_a, empty, v_b, s), (v_b, s))):
            v, lse = xpu_ops.merge_state_v2(*args)
            assert torch.equal(v, v_keep) and torch.equal(lse, s_keep)
            torch.testing.assert_close(v.double(), oracle.merge_state(*args)[0], rtol=0, atol=0)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_posinf_lse_bug_report(provider):
    # sgl-kernel's test_merge_state_v2.py marks empty rows with +inf; the merge gave NaN.
    gen = torch.Generator().manual_seed(12)
    v_a, v_b = torch.randn(4, 2, 16, generator=gen), torch.randn(4, 2, 16, generator=gen)
    s_a, s_b = torch.randn(4, 2, generator=gen), torch.randn(4, 2, generator=gen)
    s_a[:2, 0] = float("inf")
    s_b[1:3, 1] = float("inf")
    v_a[0, 0] = float("nan")                     # an empty side's values are never read
    with xpu_ops.use_provider(provider):
        v, lse = xpu_ops.merge_state_v2(v_a, s_a, v_b, s_b)
    v64, s64 = oracle.merge_state(v_a, s_a, v_b, s_b)
    assert not v.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(v.double(), v64, **OUT_TOL[torch.float32])
    torch.testing.assert_close(lse.double(), s64, atol=1e-5, rtol=1e-6)
    assert torch.equal(v[0, 0], v_b[0, 0]) and lse[0, 0] == s_b[0, 0]   # the other side, exactly


def test_out_arguments_are_written_and_returned():
    v_a, v_b = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    s_a, s_b = torch.randn(4, 2), torch.randn(4, 2)
    v_m, s_m = torch.full((4, 2, 8), float("nan")), torch.full((4, 2), float("nan"))
    v, s = xpu_ops.merge_state_v2(v_a, s_a, v_b, s_b, v_m, s_m)
    assert v is v_m and s is s_m
    v64, s64 = oracle.merge_state(v_a, s_a, v_b, s_b)
    torch.testing.assert_close(v.double(), v64, **OUT_TOL[torch.float32])
    torch.testing.assert_close(s.double(), s64, atol=1e-5, rtol=1e-6)


def _valid():
    return dict(v_a=torch.randn(4, 2, 8), s_a=torch.randn(4, 2), v_b=torch.randn(4, 2, 8),
                s_b=torch.randn(4, 2))


BAD = {
    "v_a 2-D": (dict(v_a=torch.randn(4, 2)), "v_a has the wrong number of dimensions"),
    "v_a int": (dict(v_a=torch.ones(4, 2, 8, dtype=torch.int32)), "v_a has dtype torch.int32"),
    "v_b dtype": (dict(v_b=torch.randn(4, 2, 8).half()), "v_b has dtype torch.float16"),
    "v_b shape": (dict(v_b=torch.randn(4, 2, 4)), "v_b has the wrong shape"),
    "s_a dtype": (dict(s_a=torch.zeros(4, 2, dtype=torch.int32)), "s_a has dtype torch.int32"),
    "s_b shape": (dict(s_b=torch.randn(2, 4)), r"s_b has the wrong shape; expected \[N, H\]"),
    "s_a 3-D": (dict(s_a=torch.randn(4, 2, 1)), "s_a has the wrong number of dimensions"),
    "v_merged shape": (dict(v_merged=torch.empty(4, 2, 4)), "v_merged has the wrong shape"),
    "v_merged dtype": (dict(v_merged=torch.empty(4, 2, 8).half()),
                       "v_merged has dtype torch.float16"),
    "s_merged shape": (dict(s_merged=torch.empty(4, 1)), "s_merged has the wrong shape"),
    "s_b device": (dict(s_b=torch.randn(4, 2, device="meta")), "s_b is on the wrong device"),
}


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("name", list(BAD))
def test_argument_errors(name, fake):
    change, match = BAD[name]
    kwargs = {**_valid(), **change}
    msg = error_message(lambda **kw: xpu_ops.merge_state_v2(**kw), kwargs, fake)
    assert msg.startswith("ValueError: merge_state_v2: ") and re.search(match, msg), msg
    if fake:
        assert msg == error_message(lambda **kw: xpu_ops.merge_state_v2(**kw), kwargs, False)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", ["triton"])
def test_offsets_past_2_to_the_31_on_gpu(provider):
    """Tensors of 2**32 elements (sgl-kernel's regression size): the kernel's offsets are
    int64, so the last tokens merge correctly (an int32 offset would wrap to the first). The
    reference is PyTorch indexing (int64) and would need ~5x the memory in float32 here."""
    from ..markers import GPU_DEVICE
    if GPU_DEVICE is None:
        pytest.skip("needs a CUDA or XPU device")
    num_heads, head_dim = 8, 128
    tokens = 2 ** 32 // (num_heads * head_dim)
    dev = GPU_DEVICE
    v_a = torch.ones(tokens, num_heads, head_dim, dtype=torch.bfloat16, device=dev)
    v_b = torch.full_like(v_a, 3.0)
    s_a = torch.zeros(tokens, num_heads, device=dev)
    s_b = torch.zeros(tokens, num_heads, device=dev)
    v_a[-4:] = 5.0                     # the last tokens differ from the first: (5 + 3) / 2
    s_b[-4:, -1] = float("-inf")       # and the very last head sees only side a
    with xpu_ops.use_provider(provider):
        v, s = xpu_ops.merge_state_v2(v_a, s_a, v_b, s_b)
    assert v[0].float().eq(2.0).all() and v[-4:, :-1].float().eq(4.0).all()
    assert v[-4:, -1].float().eq(5.0).all()
    torch.testing.assert_close(s[-1, :-1].cpu(), torch.full((num_heads - 1,), math.log(2.0)))
    assert s[-1, -1].item() == 0.0
