"""The shim's raw ops (``torch.ops.sgl_kernel.rotary_embedding`` / ``fp8_paged_mqa_logits``,
``xpu_ops/compat_ops.py``) under hostile input: a ``key`` that is the ``query`` tensor (rotated
once), an expanded 2-D input (rejected before any write, eager and fake), a cache without rows,
messages that name the raw op's own arguments, and a hypothesis fuzz of the rotation (odd
strides, positions outside the cache, both pair layouts) against the float64 oracle."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from .test_compat_ops import PAGED, ROPE, oracle_rope  # skips this module with a real sgl_kernel
from .utils import error_message

_EXAMPLES = int(os.environ.get("XPU_OPS_HYPOTHESIS_EXAMPLES", "0"))


def test_rotary_key_that_is_the_query_is_rotated_once():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 16, generator=gen)
    cache, positions = torch.randn(9, 8, generator=gen), torch.tensor([0, 3, 8, 2])
    want = oracle_rope(x, positions, cache, 8, True)
    q_out, k_out = ROPE(positions, x, x, 8, cache, True)
    for got in (x, q_out, k_out):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("arg", ["query", "key"])
def test_rotary_rejects_an_expanded_2d_input_before_any_write(arg, fake):
    kwargs = dict(positions=torch.arange(3), query=torch.ones(3, 16), key=torch.ones(3, 8),
                  head_size=8, cos_sin_cache=torch.randn(5, 8), is_neox=True)
    kwargs[arg] = torch.ones(1, kwargs[arg].shape[1]).expand(3, -1)
    msg = error_message(lambda **kw: ROPE(**kw), kwargs, fake)
    assert msg.startswith(f"ValueError: rotary_embedding: {arg} has elements that share "
                          "memory"), msg
    assert (kwargs["query"] == 1).all() and (kwargs["key"] == 1).all()


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
def test_rotary_rejects_a_cache_without_rows(fake):
    kwargs = dict(positions=torch.arange(3), query=torch.ones(3, 16), key=torch.ones(3, 8),
                  head_size=8, cos_sin_cache=torch.zeros(0, 8), is_neox=False)
    msg = error_message(lambda **kw: ROPE(**kw), kwargs, fake)
    assert msg.startswith("ValueError: rotary_embedding: cos_sin_cache has no rows"), msg
    assert (kwargs["query"] == 1).all()
    # no token, no row needed
    q_out, _ = ROPE(torch.arange(0), torch.ones(0, 16), torch.ones(0, 8), 8,
                    torch.zeros(0, 8), False)
    assert q_out.shape == (0, 16)


def _paged_kwargs(**over):
    kw = dict(q_fp8=torch.zeros(2, 1, 3, 16, dtype=torch.uint8),
              kv_cache=torch.zeros(5, 4, 1, 20, dtype=torch.uint8), weights=torch.rand(2, 3),
              seq_lens=torch.tensor([7, 3], dtype=torch.int32),
              block_tables=torch.zeros(2, 3, dtype=torch.int32), schedule_metadata=None,
              max_seq_len=12, clean_logits=False)
    kw.update(over)
    return kw


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("over,pattern", [
    (dict(seq_lens=torch.tensor([7, 3])), "seq_lens has dtype torch.int64"),
    (dict(seq_lens=torch.tensor([7], dtype=torch.int32)), "seq_lens has the wrong size"),
    (dict(seq_lens=torch.zeros(2, 1, 1, dtype=torch.int32)), "seq_lens has the wrong number"),
    (dict(block_tables=torch.zeros(2, 3)), "block_tables has dtype torch.float32"),
    (dict(block_tables=torch.zeros(1, 3, dtype=torch.int32)), "block_tables has the wrong size"),
    (dict(max_seq_len=-1), "max_seq_len is negative"),
    (dict(q_fp8=torch.zeros(2, 16, dtype=torch.uint8)), "q_fp8 has the wrong number"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_paged_messages_name_the_raw_ops_arguments(over, pattern, fake):
    msg = error_message(lambda **kw: PAGED(**kw), _paged_kwargs(**over), fake)
    assert msg.startswith("ValueError: fp8_paged_mqa_logits: " + pattern), msg


def _layout(draw, x: torch.Tensor) -> torch.Tensor:
    """``x``'s values, contiguous or as a column slice of a NaN-padded buffer."""
    if not draw(st.booleans()):
        return x
    wide = torch.full((x.shape[0], x.shape[1] + 3), float("nan"), dtype=x.dtype)
    wide[:, 1:1 + x.shape[1]] = x
    return wide[:, 1:1 + x.shape[1]]


@settings(max_examples=_EXAMPLES or 20, deadline=None, derandomize=not _EXAMPLES, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), tokens=st.integers(1, 4), heads=st.integers(1, 3),
       head_size=st.sampled_from([4, 8]), is_neox=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_fuzz_rotary_2d_matches_oracle(data, tokens, heads, head_size, is_neox, dtype):
    rot = data.draw(st.sampled_from([r for r in (2, 4, 8) if r <= head_size]))
    rows = data.draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    positions = torch.tensor(data.draw(st.lists(st.integers(-2**40, 2**40) | st.integers(
        -2, rows + 2), min_size=tokens, max_size=tokens)), dtype=torch.int64)
    cache = torch.randn(rows, rot, generator=gen).to(dtype)
    q = _layout(data.draw, torch.randn(tokens, heads * head_size, generator=gen).to(dtype))
    k = _layout(data.draw, torch.randn(tokens, head_size, generator=gen).to(dtype))
    want_q, want_k = (oracle_rope(x, positions, cache, head_size, is_neox) for x in (q, k))
    q_out, k_out = ROPE(positions, q, k, head_size, cache, is_neox)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in ((q, want_q), (k, want_k), (q_out, want_q), (k_out, want_k)):
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    for x in (q, k):                                   # guard columns of a sliced input
        if x._base is not None:
            assert x._base[:, 0].isnan().all() and x._base[:, -2:].isnan().all()
