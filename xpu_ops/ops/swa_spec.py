"""``prepare_swa_spec_page_table``: one token-granular page table per draft row.

Target verification with a draft tree (``topk > 1``) on a sliding-window layer cannot use the
cascade split (prefix pass + expand pass) because the window is relative to each draft's own
position. Instead every draft row gets its own sequence: the request's prefix slots followed by
the slots of the drafts its tree mask allows (its ancestors and itself), so one attention call
with ``q_len = 1`` per row, bottom-right alignment and the layer's window is exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _value_checks
from .._registration import define_op
from .._checks import check_shape, check_size, check_tensor, check_tensor_args
from .common import check_index

NAME = "prepare_swa_spec_page_table"


def _check_prepare_swa_spec_page_table(page_table, prefix_lens, draft_slots, custom_mask):
    """Validate shapes/dtypes/devices (runs in the fake too)."""
    fn = NAME
    check_index(fn, "page_table", page_table, 2, None)
    device = page_table.device
    batch = page_table.shape[0]
    check_index(fn, "prefix_lens", prefix_lens, 1, device)
    check_size(fn, "prefix_lens", prefix_lens, 0, batch, "page_table.shape[0] (b)")
    check_index(fn, "draft_slots", draft_slots, 2, device)
    check_size(fn, "draft_slots", draft_slots, 0, batch, "page_table.shape[0] (b)")
    num_draft = draft_slots.shape[1]
    check_tensor(fn, "custom_mask", custom_mask, ndim=3, dtypes=(torch.bool,), device=device)
    check_shape(fn, "custom_mask", custom_mask, (batch, num_draft, num_draft),
                "[b, num_draft_tokens, num_draft_tokens]")


@define_op("xpu_ops::prepare_swa_spec_page_table", mutates_args=(), by_device=True)
def prepare_swa_spec_page_table_op(page_table: Tensor, prefix_lens: Tensor, draft_slots: Tensor,
                                   custom_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Op form of ``prepare_swa_spec_page_table``; returns two new tensors."""
    _check_prepare_swa_spec_page_table(page_table, prefix_lens, draft_slots, custom_mask)


@prepare_swa_spec_page_table_op.register_fake
def _(page_table, prefix_lens, draft_slots, custom_mask):
    _check_prepare_swa_spec_page_table(page_table, prefix_lens, draft_slots, custom_mask)
    rows = page_table.shape[0] * draft_slots.shape[1]
    width = page_table.shape[1] + draft_slots.shape[1]
    return (page_table.new_empty((rows, width)), page_table.new_empty((rows,)))


def prepare_swa_spec_page_table(page_table, prefix_lens, draft_slots, custom_mask):
    """Build one token-granular page table per draft token for tree-masked target verify.

    Row ``r * D + i`` holds the request's first ``prefix_lens[r]`` token slots, then the slots
    ``draft_slots[r, j]`` of every draft ``j`` with ``custom_mask[r, i, j]``, in order of ``j``
    (ancestors precede descendants in sglang's tree order, so the row's last key is draft ``i``
    at position ``prefix_lens[r] + depth(i)``). Entries past the row's length are 0 and never
    read. Use it with a page_size-1 view of the cache (``k_cache.view(-1, 1, Hkv, D)``).

    Args:
        page_table: [b, P] int32 token slots of each request's prefix (page_size 1, e.g.
            ``req_to_token[req_pool_indices]``, translated to the SWA pool when it has one).
        prefix_lens: [b] int32 prefix length in tokens (<= P; checked only with
            ``XPU_OPS_DEBUG_CHECKS=1``).
        draft_slots: [b, D] int32 token slots of the D draft tokens of each request.
        custom_mask: [b, D, D] bool tree mask, ``[r, i, j]`` = draft i may attend to draft j.
    Returns:
        ``(page_table [b * D, P + D] int32, cache_seqlens [b * D] int32)``.
    Raises:
        TypeError/ValueError: wrong kind, shape, dtype or device, naming the argument.
    Source: sglang FlashAttention backend, SWA target-verify with topk > 1 (per-draft tables).

    >>> import torch, xpu_ops
    >>> i32 = dict(dtype=torch.int32)
    >>> mask = torch.tensor([[[1, 0], [1, 1]]], dtype=torch.bool)
    >>> pt, lens = xpu_ops.prepare_swa_spec_page_table(torch.tensor([[7, 8, 9]], **i32),
    ...     torch.tensor([2], **i32), torch.tensor([[20, 21]], **i32), mask)
    >>> pt.tolist(), lens.tolist()
    ([[7, 8, 20, 0, 0], [7, 8, 20, 21, 0]], [3, 4])
    """
    check_tensor_args(NAME, page_table=page_table, prefix_lens=prefix_lens,
                      draft_slots=draft_slots, custom_mask=custom_mask)
    _value_checks.check_prepare_swa_spec_page_table(page_table, prefix_lens)
    return torch.ops.xpu_ops.prepare_swa_spec_page_table(page_table, prefix_lens, draft_slots,
                                                         custom_mask)
