"""``compile/backend/attention_metadata.py``: the page-table and ``cu_seqlens`` builders against a per-request
Python loop written from their definitions (DESIGN.md: ``page_table = req_to_token[rows,
:max_k][:, ::page_size] // page_size``; columns past the table's width read as slot 0)."""

from __future__ import annotations

import pytest
import torch

from compile.backend.attention_metadata import (cu_seqlens, page_table_from_tokens, paged_metadata,
                                        token_table, uniform_cu_seqlens)

WIDTH = 40


def _req_to_token(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5000, (6, WIDTH), generator=gen, dtype=torch.int32)


def _loop_table(req_to_token, rows, max_len, offsets=None, step=1):
    """Column ``j`` of row ``r``: ``req_to_token[rows[r], offsets[r] + j]``, 0 past the width."""
    out = []
    for r, row in enumerate(rows.tolist()):
        start = 0 if offsets is None else int(offsets[r])
        out.append([int(req_to_token[row, start + j]) if start + j < WIDTH else 0
                    for j in range(0, max_len, step)])
    return torch.tensor(out, dtype=torch.int32).view(len(out), -1)


@pytest.mark.parametrize("step", [1, 3, 4, 16])
@pytest.mark.parametrize("max_len", [0, 1, 17, WIDTH, WIDTH + 5])
@pytest.mark.parametrize("offset", [False, True])
def test_token_table_matches_a_loop(step, max_len, offset):
    r2t = _req_to_token()
    rows = torch.tensor([4, 0, 4, 2])  # shuffled, one row twice
    offsets = torch.tensor([0, 8, 3, 36], dtype=torch.int32) if offset else None
    got = token_table(r2t, rows, max_len, offsets, step=step)
    want = _loop_table(r2t, rows, max_len, offsets, step)
    assert got.dtype == r2t.dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    got.fill_(-1)  # a new tensor: writing it leaves req_to_token alone
    assert torch.equal(r2t, _req_to_token())


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
@pytest.mark.parametrize("max_k", [1, 15, 16, 17, WIDTH])
def test_paged_metadata_page_table_is_every_pages_first_slot_over_page_size(page_size, max_k):
    r2t = _req_to_token(1)
    rows = torch.tensor([3, 1, 5])
    lens = torch.tensor([max_k, 1, max_k - 1 or 1], dtype=torch.int64)
    meta = paged_metadata(r2t, rows, cu_seqlens(torch.ones(3, dtype=torch.int32)), lens, 1,
                          max_k, page_size)
    first = _loop_table(r2t, rows, max_k, step=page_size)
    want = torch.div(first, page_size, rounding_mode="floor").to(torch.int32)
    assert meta.page_table.dtype == torch.int32
    assert meta.page_table.shape == (3, -(-max_k // page_size))
    torch.testing.assert_close(meta.page_table, want, atol=0, rtol=0)
    assert meta.cache_seqlens.dtype == torch.int32 and meta.cache_seqlens.tolist() == lens.tolist()
    # The token-granular route gives the same table.
    tokens = _loop_table(r2t, rows, max_k)
    torch.testing.assert_close(page_table_from_tokens(tokens, page_size), want, atol=0, rtol=0)


@pytest.mark.parametrize("n", [0, 1, 3])
@pytest.mark.parametrize("b", [0, 1, 5])
def test_uniform_cu_seqlens_is_cu_seqlens_of_equal_lengths(b, n):
    got = uniform_cu_seqlens(b, n, torch.device("cpu"))
    want = cu_seqlens(torch.full((b,), n, dtype=torch.int32))
    assert got.dtype == torch.int32
    torch.testing.assert_close(got, want, atol=0, rtol=0)
