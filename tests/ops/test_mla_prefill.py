"""``flash_mla_prefill`` and the workspace-size functions of sglang 0.5.23: numerics against the
float64 oracle (ragged queries over a paged latent cache with NaN garbage, causal bottom-right,
empty rows, strided queries), sgl-kernel-xpu's calling convention, and every argument check."""

from __future__ import annotations

import pytest
import torch

import xpu_ops
from xpu_ops.testing import paged_kv_cache, sample_inputs

from . import oracle
from .utils import (assert_matches_oracle, assert_named_error, runnable_providers,
                    sample_indices)

OP = torch.ops.xpu_ops.flash_mla_prefill
PROVIDERS = runnable_providers("flash_mla_prefill")
I32 = torch.int32


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", sample_indices(OP))
def test_matches_oracle(provider, index):
    args, kwargs = list(sample_inputs(OP, "cpu", seed=7000 + index))[index]
    q_nope, q_pe, kv_cache, cu_seqlens_q, seq_lens_k, page_table, workspace = args
    assert kv_cache.isnan().any()                      # garbage past seq_lens_k is present
    with xpu_ops.use_provider(provider):
        out = xpu_ops.flash_mla_prefill(q_nope, q_pe, kv_cache, cu_seqlens_q, seq_lens_k,
                                        kwargs["max_seqlen_q"], page_table, workspace,
                                        kwargs["sm_scale"], causal=kwargs["causal"],
                                        num_kv_splits=kwargs["num_kv_splits"])
    expected = oracle.flash_mla_prefill(q_nope, q_pe, kv_cache, cu_seqlens_q, seq_lens_k,
                                        page_table, sm_scale=kwargs["sm_scale"],
                                        causal=kwargs["causal"])
    assert_matches_oracle(out, expected, q_nope.dtype)


def _request(gen, q_lens, k_lens, *, page_size=4, h=2, latent=16, rope=8):
    (kv,), page_table, seq_lens_k = paged_kv_cache(gen, k_lens, page_size, [(latent + rope,)],
                                                   dtype=torch.float32, device="cpu")
    total_q = sum(q_lens)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=I32)
    return (torch.randn(total_q, h, latent, generator=gen),
            torch.randn(total_q, h, rope, generator=gen), kv, cu, seq_lens_k, page_table)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_sglang_call_convention(provider):
    """sglang 0.5.23's XPU backend: keywords, q_nope/q_pe sliced from one query tensor, workspace
    sized by flash_mla_prefill_get_workspace_size, num_kv_splits left at its default."""
    gen = torch.Generator().manual_seed(21)
    q_nope, q_pe, kv, cu, seq_lens_k, page_table = _request(gen, [3, 4], [10, 4])
    q_all = torch.cat([q_nope, q_pe], dim=-1)
    size = xpu_ops.flash_mla_prefill_get_workspace_size(
        max_seq_len=64, num_batches=2, num_heads=2, page_size=4, num_kv_splits=-1)
    with xpu_ops.use_provider(provider):
        out = xpu_ops.flash_mla_prefill(
            q_nope=q_all[:, :, :16], q_pe=q_all[:, :, 16:], kv_c_and_k_pe_cache=kv,
            cu_seqlens_q=cu, seq_lens_k=seq_lens_k, max_seqlen_q=4, page_table=page_table,
            workspace=torch.empty(size, dtype=torch.uint8), sm_scale=0.3, causal=True)
    expected = oracle.flash_mla_prefill(q_nope, q_pe, kv, cu, seq_lens_k, page_table,
                                        sm_scale=0.3, causal=True)
    assert_matches_oracle(out, expected, torch.float32)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_prefix_visible_and_causal_bottom_right(provider):
    """The prefix is visible to every new token; a new token sees itself but not the next one:
    a changed key right after a query row changes only later rows."""
    gen = torch.Generator().manual_seed(22)
    q_nope, q_pe, kv, cu, seq_lens_k, page_table = _request(gen, [3], [8], page_size=1)
    args = (q_nope, q_pe, kv, cu, seq_lens_k, 3, page_table, torch.empty(0, dtype=torch.uint8),
            0.5)
    with xpu_ops.use_provider(provider):
        before = xpu_ops.flash_mla_prefill(*args)
        kv[int(page_table[0, 6])] += 1.0           # key 6: new token 1 (row 1 sits at pos 6)
        after = xpu_ops.flash_mla_prefill(*args)
    assert torch.equal(before[0], after[0])                       # row 0 (pos 5) cannot see it
    assert not torch.allclose(before[1], after[1]) and not torch.allclose(before[2], after[2])


