"""``prepare_swa_spec_page_table``: per-draft-row tables against a loop oracle written from the
docstring, and every argument check."""

from __future__ import annotations

import re

import pytest
import torch

import xpu_ops

from .utils import error_message, reseeded_sample, runnable_providers, sample_indices

OP = torch.ops.xpu_ops.prepare_swa_spec_page_table


def _oracle(page_table, prefix_lens, draft_slots, custom_mask):
    """Row ``r * D + i``: the first ``prefix_lens[r]`` slots of request r, then ``draft_slots[r,
    j]`` for every ``j`` with ``custom_mask[r, i, j]``, in order of j."""
    rows, lens = [], []
    for r in range(page_table.shape[0]):
        for i in range(draft_slots.shape[1]):
            row = page_table[r, :int(prefix_lens[r])].tolist()
            row += [int(draft_slots[r, j]) for j in range(draft_slots.shape[1])
                    if custom_mask[r, i, j]]
            rows.append(row)
            lens.append(len(row))
    return rows, lens


@pytest.mark.parametrize("provider", runnable_providers("prepare_swa_spec_page_table"))
@pytest.mark.parametrize("index", sample_indices(OP))
def test_matches_oracle(provider, index):
    args = reseeded_sample(OP, index, seed=8000 + index)
    with xpu_ops.use_provider(provider):
        table, lens = xpu_ops.prepare_swa_spec_page_table(*args)
    rows, expected_lens = _oracle(*args)
    assert lens.tolist() == expected_lens
    assert table.shape == (len(rows), args[0].shape[1] + args[2].shape[1])
    for r, row in enumerate(rows):
        assert table[r, :len(row)].tolist() == row
        assert (table[r, len(row):] == 0).all()            # documented: 0 past the row's end


def _valid():
    i32 = dict(dtype=torch.int32)
    return dict(page_table=torch.zeros(2, 5, **i32), prefix_lens=torch.tensor([1, 3], **i32),
                draft_slots=torch.zeros(2, 3, **i32),
                custom_mask=torch.eye(3, dtype=torch.bool).expand(2, 3, 3).contiguous())


BAD = {
    "page_table int64": (lambda t: dict(page_table=t["page_table"].long()), ValueError,
                         "page_table has dtype torch.int64"),
    "prefix_lens int64": (lambda t: dict(prefix_lens=t["prefix_lens"].long()), ValueError,
                          "prefix_lens has dtype torch.int64"),
    "prefix_lens length": (lambda t: dict(prefix_lens=t["prefix_lens"][:1]), ValueError,
                           "prefix_lens has the wrong size in dimension 0"),
    "draft_slots 1-D": (lambda t: dict(draft_slots=t["draft_slots"][0]), ValueError,
                        "draft_slots has the wrong number of dimensions"),
    "draft_slots batch": (lambda t: dict(draft_slots=t["draft_slots"][:1]), ValueError,
                          "draft_slots has the wrong size in dimension 0"),
    "custom_mask dtype": (lambda t: dict(custom_mask=t["custom_mask"].int()), ValueError,
                          "custom_mask has dtype torch.int32; expected torch.bool"),
    "custom_mask shape": (lambda t: dict(custom_mask=t["custom_mask"][:, :2]), ValueError,
                          "custom_mask has the wrong shape"),
}


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("name", list(BAD))
def test_argument_errors(name, fake):
    t = _valid()
    change, exc, match = BAD[name]
    kwargs = {**t, **change(t)}
    msg = error_message(lambda **kw: xpu_ops.prepare_swa_spec_page_table(**kw), kwargs, fake)
    assert msg.startswith(f"{exc.__name__}: prepare_swa_spec_page_table: "), msg
    assert re.search(match, msg), msg
    if fake:
        assert msg == error_message(lambda **kw: xpu_ops.prepare_swa_spec_page_table(**kw), kwargs,
                             False)


@pytest.mark.parametrize("provider", runnable_providers("prepare_swa_spec_page_table"))
@pytest.mark.parametrize("batch,num_draft", [(0, 3), (2, 0)], ids=["no requests", "no drafts"])
def test_empty_batch_or_no_drafts_give_empty_tables(provider, batch, num_draft):
    i32 = dict(dtype=torch.int32)
    args = (torch.zeros(batch, 5, **i32), torch.zeros(batch, **i32),
            torch.zeros(batch, num_draft, **i32),
            torch.zeros(batch, num_draft, num_draft, dtype=torch.bool))
    with xpu_ops.use_provider(provider):
        table, lens = xpu_ops.prepare_swa_spec_page_table(*args)
    assert table.shape == (batch * num_draft, 5 + num_draft) and table.is_contiguous()
    assert lens.shape == (batch * num_draft,) and lens.dtype == torch.int32
