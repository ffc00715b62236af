"""Results never depend on layout (API.md "Layouts"), on every provider.

``sample_inputs(op, device, layout="strided")`` gives every sample with every tensor argument
as a view with other strides (expanded scales and sinks, column-sliced page tables, strided
index vectors, padded rows) over garbage. Each provider must give on it what it gives on a
contiguous copy, write nothing outside the views it was given, and (for the attention op)
match the float64 oracle; opcheck runs on the strided samples too.
"""

from __future__ import annotations

import copy

import pytest

from .triton_mode import provider_params, rerun_in_subprocess, running  # first

import torch  # noqa: E402

import xpu_ops  # noqa: E402
from xpu_ops.testing import REGISTERED_OPS, op_name, sample_inputs  # noqa: E402
from xpu_ops.testing_layouts import outside_view_unchanged  # noqa: E402

from . import oracle  # noqa: E402
from .utils import (OPCHECK_UTILS, assert_matches_oracle, bitwise_equal, has_fp8,  # noqa: E402
                    mutated_arg_names, arg_names, implemented, skip_if_unimplemented)

PROVIDERS = provider_params()
I32 = torch.int32
test_rerun_in_subprocess = rerun_in_subprocess(__file__)
# Tolerance between a provider's result on a strided sample and on its contiguous copy: the
# same kernel on the same values (the reference may reduce in another order after a copy).
_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# The interpreter is slow: on Triton the attention ops run the samples whose features read the
# small tensors whose strides matter (page sizes 4 and 1 with empty requests, sinks, fp8
# descales of q and KV, qv, everything at once; varlen's seqused_k is in samples 1 and 10).
_TRITON_ATTENTION_SAMPLES = (1, 2, 10, 11, 13, 14, 15)
_ATTENTION_OPS = ("flash_attn_with_kvcache", "flash_attn_varlen_func")


def _pairs(op, provider="reference"):
    """``(strided args, contiguous copy of them, kwargs)`` of the samples of ``op`` (a subset
    for the attention ops on Triton)."""
    subset = provider == "triton" and op_name(op) in _ATTENTION_OPS
    for index, (args, kwargs) in enumerate(sample_inputs(op, "cpu", layout="strided")):
        if subset and index not in _TRITON_ATTENTION_SAMPLES:
            continue
        dense = tuple(t.contiguous().clone() if isinstance(t, torch.Tensor) else t for t in args)
        yield args, dense, kwargs


def _close(got, want, where):
    if isinstance(got, (tuple, list)):
        for i, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{where}[{i}]")
        return
    if not isinstance(got, torch.Tensor) or got.numel() == 0:
        return
    if got.dtype.itemsize == 1 or not got.is_floating_point():
        assert bitwise_equal(got.contiguous(), want.contiguous()), where
        return
    tol = _TOL.get(got.dtype, 1e-5)
    both_nan = got.isnan() & want.isnan()
    same_inf = torch.isinf(got) & (got == want)
    err = torch.where(both_nan | same_inf, 0.0, (got.float() - want.float()).abs())
    assert not err.isnan().any() and err.max() <= tol * max(want.abs().nan_to_num(0).max(), 1), \
        f"{where}: layout changed the result by {err.nan_to_num(99).max():.3g}"


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("op", REGISTERED_OPS, ids=op_name)
def test_results_do_not_depend_on_layout(provider, op):
    skip_if_unimplemented(provider, op)
    names, mutated = arg_names(op), mutated_arg_names(op)
    count = 0
    for args, dense, kwargs in _pairs(op, provider):
        bases = {i: t._base.clone() for i, t in enumerate(args)
                 if isinstance(t, torch.Tensor) and names[i] in mutated and t._base is not None}
        with running(provider):
            got = op(*args, **kwargs)
            want = op(*dense, **kwargs)
        _close(got, want, f"{op_name(op)} sample {count} result")
        for i, name in enumerate(names):
            if name in mutated and name != "workspace":
                _close(args[i], dense[i], f"{op_name(op)} sample {count} {name}")
        for i, base in bases.items():
            assert outside_view_unchanged(args[i], base), \
                f"{op_name(op)} sample {count}: {provider} wrote outside {names[i]}"
        count += 1
    assert count >= 4


@pytest.mark.gpu
@pytest.mark.parametrize("op", [op for op in REGISTERED_OPS if implemented("triton", op)],
                         ids=op_name)
def test_results_do_not_depend_on_layout_on_gpu(op):
    """Compiled Triton kernels on the GPU: every strided sample equals its contiguous copy and
    nothing outside the views changes (the interpreter on the CPU runs the same checks). The
    ops with no Triton implementation (reference-only, API.md) have no kernel to check."""
    names, mutated = arg_names(op), mutated_arg_names(op)
    for index, (args, kwargs) in enumerate(sample_inputs(op, "cuda", layout="strided")):
        dense = tuple(t.contiguous().clone() if isinstance(t, torch.Tensor) else t for t in args)
        bases = {i: t._base.clone() for i, t in enumerate(args)
                 if isinstance(t, torch.Tensor) and names[i] in mutated and t._base is not None}
        with xpu_ops.use_provider("triton"):
            got, want = op(*args, **kwargs), op(*dense, **kwargs)
        _close(got, want, f"{op_name(op)} sample {index} result")
        for i, base in bases.items():
            assert outside_view_unchanged(args[i], base), (op_name(op), index, names[i])


@pytest.mark.parametrize("provider", PROVIDERS)
def test_strided_attention_samples_match_the_oracle(provider):
    op = torch.ops.xpu_ops.flash_attn_with_kvcache
    for args, dense, kwargs in _pairs(op, provider):
        with running(provider):
            lse = op(*args, **kwargs)
        out64, lse64 = oracle.flash_attn_with_kvcache(*dense, **kwargs)
        assert_matches_oracle(args[6], out64, args[6].dtype, lse, lse64)


