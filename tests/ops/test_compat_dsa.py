"""sgl-kernel-xpu's DSA-indexer forms on xpu-ops (``xpu_ops/compat_dsa.py``): ``topk_transform_512``
(/``_v2``), ``nsa.fp8_mqa_logits`` / ``_fp8_mqa_logits_impl`` (0.0 outside a row's range),
``fp8_paged_mqa_logits_triton`` (DeepGEMM's block layout, 0.0 past the end) against oracles
written from the math; guards around the outputs, checks before writes, a fullgraph trace."""

from __future__ import annotations

import math

import pytest
import torch

from xpu_ops import compat_dsa, index_k_layout

from . import dsa_oracle

NAN = float("nan")


def oracle_transform(scores, seq_lens, page_tables, page_size, topk):
    """Positions by the top-k rule (ties to the lower position); in a row with ``L > topk`` a
    chosen ``-inf``/NaN score becomes -1; position p -> ``table[p // ps] * ps + p % ps``."""
    positions = dsa_oracle.topk_positions(scores, seq_lens, None, topk)
    raw, slots = [], []
    for i, row in enumerate(positions):
        long_row = int(seq_lens[i]) > topk
        raw_row = [p if p >= 0 and not (long_row and not float(scores[i, p]) > -math.inf) else -1
                   for p in row]
        raw.append(raw_row)
        slots.append([-1 if p < 0 or p // page_size >= page_tables.shape[1]
                      else int(page_tables[i, p // page_size]) * page_size + p % page_size
                      for p in raw_row])
    return torch.tensor(raw, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32)


def _guarded(rows, topk):
    """An int32 [rows, topk] output inside a buffer of poison (guard column each side)."""
    full = torch.full((rows, topk + 2), -7, dtype=torch.int32)
    out = full[:, 1:-1]
    out.fill_(12345)
    return full, out


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("page_size", [1, 4, 3])
def test_topk_transform_512_matches_oracle(v2, page_size):
    gen = torch.Generator().manual_seed(page_size)
    rows, width, topk = 5, 24, 6
    scores = torch.randn(rows, width, generator=gen)
    scores[2, 3] = -math.inf                        # long row: still chosen only if needed
    scores[3, :] = -math.inf
    scores[3, 5] = 1.0                              # long row with one finite score
    scores[4, 1] = NAN
    seq_lens = torch.tensor([24, 4, 20, 9, 6], dtype=torch.int32)
    tables = torch.randint(0, 50, (rows, math.ceil(width / page_size)), generator=gen,
                           dtype=torch.int32)
    full_page, out_page = _guarded(rows, topk)
    full_raw, out_raw = _guarded(rows, topk)
    want_raw, want_slots = oracle_transform(scores, seq_lens, tables, page_size, topk)
    if v2:
        compat_dsa.topk_transform_512_v2(scores, seq_lens, tables, out_page, page_size,
                                         torch.empty(rows + 1, 2, dtype=torch.int32), out_raw)
    else:
        compat_dsa.topk_transform_512(scores, seq_lens, tables, out_page, page_size, out_raw)
    assert torch.equal(out_raw, want_raw) and torch.equal(out_page, want_slots)
    assert (full_page[:, [0, -1]] == -7).all() and (full_raw[:, [0, -1]] == -7).all()
    assert out_raw[3].tolist() == [-1, -1, -1, -1, -1, 5]   # dropped in place, not compacted


def test_topk_transform_512_page_past_the_table_is_minus_one():
    scores = torch.arange(8.0)[None]
    out = torch.empty(1, 4, dtype=torch.int32)
    compat_dsa.topk_transform_512(scores, torch.tensor([8], dtype=torch.int32),
                                  torch.tensor([[5, 6]], dtype=torch.int32), out, 2)
    assert out.tolist() == [[-1, -1, -1, -1]]       # positions 4..7 are pages 2, 3: no entries


@pytest.mark.parametrize("change,match", [
    (dict(scores=torch.zeros(2, 8, dtype=torch.half)), r"scores has dtype"),
    (dict(seq_lens=torch.zeros(3, dtype=torch.int32)), r"seq_lens has the wrong size"),
    (dict(page_tables=torch.zeros(2, 4)), r"page_tables has dtype"),
    (dict(out_raw_indices=torch.zeros(2, 3, dtype=torch.int32)),
     r"out_raw_indices has the wrong size in dimension 1"),
    (dict(page_size=0), r"page_size is not positive"),
    (dict(page_size=2**40), r"page_size is too large"),   # int32 arithmetic divided by zero
    # an expanded output: refused before out_page_indices is written (not mid-call)
    (dict(out_raw_indices=torch.full((1, 4), 9, dtype=torch.int32).expand(2, 4)),
     r"out_raw_indices has elements that share memory"),
    (dict(out_page_indices=torch.full((1, 4), 9, dtype=torch.int32).expand(2, 4)),
     r"out_page_indices has elements that share memory"),
])
def test_topk_transform_512_checks_write_nothing(change, match):
    kwargs = dict(scores=torch.randn(2, 8), seq_lens=torch.tensor([8, 5], dtype=torch.int32),
                  page_tables=torch.zeros(2, 4, dtype=torch.int32),
                  out_page_indices=torch.full((2, 4), 9, dtype=torch.int32),
                  page_size=2, out_raw_indices=torch.full((2, 4), 9, dtype=torch.int32))
    kwargs.update(change)
    with pytest.raises(RuntimeError, match=r"topk_transform_512: " + match):
        compat_dsa.topk_transform_512(**kwargs)
    assert (kwargs["out_page_indices"] == 9).all()


def test_topk_transform_512_fullgraph_trace():
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(3, 16, generator=gen)
    seq_lens = torch.tensor([16, 2, 9], dtype=torch.int32)
    tables = torch.arange(12, dtype=torch.int32).reshape(3, 4)

    def step(scores, seq_lens, tables, out):
        compat_dsa.topk_transform_512(scores, seq_lens, tables, out, 4)
        return out + 0

    eager = step(scores, seq_lens, tables, torch.empty(3, 4, dtype=torch.int32))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(
        scores, seq_lens, tables, torch.empty(3, 4, dtype=torch.int32))
    assert torch.equal(compiled, eager)
    assert torch.equal(eager, oracle_transform(scores, seq_lens, tables, 4, 4)[1])


def _fp8(gen, *shape):
    return (torch.randn(*shape, generator=gen) * 0.5).to(torch.float8_e4m3fn)


def test_nsa_fp8_mqa_logits_is_zero_outside_the_range():
    gen = torch.Generator().manual_seed(8)
    q, k = _fp8(gen, 3, 2, 16), _fp8(gen, 7, 16)
    k_scale, weights = torch.rand(7, generator=gen) + 0.5, torch.rand(3, 2, generator=gen)
    ks = torch.tensor([0, 2, 5], dtype=torch.int32)
    ke = torch.tensor([3, 7, 5], dtype=torch.int32)
    want, _ = dsa_oracle.mqa_logits(q, k, k_scale, weights, ks, ke)
    want = want.masked_fill(want == -math.inf, 0.0)
    got = compat_dsa.fp8_mqa_logits(q.view(torch.uint8), (k.view(torch.uint8), k_scale),
                                    weights, ks, ke)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    assert got[2].eq(0).all() and got[0, 3:].eq(0).all()
    impl = compat_dsa.fp8_mqa_logits_impl(q, k, k_scale, weights, ks, ke)
    assert torch.equal(impl, got)
    with pytest.raises(TypeError, match=r"fp8_mqa_logits: k_fp8 is not fp8"):
        compat_dsa.fp8_mqa_logits(q, (k.float(), k_scale), weights, ks, ke)


def block_layout_cache(gen, pages, page_size, dim):
    """DeepGEMM's layout: per page the fp8 keys of its tokens, then their float32 scales."""
    keys = _fp8(gen, pages, page_size, dim)
    scales = torch.rand(pages, page_size, generator=gen) + 0.5
    raw = torch.cat([keys.view(torch.uint8).reshape(pages, -1),
                     scales.view(torch.uint8).reshape(pages, -1)], dim=1)
    return raw.view(pages, page_size, 1, dim + 4), keys.double(), scales.double()


def test_fp8_paged_mqa_logits_triton_form_and_its_limits():
    gen = torch.Generator().manual_seed(9)
    cache, keys, scales = block_layout_cache(gen, 4, 64, 128)
    q = _fp8(gen, 2, 1, 3, 128)
    weights = torch.rand(2, 3, generator=gen)
    seq_lens = torch.tensor([[70], [5]], dtype=torch.int32)
    tables = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    got = compat_dsa.fp8_paged_mqa_logits_triton(q, cache.view(torch.float8_e4m3fn), weights,
                                                 seq_lens, tables, None, 130, False)
    want = torch.zeros(2, 130, dtype=torch.float64)
    for b in range(2):
        for j in range(int(seq_lens[b, 0])):
            page, row = int(tables[b, j // 64]), j % 64
            dots = (q[b, 0].double() @ keys[page, row]).clamp(min=0)
            want[b, j] = (weights[b].double() * dots).sum() * scales[page, row]
    torch.testing.assert_close(got.double(), want, atol=1e-3, rtol=1e-5)
    for bad in (dict(q_fp8=q[..., :64]), dict(clean_logits=True)):
        kwargs = dict(q_fp8=q, kvcache_fp8=cache, weight=weights, seq_lens=seq_lens,
                      page_table=tables, deep_gemm_metadata=None, max_seq_len=130)
        kwargs.update(bad)
        with pytest.raises(AssertionError, match="fp8_paged_mqa_logits_triton: .* is outside"):
            compat_dsa.fp8_paged_mqa_logits_triton(**kwargs)


def test_layout_conversions_move_every_byte_and_invert_each_other():
    tokens = torch.arange(2 * 3 * 6, dtype=torch.int32).to(torch.uint8).reshape(2, 3, 1, 6)
    blocks = index_k_layout.tokens_to_blocks(tokens)
    page = blocks[1].reshape(-1).tolist()
    want = tokens[1, :, 0, :2].reshape(-1).tolist() + tokens[1, :, 0, 2:].reshape(-1).tolist()
    assert page == want and blocks.shape == tokens.shape
    assert torch.equal(index_k_layout.blocks_to_tokens(blocks), tokens)
