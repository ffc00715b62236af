"""``flash_mla_decode`` and ``flash_mla_get_workspace_size``: numerics against the float64
oracle (paged latent cache with NaN garbage, empty caches, every split count), and every argument
check."""

from __future__ import annotations

import pytest
import torch

import xpu_ops
from xpu_ops.testing import paged_kv_cache

from . import oracle
from .utils import (assert_matches_oracle, assert_named_error, reseeded_sample,
                    runnable_providers, sample_indices)

OP = torch.ops.xpu_ops.flash_mla_decode
PROVIDERS = runnable_providers("flash_mla_decode")


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("index", sample_indices(OP))
def test_matches_oracle(provider, index):
    args = reseeded_sample(OP, index, seed=5000 + index)
    q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace, scale, splits = args
    assert kv_cache.isnan().any()                      # garbage past cache_seqlens is present
    with xpu_ops.use_provider(provider):
        out = xpu_ops.flash_mla_decode(*args)
    expected = oracle.flash_mla_decode(q_nope, q_rope, kv_cache, cache_seqlens, page_table, scale)
    assert_matches_oracle(out, expected, q_nope.dtype)


@pytest.mark.parametrize("max_seq_len,b,h,splits", [(1, 1, 16, -1), (4096, 2, 16, -1),
                                                    (100, 3, 128, 4), (70000, 1, 0, -1)])
def test_workspace_size_is_enough(max_seq_len, b, h, splits):
    size = xpu_ops.flash_mla_get_workspace_size(max_seq_len, b, h, 64, splits)
    assert isinstance(size, int) and size > 0
    heads = h or 128
    q_nope, q_rope = torch.randn(b, heads, 512), torch.randn(b, heads, 64)
    kv = torch.randn(1, 64, 576)
    mode = torch._subclasses.fake_tensor.FakeTensorMode()      # shapes only: fast for 128 heads
    with mode:
        fargs = [mode.from_tensor(t) for t in (q_nope, q_rope, kv)]
        ws = torch.empty(size, dtype=torch.uint8)
        seqlens, table = torch.ones(b, dtype=torch.int32), torch.zeros(b, 1, dtype=torch.int32)
        xpu_ops.flash_mla_decode(*fargs, seqlens, table, ws, 0.1, splits)
        with pytest.raises(ValueError, match="workspace is too small"):
            xpu_ops.flash_mla_decode(*fargs, seqlens, table, ws[:8], 0.1, splits)
    assert xpu_ops.flash_mla_get_workspace_size(2 * max_seq_len, b + 1, h) >= \
        xpu_ops.flash_mla_get_workspace_size(max_seq_len, b, h)


def _valid():
    b, h, latent, rope = 2, 4, 64, 16
    return dict(q_nope=torch.randn(b, h, latent), q_rope=torch.randn(b, h, rope),
                kv_cache=torch.randn(3, 4, latent + rope),
                cache_seqlens=torch.tensor([3, 7], dtype=torch.int32),
                page_table=torch.tensor([[2, 0], [0, 1]], dtype=torch.int32),
                workspace=torch.empty(xpu_ops.flash_mla_get_workspace_size(8, b, h),
                                      dtype=torch.uint8), softmax_scale=0.1)