def test_empty_batch_and_fake_shapes():
    out = xpu_ops.flash_mla_prefill(
        torch.randn(0, 2, 16), torch.randn(0, 2, 8), torch.randn(1, 4, 24),
        torch.zeros(1, dtype=I32), torch.zeros(0, dtype=I32), 0, torch.zeros(0, 1, dtype=I32),
        torch.empty(0, dtype=torch.uint8), 0.1)
    assert out.shape == (0, 2, 16)
    mode = torch._subclasses.fake_tensor.FakeTensorMode(
        shape_env=torch.fx.experimental.symbolic_shapes.ShapeEnv())
    gen = torch.Generator().manual_seed(23)
    real = _request(gen, [2, 3], [5, 3])
    with mode:
        fake = [mode.from_tensor(t, symbolic_context=None) for t in real]
        out = xpu_ops.flash_mla_prefill(*fake[:5], 3, fake[5], torch.empty(0, dtype=torch.uint8),
                                        0.1)
    assert out.shape == real[0].shape and out.dtype == real[0].dtype


@pytest.mark.parametrize("fn", [xpu_ops.flash_mla_decode_get_workspace_size,
                                xpu_ops.flash_mla_get_workspace_size])
def test_decode_workspace_names_agree(fn):
    for args in ((4096, 2, 16), (1, 1), (100, 3, 128, 64, 4)):
        assert fn(*args) == xpu_ops.flash_mla_get_workspace_size(*args) > 0


@pytest.mark.parametrize("fn", ["flash_mla_prefill_get_workspace_size",
                                "flash_mla_decode_get_workspace_size",
                                "flash_mla_get_workspace_size"])
@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(max_seq_len=-5, num_batches=1), ValueError, "max_seq_len is negative"),
    (dict(max_seq_len=64, num_batches=1, num_heads=-1), ValueError, "num_heads is negative"),
    (dict(max_seq_len=4096.5, num_batches=1), TypeError, "max_seq_len is not an integer"),
    (dict(max_seq_len=64, num_batches=True), TypeError, "num_batches is not an integer"),
    (dict(max_seq_len=64, num_batches=1, num_kv_splits=None), TypeError,
     "num_kv_splits is not an integer"),
])
def test_workspace_size_rejects_bad_sizes(fn, kwargs, exc, match):
    with pytest.raises(exc, match=f"^{fn}: {match}"):
        getattr(xpu_ops, fn)(**kwargs)


def _valid():
    gen = torch.Generator().manual_seed(24)
    q_nope, q_pe, kv, cu, seq_lens_k, page_table = _request(gen, [2, 3], [5, 7])
    return dict(q_nope=q_nope, q_pe=q_pe, kv_c_and_k_pe_cache=kv, cu_seqlens_q=cu,
                seq_lens_k=seq_lens_k, max_seqlen_q=3, page_table=page_table,
                workspace=torch.empty(0, dtype=torch.uint8), sm_scale=0.1)


