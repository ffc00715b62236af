"""``flash_mla_sparse_fwd``: every sample against the float64 oracle on every provider (Triton
through its interpreter), tokens without a valid index, sinks, ``topk_length``, strided inputs,
tracing, and every argument check."""

from __future__ import annotations

import math

import pytest

from .triton_mode import provider_params, rerun_in_subprocess, running  # first

import torch  # noqa: E402

import xpu_ops  # noqa: E402

from . import oracle_flash_mla as oracle  # noqa: E402
from .utils import (LSE_TOL, assert_matches_oracle, assert_named_error,  # noqa: E402
                    reseeded_sample, sample_indices)

OP = torch.ops.xpu_ops.flash_mla_sparse_fwd
PROVIDERS = provider_params()
I32 = torch.int32
test_rerun_in_subprocess = rerun_in_subprocess(__file__)


def _check(args, provider):
    with running(provider):
        out, max_logits, lse = OP(*args)
    expected, expected_max, expected_lse = oracle.flash_mla_sparse_fwd(*args)
    assert_matches_oracle(out, expected, args[0].dtype, lse, expected_lse)
    torch.testing.assert_close(max_logits.double(), expected_max, **LSE_TOL[args[0].dtype])
    return out, max_logits, lse


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", sample_indices(OP))
def test_matches_oracle(provider, index):
    _check(reseeded_sample(OP, index, seed=8000 + index), provider)


def _args(seed=0, s_q=3, h=4, d=48, dv=32, s_kv=9, topk=5):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h, d, generator=gen)
    kv = torch.randn(s_kv, 1, d, generator=gen)
    indices = torch.randint(0, s_kv, (s_q, 1, topk), generator=gen).to(I32)
    return [q, kv, indices, 0.25, dv, None, None]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_tokens_without_a_valid_index(provider):
    args = _args(1)
    args[2][0] = -1
    args[2][1, 0] = torch.tensor([9, 2 ** 31 - 1, -5, 10 ** 6, 9], dtype=I32)  # all past s_kv
    args[6] = torch.tensor([5, 5, 0], dtype=I32)                              # token 2: none
    args[5] = torch.tensor([1.0, -math.inf, math.inf, 0.0])
    out, max_logits, lse = _check(args, provider)
    assert (out == 0).all()
    assert torch.isneginf(lse).all() and torch.isneginf(max_logits).all()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_topk_length_ignores_later_indices_even_nan_rows(provider):
    """Indices past ``topk_length`` are never read: they point at NaN rows here."""
    args = _args(2)
    args[1][7:] = float("nan")
    args[2][:, :, :2] = torch.randint(0, 7, (3, 1, 2), dtype=I32)
    args[2][:, :, 2:] = 8
    args[6] = torch.tensor([2, 1, 2], dtype=I32)
    out, _, _ = _check(args, provider)
    assert not out.isnan().any()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_strided_inputs(provider):
    """q and kv as row-padded views, indices a column slice, a sink expanded from one value."""
    args = _args(3)
    q, kv, idx = args[:3]
    wide_q = torch.full((3, 4, 53), float("nan"))
    wide_q[..., 1:49] = q
    wide_kv = torch.full((9, 2, 48), float("nan"))
    wide_kv[:, 1] = kv[:, 0]
    wide_idx = torch.full((3, 1, 10), 2 ** 30, dtype=I32)
    wide_idx[..., ::2] = idx
    args[:3] = wide_q[..., 1:49], wide_kv[:, 1:], wide_idx[..., ::2]
    args[5] = torch.tensor([0.5]).expand(4)
    _check(args, provider)


def test_compiled_fullgraph_matches_eager():
    args = _args(4)

    def step(q, kv, indices):
        out, max_logits, lse = xpu_ops.flash_mla_sparse_fwd(q, kv, indices, 0.25, d_v=32)
        return out + 1, lse - max_logits

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    for got, want in zip(compiled(*args[:3]), step(*args[:3])):
        torch.testing.assert_close(got, want)


def _valid():
    q, kv, indices, scale, dv = _args(5)[:5]
    return dict(q=q, kv=kv, indices=indices, sm_scale=scale, d_v=dv)


def _bad(t):
    return {
        "q 4-D": (dict(q=t["q"][None]), ValueError, "q has the wrong number of dimensions"),
        "kv dtype": (dict(kv=t["kv"].half()), ValueError, "kv has dtype torch.float16"),
        "kv heads": (dict(kv=t["kv"].expand(-1, 2, -1)), ValueError,
                     "kv has the wrong size in dimension 1; expected one latent KV head"),
        "kv d": (dict(kv=t["kv"][..., :40]), ValueError, r"kv has the wrong size in dimension 2"),
        "indices int64": (dict(indices=t["indices"].long()), ValueError,
                          "indices has dtype torch.int64"),
        "indices s_q": (dict(indices=t["indices"][:2]), ValueError,
                        r"indices has the wrong size in dimension 0"),
        "d_v big": (dict(d_v=49), ValueError, "d_v is out of range"),
        "sink heads": (dict(attn_sink=torch.zeros(5)), ValueError,
                       r"attn_sink has the wrong size in dimension 0"),
        "topk_length dtype": (dict(topk_length=torch.ones(3)), ValueError,
                              "topk_length has dtype torch.float32"),
        "scale inf": (dict(sm_scale=math.inf), ValueError, "sm_scale is not finite"),
        "indices list": (dict(indices=[[0]]), TypeError, "indices is not a tensor"),
    }


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("name", list(_bad(_valid())))
def test_argument_errors(name, fake):
    t = _valid()
    change, exc, match = _bad(t)[name]
    call = lambda **kw: xpu_ops.flash_mla_sparse_fwd(**kw)  # noqa: E731
    assert_named_error(call, {**t, **change}, fake, "flash_mla_sparse_fwd", exc, match)


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [128, 2048])
def test_deepseek_shapes_on_gpu(topk):
    """DeepSeek-V3.2 prefill shapes (128 heads, 576/512) on the GPU: Triton against the
    reference provider (checked against the oracle on the CPU)."""
    gen = torch.Generator().manual_seed(13)
    s_q, s_kv = 64, 4096
    q = (torch.randn(s_q, 128, 576, generator=gen) / 4).to(torch.bfloat16).cuda()
    kv = (torch.randn(s_kv, 1, 576, generator=gen) / 4).to(torch.bfloat16).cuda()
    indices = torch.randint(-1, s_kv + 10, (s_q, 1, topk), generator=gen).to(I32).cuda()
    args = (q, kv, indices, 576 ** -0.5, 512, torch.randn(128).cuda(),
            torch.randint(0, topk + 1, (s_q,), generator=gen).to(I32).cuda())
    with xpu_ops.use_provider("reference"):
        want = OP(*args)
    with xpu_ops.use_provider("triton"):
        got = OP(*args)
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-2, rtol=2e-2)
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("provider", [p for p in PROVIDERS if p.values[0] == "triton"])
def test_split_kv_matches_the_oracle(provider, monkeypatch):
    """Triton's split-KV launch (forced to 2 splits): max_logits and lse merged too."""
    from xpu_ops.triton import flash_mla as triton_flash_mla
    monkeypatch.setattr(triton_flash_mla, "plan_splits", lambda *args: 2)
    args = _args(6, topk=40)
    args[5], args[6] = torch.tensor([0.5, -1.0, math.inf, 2.0]), torch.tensor([40, 3, 0],
                                                                               dtype=I32)
    _check(args, provider)
