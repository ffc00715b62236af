"""Float64 oracles of the DSA indexer ops, written from the math (DeepSeek-V3.2's indexer,
DeepGEMM's logits contract, the top-k rule of ``xpu_ops/ops/dsa_topk.py``), loop by loop. They
share no code with any provider: the cache layout is decoded here from its description."""

from __future__ import annotations

import math

import torch

NEG_INF = -math.inf


def _fp8_to_f64(t):
    return t.view(torch.float8_e4m3fn).double() if t.dtype == torch.uint8 else t.double()


def mqa_logits(q, k, k_scale, weights, ks, ke, max_seqlen_k=0):
    """``logits[i, j] = sum_h w[i, h] relu(scale_j * q[i, h] . k_j)`` for j in [ks, ke) and
    in range, ``-inf`` elsewhere; compressed columns when ``max_seqlen_k > 0``. Also returns the
    bound ``sum_h |w[i, h]| |scale_j q[i, h] . k_j|`` used for tolerances."""
    q64, k64 = _fp8_to_f64(q), _fp8_to_f64(k)
    s, skv = q.shape[0], k.shape[0]
    width = max_seqlen_k if max_seqlen_k > 0 else skv
    out = torch.full((s, width), NEG_INF, dtype=torch.float64)
    bound = torch.zeros((s, width), dtype=torch.float64)
    for i in range(s):
        lo, hi = max(int(ks[i]), 0), min(int(ke[i]), skv)
        for c in range(width):
            j = int(ks[i]) + c if max_seqlen_k > 0 else c
            if lo <= j < hi:
                dots = (q64[i] @ k64[j]) * float(k_scale[j])                       # [H]
                out[i, c] = (weights[i].double() * dots.clamp(min=0)).sum()
                bound[i, c] = (weights[i].double().abs() * dots.abs()).sum()
    return out, bound