def _bad(t):
    kv = t["kv_c_and_k_pe_cache"]
    return {
        "q_nope 2-D": (dict(q_nope=t["q_nope"][0]), ValueError,
                       "q_nope has the wrong number of dimensions"),
        "q_nope int": (dict(q_nope=t["q_nope"].int()), ValueError, "q_nope has dtype torch.int32"),
        "q_pe dtype": (dict(q_pe=t["q_pe"].half()), ValueError, "q_pe has dtype torch.float16"),
        "q_pe tokens": (dict(q_pe=t["q_pe"][:1]), ValueError,
                        r"q_pe has the wrong size in dimension 0; expected q_nope.shape\[0\]"),
        "q_pe heads": (dict(q_pe=t["q_pe"][:, :1]), ValueError,
                       r"q_pe has the wrong size in dimension 1"),
        "cache 4-D": (dict(kv_c_and_k_pe_cache=kv[:, :, None]), ValueError,
                      "kv_c_and_k_pe_cache has the wrong number of dimensions"),
        "cache dtype": (dict(kv_c_and_k_pe_cache=kv.half()), ValueError,
                        "kv_c_and_k_pe_cache has dtype torch.float16"),
        "cache R + r": (dict(kv_c_and_k_pe_cache=kv[..., :20]), ValueError,
                        r"kv_c_and_k_pe_cache has the wrong size in dimension 2; expected R \+ r"),
        "seq_lens_k int64": (dict(seq_lens_k=t["seq_lens_k"].long()), ValueError,
                             "seq_lens_k has dtype torch.int64"),
        "cu_seqlens_q length": (dict(cu_seqlens_q=t["cu_seqlens_q"][:2]), ValueError,
                                r"cu_seqlens_q has the wrong size in dimension 0; expected b \+ 1"),
        "cu_seqlens_q int64": (dict(cu_seqlens_q=t["cu_seqlens_q"].long()), ValueError,
                               "cu_seqlens_q has dtype torch.int64"),
        "page_table batch": (dict(page_table=t["page_table"][:1]), ValueError,
                             "page_table has the wrong size in dimension 0"),
        "page_table int64": (dict(page_table=t["page_table"].long()), ValueError,
                             "page_table has dtype torch.int64"),
        "workspace dtype": (dict(workspace=torch.empty(4)), ValueError,
                            "workspace has dtype torch.float32; expected torch.uint8"),
        "workspace 2-D": (dict(workspace=torch.empty(1, 4, dtype=torch.uint8)), ValueError,
                          "workspace has the wrong number of dimensions"),
        "max_seqlen_q negative": (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q is negative"),
        "max_seqlen_q zero": (dict(max_seqlen_q=0), ValueError, "max_seqlen_q is 0 while q_nope"),
        "max_seqlen_q float": (dict(max_seqlen_q=2.5), TypeError,
                               "max_seqlen_q is not an integer"),
        "num_kv_splits str": (dict(num_kv_splits="1"), TypeError,
                              "num_kv_splits is not an integer"),
        "sm_scale str": (dict(sm_scale="s"), TypeError, "sm_scale is not a real number"),
        "q_nope list": (dict(q_nope=[1.0]), TypeError, "q_nope"),
    }


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("name", list(_bad(_valid())))
def test_argument_errors(name, fake):
    t = _valid()
    change, exc, match = _bad(t)[name]
    call = lambda **kw: xpu_ops.flash_mla_prefill(**kw)  # noqa: E731
    assert_named_error(call, {**t, **change}, fake, "flash_mla_prefill", exc, match)


@pytest.mark.parametrize("change,match", [
    (dict(seq_lens_k=torch.tensor([5, 70], dtype=I32)), r"seq_lens_k is out of range.*"
                                                        r"seq_lens_k\[1\] = 70"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=I32)), "cu_seqlens_q does not end at"),
    (dict(max_seqlen_q=2), "max_seqlen_q is smaller than a request's length"),
])
def test_debug_value_checks(change, match):
    kwargs = {**_valid(), **change}
    with xpu_ops.debug_checks(), pytest.raises(ValueError, match=f"^flash_mla_prefill: {match}"):
        xpu_ops.flash_mla_prefill(**kwargs)