def test_strided_samples_are_views_of_garbage():
    """The variant really is strided: no tensor argument but the scratch is contiguous, the
    scales and sinks are expanded, and the padding around views is garbage (NaN / 2**30 - 1)."""
    for op in REGISTERED_OPS:
        names = arg_names(op)
        for args, dense, _ in _pairs(op):
            for name, t, d in zip(names, args, dense):
                if not isinstance(t, torch.Tensor) or t.numel() <= 1 or name == "workspace":
                    continue
                assert t._base is not None and (not t.is_contiguous() or t.dim() > 1
                                                and t.shape[:-1].numel() == 1), name
                assert bitwise_equal(t.contiguous(), d)
                if name in ("k_descale", "v_descale", "q_descale", "sinks"):
                    assert all(st == 0 for st, n in zip(t.stride(), t.shape) if n > 1), name


@pytest.mark.parametrize("op", REGISTERED_OPS, ids=op_name)
def test_opcheck_on_strided_samples(op):
    for index, (args, _, kwargs) in enumerate(_pairs(op)):
        if index >= 2:  # opcheck traces each sample several times: the first two per op
            break
        utils = tuple(u for u in OPCHECK_UTILS if not (has_fp8(args) and u == "test_schema"))
        torch.library.opcheck(op.default, copy.deepcopy(args), kwargs, test_utils=utils)


# ---- reported layout cases, one by one ------------------------------------------------

@pytest.mark.parametrize("provider", PROVIDERS)
def test_loc_view_writes_the_viewed_slots(provider):
    """``loc = tensor([1, 14, 5, 13, 9, 12])[::2]`` holds slots 1, 5, 9: Triton wrote 1, 5, 14."""
    loc = torch.tensor([1, 14, 5, 13, 9, 12])[::2]
    k_cache, v_cache = torch.zeros(16, 1, 4), torch.zeros(16, 1, 4)
    kv_cache = torch.zeros(16, 1, 6)
    k = torch.arange(1.0, 4.0)[:, None, None].expand(3, 1, 4).contiguous()
    with running(provider):
        xpu_ops.store_kv_cache(k_cache, v_cache, loc, k, k.clone())
        xpu_ops.store_mla_kv_cache(kv_cache, loc, k, k[..., :2].contiguous())
    for cache in (k_cache, v_cache, kv_cache):
        written = cache.flatten(1).abs().sum(1).nonzero().flatten().tolist()
        assert written == [1, 5, 9] and cache[[1, 5, 9], 0, 0].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_expanded_per_tensor_descale_and_sliced_metadata(provider):
    """sglang's FA3 backend passes ``scale.expand(b, Hkv)`` for fp8 caches; with column-sliced
    page tables, strided lengths and prefix sums and expanded sinks the result is the oracle's."""
    gen = torch.Generator().manual_seed(5)
    b, hkv, hq, d, page = 2, 2, 4, 16, 4
    k_cache = torch.randn(6, page, hkv, d, generator=gen).to(torch.float8_e4m3fn)
    v_cache = torch.randn(6, page, hkv, d, generator=gen).to(torch.float8_e4m3fn)
    wide_table = torch.tensor([[4, 0, 1, 9], [2, 7, 3, 8]], dtype=I32)
    page_table = wide_table[:, ::2]                                   # [[4, 1], [2, 3]]
    cache_seqlens = torch.tensor([7, 99, 5, 99], dtype=I32)[::2]      # [7, 5]
    cu_seqlens_q = torch.tensor([0, 9, 2, 9, 3], dtype=I32)[::2]      # [0, 2, 3]
    scale = torch.tensor(0.75)
    sinks = torch.tensor([0.3]).expand(hq)
    q = torch.randn(3, hq, d, generator=gen).to(torch.bfloat16)
    kwargs = dict(k_descale=scale.expand(b, hkv), v_descale=scale.expand(b, hkv), sinks=sinks,
                  causal=True)
    with running(provider):
        out, lse = xpu_ops.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
            cu_seqlens_q=cu_seqlens_q, return_softmax_lse=True, **kwargs)
    dense = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    want, want_lse = oracle.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens.contiguous(), page_table.contiguous(),
        cu_seqlens_q.contiguous(), None, None, None, dense["k_descale"], dense["v_descale"],
        dense["sinks"], max_seqlen_q=3, softmax_scale=d ** -0.5, causal=True,
        window_size_left=-1, window_size_right=0, softcap=0.0)
    assert_matches_oracle(out, want, torch.bfloat16, lse, want_lse)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_strided_varlen_metadata(provider):
    """Strided ``cu_seqlens_q/k`` and ``seqused_k`` (Triton read them as contiguous)."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(n, h, 16, generator=gen) for n, h in ((4, 2), (9, 1), (9, 1)))
    cu_q = torch.tensor([0, 5, 1, 5, 4], dtype=I32)[::2]              # [0, 1, 4]
    cu_k = torch.tensor([0, 7, 5, 7, 9], dtype=I32)[::2]              # [0, 5, 9]
    seqused_k = torch.tensor([3, 0, 4], dtype=I32)[::2]               # [3, 4]
    with running(provider):
        out, lse = xpu_ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, seqused_k=seqused_k,
                                                  causal=True, return_softmax_lse=True)
    want, want_lse = oracle.flash_attn_varlen_func(
        q, k, v, cu_q.contiguous(), cu_k.contiguous(), causal=True, softmax_scale=0.25,
        seqused_k=seqused_k.contiguous())
    assert_matches_oracle(out, want, torch.float32, lse, want_lse)
