"""The shim's ``sgl_kernel.causal_conv1d_fn_xpu`` / ``causal_conv1d_update_xpu`` (sgl-kernel-xpu's
channel-first layouts, output written into ``x``, pad slots skipped) against a float64 oracle of
the depthwise causal convolution written here from the math (Mamba, arXiv 2312.00752): a
request's input ``e`` is its state (``width - 1`` columns, zeros without one) followed by its
tokens, ``out[:, t] = act(bias + sum_w weight[:, w] e[:, t + w])`` and its new state is the last
``width - 1`` columns of ``e``."""

from __future__ import annotations

import pytest
import torch

from .test_compat_shim import shim  # noqa: F401  (the fixture: the shim, or a skip)

DIM, WIDTH, SLOTS = 6, 4, 5


def _oracle(x_cols, weight, bias, state, silu):
    """float64 ``(out [dim, n], new_state [dim, width - 1])`` of one request."""
    d = torch.float64
    e = torch.cat([state.to(d), x_cols.to(d)], 1)
    n = x_cols.shape[1]
    out = torch.stack([(e[:, t:t + WIDTH] * weight.to(d)).sum(1) for t in range(n)], 1)
    out = out + (0 if bias is None else bias.to(d)[:, None])
    return (torch.nn.functional.silu(out) if silu else out), e[:, -(WIDTH - 1):]


def _inputs(seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(DIM, WIDTH, generator=gen).to(dtype),
            torch.randn(DIM, generator=gen).to(dtype),
            torch.randn(SLOTS, DIM, WIDTH - 1, generator=gen).to(dtype), gen)


def test_varlen_matches_float64_oracle_and_skips_pad_slots(shim):
    """``[dim, total]`` view of a wider buffer, three requests: one from its state, one from
    zeros, one padded (its tokens and slot untouched); a column past the last request stays."""
    from sgl_kernel import causal_conv1d_fn_xpu
    weight, bias, pool, gen = _inputs(1)
    lens, slots, initial = [3, 5, 2], [4, 1, -1], [True, False, True]
    total = sum(lens) + 1
    buf = torch.randn(1, DIM + 3, total, generator=gen)
    x = buf[0, 2:2 + DIM]                                  # [dim, total], a strided view
    x_in, pool_in, buf_in = x.clone(), pool.clone(), buf.clone()
    qsl = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    got = causal_conv1d_fn_xpu(x, weight, bias, pool, qsl, torch.tensor(slots, dtype=torch.int32),
                               torch.tensor(initial), "silu", -1)
    assert got is x
    start = 0
    for n, slot, init in zip(lens, slots, initial):
        cols = slice(start, start + n)
        if slot == -1:
            assert torch.equal(x[:, cols], x_in[:, cols])
        else:
            state = pool_in[slot] if init else torch.zeros(DIM, WIDTH - 1)
            out, new = _oracle(x_in[:, cols], weight, bias, state, True)
            torch.testing.assert_close(x[:, cols].double(), out, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(pool[slot].double(), new, atol=0, rtol=0)
        start += n
    assert torch.equal(x[:, -1], x_in[:, -1])                   # no request owns it
    for slot in (0, 2, 3):
        assert torch.equal(pool[slot], pool_in[slot])
    assert torch.equal(buf[0, :2], buf_in[0, :2]) and torch.equal(buf[0, 2 + DIM:],
                                                                  buf_in[0, 2 + DIM:])


@pytest.mark.parametrize("with_states", [True, False], ids=["states", "no-states"])
def test_batched_matches_float64_oracle(shim, with_states):
    """``[batch, dim, seqlen]``: request r uses slot r; without ``conv_states`` nothing is read
    or written beyond ``x`` (bf16, no activation, no bias)."""
    from sgl_kernel import causal_conv1d_fn_xpu
    weight, _, pool, gen = _inputs(2, torch.bfloat16)
    x = torch.randn(2, DIM, 5, generator=gen).to(torch.bfloat16)
    x_in, pool_in = x.clone(), pool.clone()
    states = pool[:2] if with_states else None
    initial = torch.tensor([True, False]) if with_states else None
    causal_conv1d_fn_xpu(x, weight, None, states, None, None, initial, None)
    for r in range(2):
        start = pool_in[r] if with_states and r == 0 else torch.zeros(DIM, WIDTH - 1)
        out, new = _oracle(x_in[r], weight, None, start, False)
        torch.testing.assert_close(x[r].double(), out, atol=3e-2, rtol=1e-2)
        if with_states:
            torch.testing.assert_close(pool[r].double(), new, atol=0, rtol=0)
    assert torch.equal(pool[2:], pool_in[2:]) and (with_states or torch.equal(pool, pool_in))


def test_update_with_indices_and_padding(shim):
    """``causal_conv1d_update_xpu`` on ``[batch, dim]`` tokens (one each): requests read and
    write their slots; a pad slot (here 7, a custom ``pad_slot_id``) leaves its row and every
    other slot as they were."""
    from sgl_kernel import causal_conv1d_update_xpu
    weight, bias, pool, gen = _inputs(3)
    x = torch.randn(3, DIM, generator=gen)
    x_in, pool_in = x.clone(), pool.clone()
    slots = torch.tensor([3, 7, 0], dtype=torch.int32)
    got = causal_conv1d_update_xpu(x, pool, weight, bias, "swish", None, slots, 7)
    assert got is x and got.shape == (3, DIM)
    for r, slot in ((0, 3), (2, 0)):
        out, new = _oracle(x_in[r][:, None], weight, bias, pool_in[slot], True)
        torch.testing.assert_close(x[r].double(), out[:, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool[slot].double(), new, atol=0, rtol=0)
    assert torch.equal(x[1], x_in[1])
    for slot in (1, 2, 4):
        assert torch.equal(pool[slot], pool_in[slot])


@pytest.mark.parametrize("call,match", [
    ("update_seqlens", "causal_conv1d_update_xpu: cache_seqlens is given"),
    ("update_activation", "causal_conv1d_update_xpu: activation is not supported"),
    ("fn_qsl_dtype", "causal_conv1d_fn_xpu: query_start_loc has dtype torch.int64"),
    ("fn_indices_length", "causal_conv1d_fn_xpu: cache_indices has the wrong length"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else "")
def test_rejects_before_any_write(shim, call, match):
    from sgl_kernel import causal_conv1d_fn_xpu, causal_conv1d_update_xpu
    weight, bias, pool, gen = _inputs(4)
    x2, x3 = torch.randn(2, DIM, generator=gen), torch.randn(DIM, 4, generator=gen)
    before = x2.clone(), x3.clone(), pool.clone()
    calls = {
        "update_seqlens": lambda: causal_conv1d_update_xpu(
            x2, pool, weight, bias, "silu", torch.zeros(2, dtype=torch.int32)),
        "update_activation": lambda: causal_conv1d_update_xpu(x2, pool, weight, bias, "relu"),
        "fn_qsl_dtype": lambda: causal_conv1d_fn_xpu(x3, weight, bias, pool, torch.tensor([0, 4])),
        "fn_indices_length": lambda: causal_conv1d_fn_xpu(
            x3, weight, bias, pool, torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32)),
    }
    with pytest.raises(ValueError, match=match):
        calls[call]()
    for now, then in zip((x2, x3, pool), before):
        assert torch.equal(now, then)
