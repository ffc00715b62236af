"""Legal but loose bounds and inconsistent values with checks off: every provider and path clamps
them the same way (API.md "Writes") and gives the result of the clamped input.

- A loose ``max_seqlen_q`` (``2**31 - 1`` is legal: an upper bound) equals the tight bound's
  result, and nothing scales with it (the reference's padded blocks, Triton's grid).
- The reference's one-pass paths (``num_splits=1``, MLA prefill's ``num_kv_splits=1``) clamp
  ``cu_seqlens_q`` and ``max_seqlen_q`` as the batched path and Triton do.
- A negative ``cache_leftpad`` reads as 0 (no key before position 0, never another page).
- An ``INT32_MIN`` (or ``INT32_MAX``) in ``cu_seqlens_k`` is clamped, not wrapped.
"""

from __future__ import annotations

import math

import pytest

from .triton_mode import provider_params, rerun_in_subprocess, running  # first

import torch  # noqa: E402

import xpu_ops  # noqa: E402

I32 = torch.int32
INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
PROVIDERS = provider_params()
test_rerun_in_subprocess = rerun_in_subprocess(__file__)


def _paged(seed=0, q_lens=(2, 1), k_lens=(5, 3), hq=4, hkv=2, d=8, page_size=2, **kw):
    gen = torch.Generator().manual_seed(seed)
    b, pages = len(q_lens), 4
    call = dict(q=torch.randn(sum(q_lens), hq, d, generator=gen),
                k_cache=torch.randn(b * pages + 1, page_size, hkv, d, generator=gen),
                v_cache=torch.randn(b * pages + 1, page_size, hkv, d, generator=gen),
                cache_seqlens=torch.tensor(k_lens, dtype=I32),
                page_table=(torch.randperm(b * pages, generator=gen) + 1).view(b, pages).to(I32),
                cu_seqlens_q=torch.tensor([0, *q_lens], dtype=I32).cumsum(0, dtype=I32),
                causal=True, return_softmax_lse=True)
    call.update(kw)
    return call


def _run(fn, call, provider):
    with running(provider):
        return fn(**call)


def _same(a, b):
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


# ---- loose max_seqlen_q ------------------------------------------------------------------------

@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_loose_max_seqlen_q_gives_the_tight_result_paged(provider, num_splits):
    call = _paged(num_splits=num_splits)
    tight = _run(xpu_ops.flash_attn_with_kvcache, dict(call, max_seqlen_q=2), provider)
    loose = _run(xpu_ops.flash_attn_with_kvcache, dict(call, max_seqlen_q=INT32_MAX), provider)
    _same(loose, tight)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_loose_bounds_give_the_tight_result_varlen(provider):
    gen = torch.Generator().manual_seed(1)
    call = dict(q=torch.randn(3, 2, 8, generator=gen), k=torch.randn(7, 1, 8, generator=gen),
                v=torch.randn(7, 1, 8, generator=gen),
                cu_seqlens_q=torch.tensor([0, 1, 3], dtype=I32),
                cu_seqlens_k=torch.tensor([0, 4, 7], dtype=I32), causal=True,
                return_softmax_lse=True)
    tight = _run(xpu_ops.flash_attn_varlen_func, dict(call, max_seqlen_q=2, max_seqlen_k=4),
                 provider)
    loose = _run(xpu_ops.flash_attn_varlen_func,
                 dict(call, max_seqlen_q=INT32_MAX, max_seqlen_k=INT32_MAX), provider)
    _same(loose, tight)


