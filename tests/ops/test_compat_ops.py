"""sgl-kernel-xpu's raw op names defined by the shim (``xpu_ops/compat_ops.py``):
``torch.ops.sgl_kernel.rotary_embedding`` and ``torch.ops.sgl_kernel.fp8_paged_mqa_logits``
against float64 oracles written from the math (each provider of the ops they compose), guards
around in-place writes, strided inputs, checks eager and fake (nothing written on a rejected
call), opcheck, and a fullgraph trace."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
import torch

import xpu_ops

from .utils import error_message, runnable_providers

if (sys.modules.get("sgl_kernel") is not None and not xpu_ops.compat.is_shim(
        sys.modules["sgl_kernel"])) or (sys.modules.get("sgl_kernel") is None
                                        and importlib.util.find_spec("sgl_kernel") is not None):
    pytest.skip("a real sgl_kernel defines these op names itself", allow_module_level=True)

from xpu_ops import compat_ops  # noqa: E402

ROPE = torch.ops.sgl_kernel.rotary_embedding
PAGED = torch.ops.sgl_kernel.fp8_paged_mqa_logits
PROVIDERS = runnable_providers("apply_rotary_emb")


def oracle_rope(x, positions, cache, head_size, is_neox):
    """float64 rotation of ``x [T, heads * head_size]`` or ``[T, heads, D]``: pair ``(a, b)`` of
    head features -> ``(a cos - b sin, a sin + b cos)`` with row ``positions[t]`` of the cache
    (cos | sin halves), loop by loop."""
    shape = x.shape
    rows = x.double().reshape(shape[0], -1, head_size).clone()
    rot = cache.shape[1]
    half = rot // 2
    for t, p in enumerate(positions.reshape(-1).tolist()):
        p = min(max(p, 0), cache.shape[0] - 1)
        for i in range(half):
            c, s = float(cache[p, i]), float(cache[p, half + i])
            first, second = (i, i + half) if is_neox else (2 * i, 2 * i + 1)
            a, b = rows[t, :, first].clone(), rows[t, :, second].clone()
            rows[t, :, first], rows[t, :, second] = a * c - b * s, a * s + b * c
    return rows.reshape(shape)


def _rope_inputs(gen, tokens, heads_q, heads_k, head_size, rot, dtype, three_d, pad=3):
    """Query/key as column slices of NaN-padded buffers (strided rows, guard columns)."""
    def rows(heads):
        full = torch.full((tokens, heads * head_size + pad), float("nan"), dtype=dtype)
        x = full[:, :heads * head_size]
        x.copy_(torch.randn(tokens, heads * head_size, generator=gen).to(dtype))
        return full, (x.view(tokens, heads, head_size) if three_d and pad == 0 else x)
    (q_full, q), (k_full, k) = rows(heads_q), rows(heads_k)
    if three_d:
        q, k = q.unflatten(1, (heads_q, head_size)), k.unflatten(1, (heads_k, head_size))
    cache = torch.randn(11, rot, generator=gen)
    positions = torch.randint(0, 11, (tokens,), generator=gen)
    return q_full, q, k_full, k, cache, positions


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype,rot,head_size", [(torch.float32, 8, 8), (torch.bfloat16, 4, 8)])
def test_rotary_2d_rotates_in_place_and_returns_copies(provider, is_neox, dtype, rot, head_size):
    gen = torch.Generator().manual_seed(rot + int(is_neox))
    q_full, q, k_full, k, cache, positions = _rope_inputs(gen, 5, 3, 1, head_size, rot, dtype,
                                                          three_d=False)
    want_q = oracle_rope(q, positions, cache.to(dtype), head_size, is_neox)
    want_k = oracle_rope(k, positions, cache.to(dtype), head_size, is_neox)
    with xpu_ops.use_provider(provider):
        q_out, k_out = ROPE(positions, q, k, head_size, cache.to(dtype), is_neox)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in ((q, want_q), (k, want_k), (q_out, want_q), (k_out, want_k)):
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    assert q_out.data_ptr() != q.data_ptr() and q_out.is_contiguous()
    assert q_full[:, -3:].isnan().all() and k_full[:, -3:].isnan().all()   # guard columns


@pytest.mark.parametrize("provider", PROVIDERS)
def test_rotary_3d_leaves_inputs_and_reads_strides(provider):
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(4, 2, 12, generator=gen)
    q = wide[:, :, 4:]                                    # [4, 2, 8], the rope part of a head
    k = torch.randn(4, 1, 20, generator=gen)[:, :, -8:]
    cache = torch.randn(9, 8, generator=gen)
    positions = torch.tensor([[3, 0], [8, 20]])           # [batch, seq]; 20 takes row 8
    q_before, k_before = q.clone(), k.clone()
    with xpu_ops.use_provider(provider):
        q_out, k_out = ROPE(positions, q, k, 8, cache, False)
    torch.testing.assert_close(q_out.double(), oracle_rope(q, positions, cache, 8, False),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out.double(), oracle_rope(k, positions, cache, 8, False),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


_GOOD = dict(positions=torch.arange(3), query=torch.zeros(3, 16), key=torch.zeros(3, 8),
             head_size=8, cos_sin_cache=torch.zeros(5, 8), is_neox=True)


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("change,match", [
    (dict(query=torch.zeros(3, 2, 2, 8)), r"query has the wrong number of dimensions"),
    (dict(key=torch.zeros(3, 8, dtype=torch.half)), r"key has dtype"),
    (dict(key=torch.zeros(2, 8)), r"key has the wrong size in dimension 0"),
    (dict(positions=torch.arange(4)), r"positions has the wrong number of elements"),
    (dict(positions=torch.arange(3.0)), r"positions has dtype"),
    (dict(query=torch.zeros(3, 12)), r"query has a last dimension that is not a multiple"),
    (dict(cos_sin_cache=torch.zeros(5, 10)), r"cos_sin_cache has a wrong rotary dim"),
    (dict(cos_sin_cache=torch.zeros(5, 3)), r"cos_sin_cache has a wrong rotary dim"),
    (dict(head_size=0), r"head_size is not positive"),
])
def test_rotary_checks_write_nothing(fake, change, match):
    kwargs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in _GOOD.items()}
    kwargs.update(change)
    kwargs["query"].fill_(1.0)
    msg = error_message(lambda **kw: ROPE(**kw), kwargs, fake)
    assert msg.startswith("ValueError: rotary_embedding: ") and re.search(match, msg), msg
    if not fake:
        assert (kwargs["query"] == 1.0).all()                    # rejected before any write
        with pytest.raises(RuntimeError):
            ROPE(**kwargs)


def test_rotary_opcheck_and_fullgraph_trace():
    gen = torch.Generator().manual_seed(3)
    cases = [(torch.arange(4), torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen),
              8, torch.randn(6, 8, generator=gen), True),
             (torch.arange(4, dtype=torch.int32), torch.randn(4, 2, 8, generator=gen),
              torch.randn(4, 1, 8, generator=gen), 8, torch.randn(6, 4, generator=gen), False)]
    for args in cases:
        torch.library.opcheck(ROPE.default, args)

    def step(positions, q, k, cache):
        q_out, k_out = ROPE(positions, q, k, 8, cache, True)
        return q_out + 0, k_out + 0, q + 0

    positions, q, k, _, cache, _ = cases[0]
    eager = step(positions, q.clone(), k.clone(), cache)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(positions, q.clone(),
                                                                        k.clone(), cache)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
    torch.testing.assert_close(eager[2].double(), oracle_rope(q, positions, cache, 8, True),
                               atol=1e-5, rtol=1e-5)


def per_token_cache(gen, pages, page_size, dim):
    """uint8 ``[pages, page_size, 1, dim + 4]``: each token's fp8 key bytes, then its float32
    scale (sgl-kernel-xpu's per-token layout), and the float64 keys and scales."""
    keys = (torch.randn(pages, page_size, dim, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    scales = torch.rand(pages, page_size, generator=gen) + 0.5
    cache = torch.cat([keys.view(torch.uint8), scales[..., None].view(torch.uint8)], dim=-1)
    return cache.unsqueeze(2).contiguous(), keys.double(), scales.double()


def oracle_paged(q, keys, scales, weights, seq_lens, block_tables, max_seq_len):
    """float64 ``sum_h w[b, h] relu(q[b, h] . k_j) * scale_j`` for j < seq_lens[b], else 0."""
    q64 = q.view(torch.float8_e4m3fn).double().reshape(q.shape[0], -1, q.shape[-1])
    page_size = keys.shape[1]
    out = torch.zeros(q.shape[0], max_seq_len, dtype=torch.float64)
    for b in range(q.shape[0]):
        for j in range(int(seq_lens[b])):
            page, row = int(block_tables[b, j // page_size]), j % page_size
            dots = (q64[b] @ keys[page, row]).clamp(min=0)
            out[b, j] = (weights[b].double() * dots).sum() * scales[page, row]
    return out


def test_paged_mqa_logits_raw_op_reads_the_per_token_layout():
    gen = torch.Generator().manual_seed(11)
    cache, keys, scales = per_token_cache(gen, 5, 4, 16)
    q = (torch.randn(2, 1, 3, 16, generator=gen)).to(torch.float8_e4m3fn).view(torch.uint8)
    weights = torch.rand(2, 3, generator=gen)
    seq_lens = torch.tensor([7, 3], dtype=torch.int32)
    tables = torch.tensor([[4, 1, 0], [2, 3, 3]], dtype=torch.int32)
    got = PAGED(q, cache, weights, seq_lens, tables, None, 12, True)
    want = oracle_paged(q, keys, scales, weights, seq_lens, tables, 12)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    assert (got[0, 7:] == 0).all() and (got[1, 3:] == 0).all()
    torch.library.opcheck(PAGED.default, (q, cache, weights, seq_lens, tables, None, 12, True))
    with pytest.raises(RuntimeError, match=r"fp8_paged_mqa_logits: kv_cache has the wrong size "
                                           r"in dimension 3"):
        PAGED(q, cache[..., :-1], weights, seq_lens, tables, None, 12, False)
    msg = error_message(lambda **kw: PAGED(**kw), dict(
        q_fp8=q, kv_cache=cache, weights=weights[:1], seq_lens=seq_lens, block_tables=tables,
        schedule_metadata=None, max_seq_len=12, clean_logits=False), fake=True)
    assert "fp8_paged_mqa_logits: weights has the wrong size in dimension 0" in msg, msg


def test_op_names_are_defined():
    assert set(compat_ops.OP_NAMES) == {"rotary_embedding", "fp8_paged_mqa_logits",
                                        "gdn_attention"}
    for name in compat_ops.OP_NAMES:
        assert hasattr(torch.ops.sgl_kernel, name)
