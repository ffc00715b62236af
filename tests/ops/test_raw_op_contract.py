"""The raw ``torch.ops.xpu_ops`` ops keep their wrappers' contract (API.md "Bad input",
"Writes"): a non-finite MLA scale is refused, ``causal`` forces the right window bound to 0,
``flash_mla_prefill``'s ``causal`` is a flag, a zero-token call with block ids works, and rows
of ``flash_mla_prefill``'s output that no request describes are 0 on every provider."""

from __future__ import annotations

import math

import pytest

from .triton_mode import provider_params, rerun_in_subprocess, running  # first

import torch  # noqa: E402

import xpu_ops  # noqa: E402

from .utils import error_message  # noqa: E402

I32 = torch.int32
PROVIDERS = provider_params()
test_rerun_in_subprocess = rerun_in_subprocess(__file__)


def _mla_decode_args(scale):
    ws = torch.empty(xpu_ops.flash_mla_get_workspace_size(4, 1, 2), dtype=torch.uint8)
    return dict(q_nope=torch.randn(1, 2, 8), q_rope=torch.randn(1, 2, 4),
                kv_cache=torch.randn(1, 4, 12), cache_seqlens=torch.tensor([3], dtype=I32),
                page_table=torch.tensor([[0]], dtype=I32), workspace=ws, softmax_scale=scale,
                num_kv_splits=-1)


