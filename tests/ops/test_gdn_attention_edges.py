"""``gdn_attention`` at its edges: sliced, strided and expanded inputs (as sglang passes them:
``mixed_qkv`` and ``a``/``b`` are column slices of the projections) against the float64
oracle on every provider; the ``sgl_kernel`` glue (through the stand-in of sgl-kernel-xpu's
fused op) with an empty state pool, without requests, and with a conv pool in another dtype than the projections
(declined, nothing written); a non-str activation."""

from __future__ import annotations

import pytest

from .triton_mode import (interpret_while_module_runs, provider_params,  # noqa: F401  first
                          running)
import torch

import xpu_ops

from .test_gdn_attention import _check, _kwargs, _sample, expected, native  # noqa: F401
from .utils import clone

OP = torch.ops.xpu_ops.gdn_attention


def _restrided(args) -> list:
    """The same values through other layouts: ``mixed_qkv`` a column slice of a NaN-padded
    buffer, ``b | a`` columns of one buffer, ``A_log``/``dt_bias`` expanded from one element
    (the values are made equal first), ``ssm_states`` every other slot of a NaN pool."""
    args = list(args)
    mixed = args[0]
    wide = torch.full((mixed.shape[0], mixed.shape[1] + 5), float("nan"), dtype=mixed.dtype)
    wide[:, :mixed.shape[1]] = mixed
    args[0] = wide[:, :mixed.shape[1]]
    hv = args[1].shape[1]
    ba = torch.cat([args[2], args[1]], dim=1)
    args[2], args[1] = ba[:, :hv], ba[:, hv:]
    args[5], args[6] = args[5][:1].expand(hv), args[6][:1].expand(hv)
    ssm = args[8]
    pool = torch.full((2 * ssm.shape[0], *ssm.shape[1:]), float("nan"))
    pool[::2] = ssm
    args[8] = pool[::2]
    return args


def _same_values_contiguous(args) -> list:
    return [a.contiguous() if isinstance(a, torch.Tensor) else a for a in clone(args)]


_TRITON = provider_params()[1]
# bf16 decode with a -1 slot (every provider), fp16 extend of 70 tokens (reference only: slow
# through the Triton interpreter)
STRIDED = [pytest.param("reference", 1, id="reference-1"),
           pytest.param("reference", 2, id="reference-2"),
           pytest.param("triton", 1, marks=_TRITON.marks, id="triton-1")]


@pytest.mark.parametrize("provider,index", STRIDED)
def test_strided_inputs_match_oracle(provider, index):
    args = _restrided(_sample(index, 800 + index))
    spare = args[8]._base                            # the NaN slots between the pool's rows
    want = expected(_same_values_contiguous(args))
    with running(provider):
        out = OP(*args)
    _check(out, args, want)
    assert spare[1::2].isnan().all(), "a slot outside the strided pool was written"


def _glue_and_reference(args, ref, native):
    """``OP`` on ``ref`` under the reference and on ``args`` through the native glue (which
    must reach the native op): (glue's output, reference's output)."""
    with xpu_ops.use_provider("reference"):
        want = OP(*ref)
    with xpu_ops.use_provider("sgl_kernel"):
        got = OP(*args)
    assert native, "the native op did not run"
    return got, want


def test_glue_strided_inputs_equal_reference(native):
    args = _restrided(_sample(1, 820))
    ref = _same_values_contiguous(args)
    got, want = _glue_and_reference(args, ref, native)
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(args[8], ref[8], equal_nan=True, atol=1e-4, rtol=1e-4)
    assert args[8]._base[1::2].isnan().all()


def test_glue_with_an_empty_pool_equals_reference(native):
    # every request without a slot and a pool of no slots: zero states, nothing to write
    args = _sample(1, 840)                           # bf16 decode of 3 requests
    args[7], args[8] = args[7][:0], args[8][:0]
    args[10] = torch.full((3,), -1, dtype=torch.int32)
    got, want = _glue_and_reference(args, clone(args), native)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("tokens", [0, 2])
def test_glue_without_requests_returns_zeros_without_the_native_op(native, tokens):
    # b = 0: the native op would index ssm_state[0] of its empty staging rows; tokens outside
    # every request are zeros, as the reference makes them
    args = _sample(1, 850)                           # bf16, K = 32: a call the glue serves
    args[0], args[1], args[2] = args[0][:tokens], args[1][:tokens], args[2][:tokens]
    args[9] = torch.zeros(1, dtype=torch.int32)
    args[10], args[11], args[15] = args[10][:0], args[11][:0], False
    before = clone(args)
    with xpu_ops.use_provider("reference"):
        want = OP(*clone(args))
    with xpu_ops.use_provider("sgl_kernel"):
        got = OP(*args)
    assert native == []
    assert got.shape == want.shape == (tokens, 4, 4) and torch.equal(got, want)
    assert torch.equal(args[7].nan_to_num(7.0), before[7].nan_to_num(7.0))
    assert torch.equal(args[8].nan_to_num(7.0), before[8].nan_to_num(7.0))


def test_glue_requests_without_tokens_keep_or_zero_their_states(native):
    # T = 0 with requests: a fresh request's slot ends at zeros, a continuing one's unchanged,
    # as the reference's conv and rule leave them; the native op (which needs tokens) not run
    args = _sample(1, 870)                           # bf16, K = 32, slots (3, -1, 0)
    args[0], args[1], args[2] = args[0][:0], args[1][:0], args[2][:0]
    args[9] = torch.zeros(4, dtype=torch.int32)
    args[11], args[15] = torch.tensor([False, True, True]), False
    args[7][3], args[8][3] = 1.5, 2.5                # the fresh request's slot holds values
    want = expected(clone(args))
    with xpu_ops.use_provider("sgl_kernel"):
        out = OP(*args)
    assert native == [] and out.shape == (0, 4, 4)
    _check(out, args, want)
    assert (args[7][3] == 0).all() and (args[8][3] == 0).all()


@pytest.mark.parametrize("slots", [(-1, -1, -1), (3, -1, 0)], ids=["no-slot", "mixed"])
def test_glue_declines_a_conv_pool_in_another_dtype(native, slots):
    # a float32 conv pool beside bf16 projections: the native conv would read (and, for a
    # request without a slot, rewrite) the window rounded to bf16
    args = _sample(1, 860)
    args[7] = torch.randn(args[7].shape, generator=torch.Generator().manual_seed(1))
    args[10] = torch.tensor(slots, dtype=torch.int32)
    before = clone(args)
    with xpu_ops.use_provider("sgl_kernel"), pytest.raises(NotImplementedError,
                                                          match="conv_states in torch.float32"):
        OP(*args)
    assert native == []
    assert torch.equal(args[7], before[7])
    assert torch.equal(args[8].nan_to_num(7.0), before[8].nan_to_num(7.0))
    with xpu_ops.use_provider("reference"):          # what runs instead keeps the float32 bits
        want = expected(clone(args))
        out = OP(*args)
    _check(out, args, want)


def test_activation_of_another_type_is_a_named_type_error():
    kw = _kwargs(activation=3)
    before = kw["conv_states"].clone()
    with pytest.raises(TypeError, match=r"^gdn_attention: activation is not a str"):
        xpu_ops.gdn_attention(**kw)
    assert torch.equal(kw["conv_states"], before)
