"""``prepare_swa_spec_page_table``: per-draft-row token tables for sliding-window tree verify.

Row ``r * D + i`` of the output is ``[page_table[r, :prefix_lens[r]], allowed drafts of row i in
order, 0 ...]`` where draft ``j`` is allowed when ``custom_mask[r, i, j]``; its length is
``prefix_lens[r] + popcount(custom_mask[r, i])``. Every output element is computed (no scatter),
so the result does not depend on store ordering.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import provider_table
from ._common import available, launch, next_pow2


@triton.jit
def _swa_spec_page_table_kernel(
    PAGE_TABLE, PREFIX_LENS, DRAFT_SLOTS, MASK, TABLE, SEQLENS,
    stride_pt_b, stride_prefix, stride_ds_b, stride_mask_b, stride_mask_i, stride_tab_r, width,
    num_draft,
    BLOCK_C: tl.constexpr, DRAFT_PAD: tl.constexpr,
):
    req = tl.program_id(0)
    row = tl.program_id(1)
    out_row = (req * num_draft + row).to(tl.int64)
    # Clamped into [0, width] (inconsistent prefix_lens never address outside the table).
    prefix = tl.minimum(tl.maximum(tl.load(PREFIX_LENS + req * stride_prefix), 0), width)
    offs_j = tl.arange(0, DRAFT_PAD)
    mask_j = offs_j < num_draft
    allowed = tl.load(MASK + req.to(tl.int64) * stride_mask_b + row * stride_mask_i + offs_j,
                      mask=mask_j, other=0).to(tl.int32)
    slots = tl.load(DRAFT_SLOTS + req.to(tl.int64) * stride_ds_b + offs_j, mask=mask_j, other=0)
    rank = tl.cumsum(allowed, 0) - 1                    # place among this row's allowed drafts
    count = tl.sum(allowed, 0)
    for start in range(0, width + num_draft, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        in_prefix = cols < prefix
        from_table = tl.load(PAGE_TABLE + req.to(tl.int64) * stride_pt_b + cols,
                             mask=in_prefix & (cols < width), other=0)
        # Draft column c (prefix <= c < prefix + count) holds the allowed draft of rank c - prefix.
        hit = (allowed[None, :] > 0) & (rank[None, :] == (cols - prefix)[:, None])
        from_draft = tl.sum(tl.where(hit, slots[None, :], 0), 1)
        value = tl.where(in_prefix, from_table, from_draft)
        tl.store(TABLE + out_row * stride_tab_r + cols, value.to(tl.int32),
                 mask=cols < width + num_draft)
    tl.store(SEQLENS + out_row, prefix + count)


@provider_table.register("prepare_swa_spec_page_table", "triton", available=available)
def prepare_swa_spec_page_table(page_table, prefix_lens, draft_slots, custom_mask):
    """Triton ``prepare_swa_spec_page_table`` (contract: ``xpu_ops/ops/swa_spec.py``).

    One program per (request, draft row) computes every output column (prefix entry or ranked
    allowed draft, no scatter). Returns ``(table [b * num_draft, P + num_draft] int32,
    seqlens [b * num_draft] int32 tokens)``.
    """
    batch, width = page_table.shape
    num_draft = draft_slots.shape[1]
    table = torch.empty((batch * num_draft, width + num_draft), dtype=torch.int32,
                        device=page_table.device)
    seqlens = torch.empty((batch * num_draft,), dtype=torch.int32, device=page_table.device)
    if batch == 0 or num_draft == 0:
        return table, seqlens
    pt = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    ds = draft_slots if draft_slots.stride(-1) == 1 else draft_slots.contiguous()
    mask = custom_mask.contiguous().view(torch.uint8)
    launch(_swa_spec_page_table_kernel, (batch, num_draft), page_table.device,
           pt, prefix_lens, ds, mask, table, seqlens, pt.stride(0), prefix_lens.stride(0),
           ds.stride(0),
           mask.stride(0), mask.stride(1), table.stride(0), width, num_draft,
           BLOCK_C=min(256, next_pow2(width + num_draft)), DRAFT_PAD=next_pow2(num_draft),
           num_warps=4)
    return table, seqlens