def _mla_prefill_args(cu=(0, 2), total_q=2, sm_scale=0.3, causal=True, max_seqlen_q=2,
                      num_kv_splits=-1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(q_nope=torch.randn(total_q, 2, 8, generator=gen),
                q_pe=torch.randn(total_q, 2, 4, generator=gen),
                kv_c_and_k_pe_cache=torch.randn(3, 4, 12, generator=gen),
                cu_seqlens_q=torch.tensor(cu, dtype=I32),
                seq_lens_k=torch.tensor([5] * (len(cu) - 1), dtype=I32),
                page_table=torch.tensor([[2, 0]] * (len(cu) - 1), dtype=I32),
                workspace=torch.empty(0, dtype=torch.uint8), max_seqlen_q=max_seqlen_q,
                sm_scale=sm_scale, causal=causal, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("op, make, arg", [
    (torch.ops.xpu_ops.flash_mla_decode, _mla_decode_args, "softmax_scale"),
    (torch.ops.xpu_ops.flash_mla_prefill, lambda s: _mla_prefill_args(sm_scale=s), "sm_scale"),
], ids=["mla_decode", "mla_prefill"])
def test_raw_mla_ops_refuse_a_non_finite_scale(op, make, arg, scale, fake):
    message = error_message(op, make(scale), fake)
    fn = "flash_mla_decode" if "decode" in str(op) else "flash_mla_prefill"
    assert message.startswith(f"ValueError: {fn}: {arg} is not finite; expected a finite float"), \
        message


@pytest.mark.parametrize("causal", ["False", None, 2], ids=["str", "None", "two"])
def test_mla_prefill_causal_is_a_flag(causal):
    with pytest.raises(TypeError, match=r"^flash_mla_prefill: causal is not a bool; expected "
                                        r"True or False"):
        xpu_ops.flash_mla_prefill(**{k: v for k, v in _mla_prefill_args(causal=causal).items()
                                     if k != "num_kv_splits"})


def _paged_op_args(gen, causal, right):
    q = torch.randn(3, 2, 8, generator=gen)
    k_cache, v_cache = torch.randn(3, 4, 1, 8, generator=gen), torch.randn(3, 4, 1, 8, generator=gen)
    return (q, k_cache, v_cache, torch.tensor([6], dtype=I32), torch.tensor([[2, 0]], dtype=I32),
            torch.tensor([0, 3], dtype=I32), torch.full((3, 2, 8), math.nan), None, None, None,
            None, None, None, None, 3, 0.35, causal, -1, right, 0.0, 0, True)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_raw_causal_forces_the_right_bound_to_zero(provider):
    """``causal=True`` with ``window_size_right=-1`` (or 2) on the raw ops: causal attention."""
    results = []
    with running(provider):
        for right in (0, -1, 2):
            args = _paged_op_args(torch.Generator().manual_seed(0), True, right)
            lse = torch.ops.xpu_ops.flash_attn_with_kvcache(*args)
            results.append((args[6], lse))
        for out, lse in results[1:]:
            torch.testing.assert_close(out, results[0][0], rtol=0, atol=0)
            torch.testing.assert_close(lse, results[0][1], rtol=0, atol=0)
        gen = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(3, 2, 8, generator=gen) for _ in range(3))
        cu = torch.tensor([0, 3], dtype=I32)
        varlen = []
        for right in (0, -1):
            out = torch.full((3, 2, 8), math.nan)
            torch.ops.xpu_ops.flash_attn_varlen_func(q, k, v, cu, cu, out, None, None, None,
                                                     None, None, None, None, 3, 3, 0.35, True,
                                                     -1, right, 0.0, 1)
            varlen.append(out)
    torch.testing.assert_close(varlen[1], varlen[0], rtol=0, atol=0)
    assert not torch.equal(results[0][0][0], torch.zeros_like(results[0][0][0]))


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("num_splits", [0, 1])
def test_zero_token_call_with_block_ids(provider, num_splits):
    gen = torch.Generator().manual_seed(2)
    with running(provider):
        out, lse = xpu_ops.flash_attn_with_kvcache(
            torch.randn(0, 2, 8), torch.randn(2, 4, 1, 8, generator=gen),
            torch.randn(2, 4, 1, 8, generator=gen), cache_seqlens=torch.tensor([3], dtype=I32),
            page_table=torch.tensor([[1]], dtype=I32), cu_seqlens_q=torch.tensor([0, 0], dtype=I32),
            bidirectional_block_ids=torch.zeros(0, dtype=I32), num_splits=num_splits,
            return_softmax_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("num_kv_splits", [-1, 1])
def test_mla_prefill_rows_no_request_describes_are_zero(provider, num_kv_splits):
    """``cu_seqlens_q = [0, 1, 2]`` over 4 packed rows: rows 2 and 3 belong to no request."""
    call = _mla_prefill_args(cu=(0, 1, 2), total_q=4, num_kv_splits=num_kv_splits)
    with running(provider):
        out = xpu_ops.flash_mla_prefill(**call)
    assert out[2:].eq(0).all() and not out[:2].isnan().any() and out[:2].ne(0).any()


# ---- messages and kinds of a few arguments ---------------------------------------------------

def _append_call(**overrides):
    gen = torch.Generator().manual_seed(3)
    call = dict(q=torch.randn(2, 2, 8, generator=gen), k_cache=torch.randn(2, 4, 1, 8, generator=gen),
                v_cache=torch.randn(2, 4, 1, 8, generator=gen), k=torch.randn(2, 1, 8, generator=gen),
                v=torch.randn(2, 1, 8, generator=gen), cache_seqlens=torch.tensor([1], dtype=I32),
                page_table=torch.tensor([[1, 0]], dtype=I32),
                cu_seqlens_q=torch.tensor([0, 2], dtype=I32),
                cu_seqlens_k_new=torch.tensor([0, 2], dtype=I32), causal=True)
    call.update(overrides)
    return call


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
def test_a_float64_rotary_table_names_the_wrappers_argument(fake):
    cos = torch.ones(8, 2, dtype=torch.float64)
    message = error_message(xpu_ops.flash_attn_with_kvcache,
                            _append_call(rotary_cos=cos, rotary_sin=cos.clone()), fake)
    assert message.startswith("ValueError: flash_attn_with_kvcache: rotary_cos has dtype "
                              "torch.float64; expected torch.float16 or torch.bfloat16 or "
                              "torch.float32"), message


def test_float32_keys_into_an_fp8_cache_are_not_told_to_use_the_cache_dtype():
    e4m3 = torch.float8_e4m3fn
    call = _append_call(k_cache=torch.zeros(2, 4, 1, 8, dtype=e4m3),
                        v_cache=torch.zeros(2, 4, 1, 8, dtype=e4m3),
                        k_descale=torch.ones(1, 1), v_descale=torch.ones(1, 1))
    with pytest.raises(NotImplementedError, match=r"^flash_attn_with_kvcache: appending k/v "
                       r"into an fp8 cache is not implemented; .* got torch.float8_e4m3fn\. "
                       r"Quantize with store_kv_cache"):
        xpu_ops.flash_attn_with_kvcache(**call)


@pytest.mark.parametrize("call, kwargs, arg", [
    (xpu_ops.flash_attn_with_kvcache, dict(num_splits=True), "num_splits"),
    (xpu_ops.flash_attn_with_kvcache, dict(softcap=True), "softcap"),
    (xpu_ops.flash_attn_varlen_func, dict(num_splits=True), "num_splits"),
    (xpu_ops.store_kv_cache, dict(k_scale=True), "k_scale"),
], ids=["num_splits", "softcap", "varlen-num_splits", "k_scale"])
def test_a_bool_is_not_a_number(call, kwargs, arg):
    e4m3 = torch.float8_e4m3fn
    base = {
        xpu_ops.flash_attn_with_kvcache: lambda: {k: v for k, v in _append_call().items()
                                                  if k not in ("k", "v", "cu_seqlens_k_new")},
        xpu_ops.flash_attn_varlen_func: lambda: dict(
            q=torch.randn(2, 1, 8), k=torch.randn(2, 1, 8), v=torch.randn(2, 1, 8),
            cu_seqlens_q=torch.tensor([0, 2], dtype=I32),
            cu_seqlens_k=torch.tensor([0, 2], dtype=I32)),
        xpu_ops.store_kv_cache: lambda: dict(
            k_cache=torch.zeros(4, 1, 8, dtype=e4m3), v_cache=torch.zeros(4, 1, 8, dtype=e4m3),
            loc=torch.tensor([1]), k=torch.ones(1, 1, 8), v=torch.ones(1, 1, 8)),
    }[call]()
    with pytest.raises(TypeError, match=rf"^\w+: {arg} is not (an integer|a real number); "
                                        rf".*True"):
        call(**base, **kwargs)
