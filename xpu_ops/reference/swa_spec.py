"""Reference ``prepare_swa_spec_page_table``: vectorised gather/scatter, no loop over rows."""

from __future__ import annotations

import torch

from .. import provider_table


@provider_table.register("prepare_swa_spec_page_table", "reference")
def prepare_swa_spec_page_table(page_table, prefix_lens, draft_slots, custom_mask):
    """Reference ``prepare_swa_spec_page_table`` (contract: ``xpu_ops/ops/swa_spec.py``).

    Vectorised: copies each prefix, scatters the allowed drafts after it by their rank (a spare
    last column takes disallowed ones). Returns ``(table [b * num_draft, P + num_draft] int32,
    seqlens [b * num_draft] int32 tokens)``.
    """
    batch, width = page_table.shape
    num_draft = draft_slots.shape[1]
    device = page_table.device
    lens = prefix_lens.long().clamp(0, width)   # clamped into range, as the Triton kernel does
    cols = torch.arange(width + num_draft + 1, device=device)       # last column: discard bin
    prefix = torch.where(cols[None, :width] < lens[:, None], page_table, 0)
    table = torch.zeros((batch, num_draft, width + num_draft + 1), dtype=torch.int32,
                        device=device)
    table[:, :, :width] = prefix[:, None, :]
    # Draft j allowed for row i lands right after the prefix, at its rank among allowed drafts.
    rank = custom_mask.long().cumsum(dim=-1) - 1
    target = torch.where(custom_mask, lens[:, None, None] + rank, width + num_draft)
    source = draft_slots[:, None, :].expand(batch, num_draft, num_draft)
    table.scatter_(2, target, source.to(torch.int32))
    table = table[:, :, :width + num_draft].reshape(batch * num_draft, width + num_draft)
    table = table.contiguous()
    seqlens = (lens[:, None] + custom_mask.sum(dim=-1)).reshape(-1).to(torch.int32)
    return table, seqlens