def _bad(t):
    return {
        "q_nope 2-D": (dict(q_nope=t["q_nope"][0]), ValueError,
                       "q_nope has the wrong number of dimensions"),
        "q_nope int": (dict(q_nope=t["q_nope"].int()), ValueError, "q_nope has dtype torch.int32"),
        "q_rope dtype": (dict(q_rope=t["q_rope"].half()), ValueError, "q_rope has dtype"),
        "q_rope batch": (dict(q_rope=t["q_rope"][:1]), ValueError,
                         r"q_rope has the wrong size in dimension 0"),
        "q_rope heads": (dict(q_rope=t["q_rope"][:, :2]), ValueError,
                         r"q_rope has the wrong size in dimension 1"),
        "kv_cache 4-D": (dict(kv_cache=t["kv_cache"][:, :, None]), ValueError,
                         "kv_cache has the wrong number of dimensions"),
        "kv_cache dtype": (dict(kv_cache=t["kv_cache"].half()), ValueError,
                           "kv_cache has dtype torch.float16"),
        "kv_cache R + r": (dict(kv_cache=t["kv_cache"][..., :70]), ValueError,
                           r"kv_cache has the wrong size in dimension 2; expected R \+ r = 80"),
        "cache_seqlens int64": (dict(cache_seqlens=t["cache_seqlens"].long()), ValueError,
                                "cache_seqlens has dtype torch.int64"),
        "cache_seqlens length": (dict(cache_seqlens=t["cache_seqlens"][:1]), ValueError,
                                 "cache_seqlens has the wrong size in dimension 0"),
        "page_table int64": (dict(page_table=t["page_table"].long()), ValueError,
                             "page_table has dtype torch.int64"),
        "page_table batch": (dict(page_table=t["page_table"][:1]), ValueError,
                             "page_table has the wrong size in dimension 0"),
        "workspace dtype": (dict(workspace=torch.empty(10 ** 5)), ValueError,
                            "workspace has dtype torch.float32; expected torch.uint8"),
        "workspace small": (dict(workspace=t["workspace"][:100]), ValueError,
                            "workspace is too small"),
        "softmax_scale str": (dict(softmax_scale="s"), TypeError,
                              "softmax_scale is not a real number"),
    }


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("name", list(_bad(_valid())))
def test_argument_errors(name, fake):
    t = _valid()
    change, exc, match = _bad(t)[name]
    call = lambda **kw: xpu_ops.flash_mla_decode(**kw)  # noqa: E731
    assert_named_error(call, {**t, **change}, fake, "flash_mla_decode", exc, match)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_strided_q_nope(provider):
    """q_nope as it comes out of the absorbing bmm, ``[H, b, R].transpose(0, 1)``."""
    gen = torch.Generator().manual_seed(15)
    (kv,), page_table, cache_seqlens = paged_kv_cache(gen, [9, 20], 16, [(80,)],
                                                      dtype=torch.float32, device="cpu")
    q_nope = torch.randn(4, 2, 64, generator=gen).transpose(0, 1)
    q_rope = torch.randn(2, 4, 16, generator=gen)
    workspace = torch.empty(xpu_ops.flash_mla_get_workspace_size(32, 2, 4), dtype=torch.uint8)
    with xpu_ops.use_provider(provider):
        out = xpu_ops.flash_mla_decode(q_nope, q_rope, kv, cache_seqlens, page_table, workspace,
                                       0.1)
    expected = oracle.flash_mla_decode(q_nope, q_rope, kv, cache_seqlens, page_table, 0.1)
    assert_matches_oracle(out, expected, torch.float32)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(max_seq_len=-5, num_batches=1), ValueError, "max_seq_len is negative"),
    (dict(max_seq_len=4096.5, num_batches=1), TypeError, "max_seq_len is not an integer"),
    (dict(max_seq_len=64, num_batches=True), TypeError, "num_batches is not an integer"),
])
def test_workspace_size_rejects_bad_sizes(kwargs, exc, match):
    with pytest.raises(exc, match=f"^flash_mla_get_workspace_size: {match}"):
        xpu_ops.flash_mla_get_workspace_size(**kwargs)


# ----------------------------------------------------------------------------------------------
# The LSE and several query tokens per request (MTP / speculative verify)
# ----------------------------------------------------------------------------------------------

