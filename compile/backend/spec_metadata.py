"""Metadata of speculative-decoding steps: target verify and draft decode, chains and trees.

Chains (``topk == 1``) are ordinary causal attention over ``req_to_token``, which already holds
the draft tokens' slots. Trees (``topk > 1``) use cascade attention, as sglang's FlashAttention
backend: a *prefix* pass of every draft/branch query over the request's cached prefix
(non-causal, with LSE) and an *expand* pass of each query over the draft tokens it may see, on a
token-slot table (page_size 1 view), merged with ``merge_state_v2``. Sliding-window and
chunked-local layers cannot split a tree by position; they take one merged row per query
instead (``compile/backend/spec_rows.py``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from compile.backend.attention_metadata import (PagedAttnMetadata, paged_metadata,
                                                uniform_cu_seqlens)


def draft_mask(custom_mask: Tensor, seq_lens: Tensor, num_draft: int) -> Tensor:
    """The draft-to-draft tree mask ``[b, D, D]`` bool from sglang's or the 3-D layout.

    Args:
        custom_mask: ``[b, D, D]`` bool, or sglang's flattened mask: per request a row-major
            ``[D, seq_len + D]`` block (prefix columns then draft columns), concatenated.
        seq_lens: [b] prefix lengths (device). num_draft: D.
    """
    if custom_mask.dim() == 3:
        return custom_mask.to(torch.bool)
    b, d = seq_lens.shape[0], num_draft
    lens = seq_lens.long()
    block = d * (lens + d)
    start = torch.cumsum(block, 0) - block
    i = torch.arange(d, device=lens.device)
    index = (start[:, None, None] + i[None, :, None] * (lens + d)[:, None, None]
             + lens[:, None, None] + i[None, None, :])
    return custom_mask.to(torch.bool)[index.reshape(-1)].view(b, d, d)


def padded_spec_info(spec_info, seq_lens: Tensor, batch_size: int):
    """``spec_info`` of a batch padded to ``batch_size`` requests (a graph bucket).

    A tree mask (either layout) becomes ``[batch_size, D, D]`` bool: the real requests' rows,
    then padded requests whose drafts each see only themselves (their slots are the padding
    slot). Anything else is returned unchanged.

    Args:
        spec_info: a ``SpecInfo`` or None. seq_lens: [b] prefix lengths of the real requests
            (decode sglang's flattened mask). batch_size: the bucket, ``>= b``.
    """
    if spec_info is None or spec_info.custom_mask is None:
        return spec_info
    mask = spec_info.custom_mask
    d = mask.shape[-1] if mask.dim() == 3 else spec_info.draft_token_num
    mask = draft_mask(mask, seq_lens, d)
    eye = torch.eye(d, dtype=torch.bool, device=mask.device)
    pad = eye.expand(batch_size - mask.shape[0], d, d)
    return dataclasses.replace(spec_info, custom_mask=torch.cat([mask, pad]))


def expand_metadata(slots: Tensor, visible: Tensor) -> PagedAttnMetadata:
    """Expand pass: one query per row over the slots it may see (page_size 1 table).

    Args:
        slots: [n, W] token slots of the candidate keys of each query row.
        visible: [n, W] bool, which of them the row sees (gathered first, in column order).
    """
    order = torch.sort((~visible).to(torch.int8), dim=1, stable=True).indices
    table = slots.long().gather(1, order).to(torch.int32)
    lens = visible.sum(1).to(torch.int32)
    n, width = slots.shape
    return PagedAttnMetadata(cu_seqlens_q=uniform_cu_seqlens(n, 1, slots.device),
                             cache_seqlens=lens, page_table=table, max_seqlen_q=1,
                             max_seqlen_k=width, page_size=1)


def prefix_metadata(fb, req_to_token: Tensor, page_size: int, num_q: int, *, extra_k: int = 0
                    ) -> PagedAttnMetadata:
    """``num_q`` queries per request over its ``seq_lens`` cached tokens plus ``extra_k`` more
    (draft tokens whose slots ``req_to_token`` already holds)."""
    b = fb.batch_size
    cu_q = uniform_cu_seqlens(b, num_q, fb.seq_lens.device)
    max_k = int(fb.seq_lens_cpu.max()) + extra_k if b else 0
    seq_lens = fb.seq_lens + extra_k if extra_k else fb.seq_lens
    return paged_metadata(req_to_token, fb.req_pool_indices, cu_q, seq_lens, num_q, max_k,
                          page_size)


def verify_chain(fb, req_to_token: Tensor, page_size: int, num_draft: int) -> PagedAttnMetadata:
    """Target verify, topk 1: D causal queries per request over prefix + D drafts."""
    return prefix_metadata(fb, req_to_token, page_size, num_draft, extra_k=num_draft)


def verify_tree(fb, req_to_token: Tensor, page_size: int, num_draft: int
                ) -> tuple[PagedAttnMetadata, PagedAttnMetadata, Tensor]:
    """Target verify, topk > 1: (prefix pass, expand pass, draft mask ``[b, D, D]``)."""
    b = fb.batch_size
    prefix = prefix_metadata(fb, req_to_token, page_size, num_draft)
    mask = draft_mask(fb.spec_info.custom_mask, fb.seq_lens, num_draft)
    slots = fb.out_cache_loc.view(b, 1, num_draft).expand(b, num_draft, num_draft)
    expand = expand_metadata(slots.reshape(b * num_draft, num_draft),
                             mask.reshape(b * num_draft, num_draft))
    return prefix, expand, mask


def draft_decode_chain(fb, req_to_token: Tensor, page_size: int, step_id: int
                       ) -> PagedAttnMetadata:
    """Draft decode, topk 1: one query per request over prefix + ``step_id + 1`` drafts."""
    return prefix_metadata(fb, req_to_token, page_size, 1, extra_k=step_id + 1)


def draft_decode_tree(fb, req_to_token: Tensor, page_size: int, topk: int, step_id: int,
                      num_steps: int) -> tuple[PagedAttnMetadata, PagedAttnMetadata]:
    """Draft decode, topk > 1: (prefix pass with ``topk`` queries per request, non-causal;
    expand pass of each branch over its own ``step_id + 1`` draft slots).

    ``out_cache_loc`` holds the round's slots laid out ``(b, topk, num_steps)``.
    """
    prefix = prefix_metadata(fb, req_to_token, page_size, topk)
    slots = fb.out_cache_loc.view(fb.batch_size * topk, num_steps)[:, :step_id + 1]
    visible = torch.ones(slots.shape, dtype=torch.bool, device=fb.seq_lens.device)
    return prefix, expand_metadata(slots, visible)


def draft_write_loc(out_cache_loc: Tensor, rows: int, num_steps: int, step_id: int
                    ) -> Tensor:
    """Slots this draft step writes: column ``step_id`` of a ``(rows, num_steps)`` round layout,
    or ``out_cache_loc`` itself when it already holds one slot per row."""
    if out_cache_loc.numel() == rows or num_steps <= 1:
        return out_cache_loc
    return out_cache_loc.view(rows, num_steps)[:, step_id]


__all__ = ["draft_mask", "padded_spec_info", "expand_metadata", "prefix_metadata", "verify_chain",
           "verify_tree", "draft_decode_chain", "draft_decode_tree", "draft_write_loc"]
