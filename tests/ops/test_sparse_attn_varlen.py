"""``sparse_attn_varlen_func`` (``xpu_ops/ops/sparse_attn_varlen.py``, sgl-kernel-xpu's packed
form): each request against the float64 oracle of ``sparse_attn_func`` (``test_sparse_attn``),
rows past the last request zero with LSE -inf, checks before any write."""

from __future__ import annotations

import math

import pytest
import torch

from xpu_ops.ops.sparse_attn_varlen import sparse_attn_varlen_func

from .test_sparse_attn import oracle

I32 = torch.int32


def _inputs(gen, q_lens, k_lens, hq=2, hkv=1, d=16, bm=4, bn=4, nnz_s=2, nnz_v=3):
    b, rows = len(q_lens), -(-max(q_lens) // bm)
    q = torch.randn(sum(q_lens) + 2, hq, d, generator=gen)        # 2 rows past the requests
    k = torch.randn(sum(k_lens), hkv, d, generator=gen)
    v = torch.randn(sum(k_lens), hkv, d, generator=gen)
    bc = torch.randint(0, nnz_s + 1, (b, hq, rows), generator=gen, dtype=I32)
    bo = torch.randint(0, max(k_lens), (b, hq, rows, nnz_s), generator=gen, dtype=I32)
    cc = torch.randint(0, nnz_v + 1, (b, hq, rows), generator=gen, dtype=I32)
    ci = torch.randint(-1, max(k_lens) + 1, (b, hq, rows, nnz_v), generator=gen, dtype=I32)
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=I32)
    return q, k, v, bc, bo, cc, ci, cu(q_lens), cu(k_lens)


@pytest.mark.parametrize("causal", [False, True])
def test_each_request_matches_the_oracle(causal):
    gen = torch.Generator().manual_seed(int(causal))
    q_lens, k_lens = [5, 3, 0], [9, 4, 2]
    q, k, v, bc, bo, cc, ci, cu_q, cu_k = _inputs(gen, q_lens, k_lens)
    out = torch.full((q.shape[0], 2, 16), float("nan"))
    got, lse = sparse_attn_varlen_func(q, k, v, bc, bo, cc, ci, cu_q, cu_k, 8, 16,
                                       softmax_scale=0.3, causal=causal,
                                       return_softmax_lse=True, out=out, block_size_M=4,
                                       block_size_N=4)
    assert got is out and lse.shape == (2, q.shape[0])
    for r in range(3):
        qs, ks = slice(int(cu_q[r]), int(cu_q[r + 1])), slice(int(cu_k[r]), int(cu_k[r + 1]))
        want, want_lse = oracle(q[qs][None], k[ks][None], v[ks][None], bc[r:r + 1],
                                bo[r:r + 1], cc[r:r + 1], ci[r:r + 1], softmax_scale=0.3,
                                causal=causal, softcap=0.0, block_size_M=4, block_size_N=4)
        torch.testing.assert_close(got[qs].double(), want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:, qs].double(), want_lse[0], atol=1e-5, rtol=1e-5)
    assert (got[-2:] == 0).all() and (lse[:, -2:] == -math.inf).all()


@pytest.mark.parametrize("cu,match", [
    (torch.tensor([0, 6, 5, 8], dtype=I32), r"cu_seqlens_q is not a cumulative length table"),
    (torch.tensor([0, 5, 8, 99], dtype=I32), r"cu_seqlens_q is not a cumulative length table"),
    (torch.tensor([0, 5, 8], dtype=I32), r"cu_seqlens_q has the wrong size in dimension 0"),
])
def test_bad_tables_write_nothing(cu, match):
    gen = torch.Generator().manual_seed(5)
    q, k, v, bc, bo, cc, ci, _, cu_k = _inputs(gen, [5, 3, 0], [9, 4, 2])
    out = torch.full((q.shape[0], 2, 16), 7.0)
    with pytest.raises(RuntimeError, match="^sparse_attn_varlen_func: " + match):
        sparse_attn_varlen_func(q, k, v, bc, bo, cc, ci, cu, cu_k, 8, 16, out=out,
                                block_size_M=4, block_size_N=4)
    assert (out == 7.0).all()