def _oracle_tokens(q_nope, q_rope, kv_cache, cache_seqlens, page_table, scale, causal):
    """Float64 loops: request ``i``'s row ``s`` over its first ``cache_seqlens[i]`` tokens
    (bottom-right causal when asked); ``(out [b, s_q, H, R], lse [b, H, s_q])``."""
    b, s_q, h, latent = q_nope.shape
    page_size = kv_cache.shape[1]
    out = torch.zeros(b, s_q, h, latent, dtype=torch.float64)
    lse = torch.full((b, h, s_q), float("-inf"), dtype=torch.float64)
    for i in range(b):
        n = int(cache_seqlens[i])
        keys = torch.stack([kv_cache[int(page_table[i, j // page_size]), j % page_size]
                            for j in range(n)]).double() if n else None
        for s in range(s_q):
            last = n - s_q + s if causal else n - 1
            if last < 0:
                continue
            k = keys[:last + 1]
            q = torch.cat([q_nope[i, s], q_rope[i, s]], -1).double()
            scores = scale * q @ k.T
            lse[i, :, s] = scores.logsumexp(-1)
            out[i, s] = scores.softmax(-1) @ k[:, :latent]
    return out, lse


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("latent,rope", [(64, 16), (256, 32)])
def test_several_query_tokens_with_lse(provider, causal, latent, rope):
    gen = torch.Generator().manual_seed(21)
    (kv,), page_table, cache_seqlens = paged_kv_cache(gen, [9, 2, 20], 4, [(latent + rope,)],
                                                      dtype=torch.float32, device="cpu")
    q_nope = torch.randn(3, 3, 4, latent, generator=gen)
    q_rope = torch.randn(3, 3, 4, rope, generator=gen)
    size = xpu_ops.flash_mla_get_workspace_size(32, 3, 4, seqlen_q=3, latent_dim=latent)
    workspace = torch.empty(size, dtype=torch.uint8)
    with xpu_ops.use_provider(provider):
        out, lse = xpu_ops.flash_mla_decode(q_nope, q_rope, kv, cache_seqlens, page_table,
                                            workspace, 0.2, causal=causal,
                                            return_softmax_lse=True)
    expected, expected_lse = _oracle_tokens(q_nope, q_rope, kv, cache_seqlens, page_table, 0.2,
                                            causal)
    assert_matches_oracle(out, expected, torch.float32, lse, expected_lse)
    if causal:                                    # request 1 has 2 keys for 3 queries
        assert (out[1, 0] == 0).all() and torch.isneginf(lse[1, :, 0]).all()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_one_token_lse_matches_the_split_kv_output(provider):
    args = reseeded_sample(OP, 0, seed=31)
    with xpu_ops.use_provider(provider):
        plain = xpu_ops.flash_mla_decode(*args)
        out, lse = xpu_ops.flash_mla_decode(*args, return_softmax_lse=True)
    assert out.shape == plain.shape and lse.shape == plain.shape[:2]
    torch.testing.assert_close(out, plain, atol=2e-5, rtol=2e-5)
    q_nope, q_rope, kv, seqlens, table = args[:5]
    _, expected_lse = _oracle_tokens(q_nope[:, None], q_rope[:, None], kv, seqlens, table,
                                     args[6], False)
    torch.testing.assert_close(lse.double(), expected_lse[..., 0], atol=2e-5, rtol=2e-5)


def test_workspace_size_takes_the_query_length():
    one = xpu_ops.flash_mla_decode_get_workspace_size(4096, 2, 16)
    assert xpu_ops.flash_mla_decode_get_workspace_size(4096, 2, 16, seqlen_q=3) == 3 * one
    assert xpu_ops.flash_mla_get_workspace_size(4096, 2, 16, latent_dim=256) < one
    q_nope, q_rope = torch.randn(2, 3, 16, 64), torch.randn(2, 3, 16, 16)
    kv = torch.randn(1, 4, 80)
    seqlens, table = torch.ones(2, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32)
    small = torch.empty(xpu_ops.flash_mla_get_workspace_size(4, 2, 16, latent_dim=64),
                        dtype=torch.uint8)
    with pytest.raises(ValueError, match="^flash_mla_decode: workspace is too small"):
        xpu_ops.flash_mla_decode(q_nope, q_rope, kv, seqlens, table, small, 0.1)
    with pytest.raises(ValueError, match="^flash_mla_decode: q_rope has the wrong size in "
                                         "dimension 1"):
        xpu_ops.flash_mla_decode(q_nope, q_rope[:, :2], kv, seqlens, table, small, 0.1)
    with pytest.raises(TypeError, match="^flash_mla_decode: causal is not a bool"):
        xpu_ops.flash_mla_decode(q_nope, q_rope, kv, seqlens, table, small, 0.1, causal="no")
    with pytest.raises(TypeError, match="^flash_mla_decode_get_workspace_size: seqlen_q is"):
        xpu_ops.flash_mla_decode_get_workspace_size(64, 2, seqlen_q=1.5)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_one_token_split_kv_with_latent_256_rope_32(provider):
    """The split-KV one-token path at R = 256, r = 32 (a workspace sized for that latent)."""
    gen = torch.Generator().manual_seed(41)
    (kv,), page_table, cache_seqlens = paged_kv_cache(gen, [37, 0, 5], 8, [(288,)],
                                                      dtype=torch.float32, device="cpu")
    q_nope, q_rope = torch.randn(3, 4, 256, generator=gen), torch.randn(3, 4, 32, generator=gen)
    workspace = torch.empty(xpu_ops.flash_mla_get_workspace_size(48, 3, 4, num_kv_splits=3,
                                                                 latent_dim=256),
                            dtype=torch.uint8)
    with xpu_ops.use_provider(provider):
        out = xpu_ops.flash_mla_decode(q_nope, q_rope, kv, cache_seqlens, page_table, workspace,
                                       0.1, 3)
    expected = oracle.flash_mla_decode(q_nope, q_rope, kv, cache_seqlens, page_table, 0.1)
    assert_matches_oracle(out, expected, torch.float32)