def _mla_prefill(max_seqlen_q, num_kv_splits, cu=(0, 2, 3)):
    gen = torch.Generator().manual_seed(2)
    return dict(q_nope=torch.randn(3, 2, 8, generator=gen), q_pe=torch.randn(3, 2, 4, generator=gen),
                kv_c_and_k_pe_cache=torch.randn(5, 2, 12, generator=gen),
                cu_seqlens_q=torch.tensor(cu, dtype=I32),
                seq_lens_k=torch.tensor([4, 3], dtype=I32), max_seqlen_q=max_seqlen_q,
                page_table=torch.tensor([[3, 1], [0, 4]], dtype=I32),
                workspace=torch.empty(0, dtype=torch.uint8), sm_scale=0.3,
                num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("num_kv_splits", [-1, 1])
def test_loose_max_seqlen_q_gives_the_tight_result_mla_prefill(provider, num_kv_splits):
    tight = _run(xpu_ops.flash_mla_prefill, _mla_prefill(2, num_kv_splits), provider)
    loose = _run(xpu_ops.flash_mla_prefill, _mla_prefill(INT32_MAX, num_kv_splits), provider)
    _same(loose, tight)


# ---- one-pass paths clamp cu_seqlens_q and max_seqlen_q as the batched path -------------------

@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("cu, max_seqlen_q", [
    ([0, 2, 9], 3),                 # past total_q: request 1 keeps row 2 only
    ([-4, 2, 3], 3),                # before 0: request 0 starts at row 0
    ([0, INT32_MAX, 3], INT32_MAX), # int32 extremes and a loose bound
    ([0, 3, 3], 1),                 # an understated bound: at most 1 row of request 0
], ids=["past-end", "negative", "int32-max", "understated"])
def test_one_pass_paths_clamp_like_the_batched_path(provider, cu, max_seqlen_q):
    call = _paged(cu_seqlens_q=torch.tensor(cu, dtype=I32), max_seqlen_q=max_seqlen_q,
                  out=torch.full((3, 4, 8), math.nan))
    batched = _run(xpu_ops.flash_attn_with_kvcache, dict(call, num_splits=0, out=call["out"].clone()),
                   provider)
    reference = _run(xpu_ops.flash_attn_with_kvcache,
                     dict(call, num_splits=0, out=call["out"].clone()), "reference")
    one_pass = _run(xpu_ops.flash_attn_with_kvcache, dict(call, num_splits=1), provider)
    described = ~reference[0].isnan().all(-1).all(-1)   # rows no request describes keep NaN
    for got in (batched, one_pass):
        torch.testing.assert_close(got[0], reference[0], rtol=1e-6, atol=1e-6, equal_nan=True)
        torch.testing.assert_close(got[1][:, described], reference[1][:, described],
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("cu", [(0, 2, 9), (-4, 2, 3), (0, INT32_MAX, 3)],
                         ids=["past-end", "negative", "int32-max"])
def test_mla_prefill_one_pass_clamps_like_the_batched_path(provider, cu):
    want = _run(xpu_ops.flash_mla_prefill, _mla_prefill(3, -1, cu), "reference")
    for splits in (-1, 1):
        got = _run(xpu_ops.flash_mla_prefill, _mla_prefill(INT32_MAX, splits, cu), provider)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ---- negative cache_leftpad ----------------------------------------------------------------------

@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("num_splits", [0, 1, 2])
def test_negative_cache_leftpad_reads_as_zero(provider, num_splits):
    call = _paged(num_splits=num_splits)
    want = _run(xpu_ops.flash_attn_with_kvcache,
                dict(call, cache_leftpad=torch.tensor([0, 1], dtype=I32)), provider)
    for pad in (-3, -7, INT32_MIN):
        got = _run(xpu_ops.flash_attn_with_kvcache,
                   dict(call, cache_leftpad=torch.tensor([pad, 1], dtype=I32)), provider)
        _same(got, want)


def test_negative_cache_leftpad_raises_under_debug_checks():
    call = _paged(cache_leftpad=torch.tensor([0, -1], dtype=I32))
    with xpu_ops.debug_checks(), pytest.raises(
            ValueError, match=r"flash_attn_with_kvcache: cache_leftpad is out of range; .* got "
                              r"cache_leftpad\[1\] = -1"):
        xpu_ops.flash_attn_with_kvcache(**call)


# ---- INT32 extremes in cu_seqlens_k ----------------------------------------------------------

@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("cu_k, dense_cu_k", [
    ([INT32_MIN, 4, 7], [0, 4, 7]),
    ([0, 4, INT32_MAX], [0, 4, 7]),
    ([0, INT32_MIN, 7], [0, 0, 7]),
], ids=["min-first", "max-last", "min-middle"])
def test_int32_extremes_in_cu_seqlens_k_are_clamped(provider, cu_k, dense_cu_k):
    gen = torch.Generator().manual_seed(5)
    call = dict(q=torch.randn(3, 2, 8, generator=gen), k=torch.randn(7, 1, 8, generator=gen),
                v=torch.randn(7, 1, 8, generator=gen),
                cu_seqlens_q=torch.tensor([0, 1, 3], dtype=I32), max_seqlen_k=7,
                return_softmax_lse=True)
    want = _run(xpu_ops.flash_attn_varlen_func,
                dict(call, cu_seqlens_k=torch.tensor(dense_cu_k, dtype=I32)), "reference")
    got = _run(xpu_ops.flash_attn_varlen_func, dict(call, cu_seqlens_k=torch.tensor(cu_k, dtype=I32)),
               provider)
    _same(got, want)


# ---- rows two requests describe (decreasing prefix sums): the reference's paths agree ------

@pytest.mark.parametrize("num_splits", [0, 1])
def test_reference_paths_agree_on_a_row_two_requests_describe(num_splits):
    """``cu_seqlens_q = [0, 3, 1, 3]``: request 2 describes rows 1-2 of request 0. Every
    reference path gives such a row the earlier request's result (API.md leaves the provider's
    choice unspecified; the reference's is fixed so that its paths agree)."""
    call = _paged(q_lens=(3, 0, 0), k_lens=(5, 3, 4), out=torch.full((3, 4, 8), math.nan),
                  cu_seqlens_q=torch.tensor([0, 3, 1, 3], dtype=I32), max_seqlen_q=3)
    first_only = _run(xpu_ops.flash_attn_with_kvcache,
                      dict(call, cu_seqlens_q=torch.tensor([0, 3, 3, 3], dtype=I32),
                           out=call["out"].clone()), "reference")
    got = _run(xpu_ops.flash_attn_with_kvcache, dict(call, num_splits=num_splits), "reference")
    _same(got, first_only)
    mla = _mla_prefill(3, -1, (0, 3, 1, 3))
    mla["seq_lens_k"] = torch.tensor([4, 3, 2], dtype=I32)
    mla["page_table"] = torch.tensor([[3, 1], [0, 4], [2, 0]], dtype=I32)
    mla_first = _run(xpu_ops.flash_mla_prefill,
                     dict(mla, cu_seqlens_q=torch.tensor([0, 3, 3, 3], dtype=I32)), "reference")
    for splits in (-1, 1):
        torch.testing.assert_close(_run(xpu_ops.flash_mla_prefill,
                                        dict(mla, num_kv_splits=splits), "reference"),
                                   mla_first, rtol=1e-6, atol=1e-6)