def read_index_k(cache, slot):
    """``(key [D] float64, scale float)`` of token slot ``slot`` of a fused cache
    ``[num_blocks, block_size, 1, D + 4]`` (per block: the fp8 keys of its tokens, then their
    float32 scales)."""
    nb, bs, _, width = cache.shape
    dim = width - 4
    block = cache[slot // bs].reshape(-1)              # the block's bytes in logical order
    row = slot % bs
    key = block[row * dim:(row + 1) * dim].contiguous().view(torch.float8_e4m3fn).double()
    scale = block[bs * dim + 4 * row: bs * dim + 4 * row + 4].contiguous().view(torch.float32)
    return key, float(scale)


def paged_mqa_logits(q, cache, weights, context_lens, block_table, max_context_len):
    """DeepGEMM's paged logits, query by query and position by position."""
    b, next_n, h, d = q.shape
    nb, bs = cache.shape[:2]
    q64 = _fp8_to_f64(q)
    out = torch.full((b * next_n, max_context_len), NEG_INF, dtype=torch.float64)
    bound = torch.zeros_like(out)
    for i in range(b):
        for n in range(next_n):
            if context_lens.dim() == 1:
                visible = int(context_lens[i]) - next_n + n + 1
            else:
                visible = int(context_lens[i, n])
            visible = max(0, min(visible, max_context_len, block_table.shape[1] * bs))
            r = i * next_n + n
            for j in range(visible):
                blk = int(block_table[i, j // bs])
                if not 0 <= blk < nb:
                    continue
                key, scale = read_index_k(cache, blk * bs + j % bs)
                dots = (q64[i, n] @ key) * scale
                out[r, j] = (weights[r].double() * dots.clamp(min=0)).sum()
                bound[r, j] = (weights[r].double().abs() * dots.abs()).sum()
    return out, bound


def topk_positions(score, lengths, row_starts, topk):
    """The selection rule: highest scores first (NaN as -inf, -0.0 as 0.0), lower position
    on ties, listed in ascending position, -1 padded. Returns a list of lists."""
    rows, width = score.shape
    result = []
    for i in range(rows):
        start = 0 if row_starts is None else min(max(int(row_starts[i]), 0), width)
        length = max(0, min(int(lengths[i]), width - start))
        keyed = []
        for p in range(length):
            v = float(score[i, start + p])
            keyed.append((NEG_INF if math.isnan(v) else v + 0.0, p))
        keyed.sort(key=lambda vp: (-vp[0], vp[1]))
        chosen = sorted(p for _, p in keyed[:topk])
        result.append(chosen + [-1] * (topk - len(chosen)))
    return result


def topk_slots(score, lengths, page_table, cu_seqlens_q, row_starts, topk):
    """``topk_positions`` mapped through the page-table row of the row's request."""
    positions = topk_positions(score, lengths, row_starts, topk)
    cu = [int(c) for c in cu_seqlens_q]
    out = []
    for i, row in enumerate(positions):
        request = next((r for r in range(len(cu) - 1) if cu[r] <= i < cu[r + 1]), None)
        out.append([int(page_table[request, p]) if request is not None and 0 <= p <
                    page_table.shape[1] else -1 for p in row])
    return out


def quantize_index_k(index_k, ue8m0):
    """Per row ``(scale, dequantised key [D])`` in float64 of the store rule."""
    rows = []
    for x in index_k.double():
        scale = max(float(x.abs().max()) if x.numel() else 0.0, 1e-4) / 448.0
        if ue8m0:
            scale = 2.0 ** math.ceil(math.log2(scale))
        rows.append((scale, x))
    return rows


def hadamard(x, scale):
    """``scale * x @ H`` with ``H[i, j] = (-1)^popcount(i & j)`` over the zero-padded last
    dimension, truncated back."""
    d = x.shape[-1]
    n = 1
    while n < d:
        n *= 2
    idx = torch.arange(n)
    parity = torch.tensor([[bin(int(a) & int(b)).count("1") % 2 for b in idx] for a in idx])
    mat = (1 - 2 * parity).double()
    padded = torch.nn.functional.pad(x.double(), (0, n - d))
    return (padded @ mat)[..., :d] * scale


def _close_logits(got, want, bound):
    got = got.cpu()
    assert torch.equal(got == NEG_INF, want == NEG_INF), "-inf pattern differs"
    finite = want != NEG_INF
    err = (got.double() - want).abs()[finite]
    # float32 accumulation (1e-5); fp8 products may go through bf16/fp16 tensor cores exactly
    assert bool((err <= 2e-5 * bound[finite] + 1e-6).all())


def compare(name, args, result, inputs):
    """Assert that an op call on a device (``args`` after it ran, ``result``) matches the
    oracle of ``inputs`` (CPU copies of the arguments taken before the call); for
    ``test_oracle_gpu``. Returns False when ``name`` is not a DSA indexer op."""
    if name == "fp8_mqa_logits":
        q, k, k_scale, w, ks, ke, _, width = inputs
        _close_logits(result, *mqa_logits(q, k, k_scale, w, ks, ke, width))
    elif name == "fp8_paged_mqa_logits":
        q, cache, w, lens, table, max_len, _ = inputs
        _close_logits(result, *paged_mqa_logits(q, cache, w, lens, table, max_len))
    elif name == "fast_topk":
        score, lengths, starts, topk = inputs
        assert result.cpu().tolist() == topk_positions(score, lengths, starts, topk)
    elif name == "fast_topk_transform":
        assert result.cpu().tolist() == topk_slots(*inputs)
    elif name == "store_index_k_cache":
        cache, loc, index_k, ue8m0 = inputs
        rows = quantize_index_k(index_k, ue8m0)
        after = args[0].cpu()
        for t, slot in enumerate(loc.tolist()):
            if 0 <= slot < cache.shape[0] * cache.shape[1]:
                key, scale = read_index_k(after, slot)
                assert abs(scale - rows[t][0]) <= 1e-6 * rows[t][0]
                assert bool(((key * scale - rows[t][1]).abs() <= rows[t][1].abs() / 16
                             + scale * 2 ** -10 + 1e-12).all())
    elif name == "hadamard_transform":
        x, scale = inputs
        want = hadamard(x, scale)
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[x.dtype]
        torch.testing.assert_close(result.cpu().double(), want, rtol=tol,
                                   atol=tol * (float(want.abs().max()) if want.numel() else 1))
    else:
        return False
    return True
