"""DSA top-k: the ``topk`` highest-scoring keys of each indexer row (sgl-kernel's ``fast_topk``
family), as positions in the row or mapped to KV-cache slots through a page table.

Selection rule (every provider, bit for bit): row ``i`` considers positions ``p`` in
``[0, L)`` with ``L = lengths[i]`` clamped into ``[0, width - row_starts[i]]``
(``width = score.shape[1]``; ``row_starts`` defaults to 0), its score being
``score[i, row_starts[i] + p]``. NaN counts as ``-inf`` and ``-0.0`` as ``0.0``. The selected
set is the ``min(topk, L)`` positions of highest score; among equal scores the lower position
wins. The row lists them in ascending position order, then ``-1`` up to ``topk``. So a row with
``L <= topk`` is ``0, 1, ..., L - 1, -1, ...`` (sgl-kernel's fast path). Nothing is mutated.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import check_size, check_tensor, check_tensor_args, fail, int_scalar
from .._registration import define_op
from .common import check_index

TOPK = "fast_topk"
TRANSFORM = "fast_topk_transform"
_INT32_MAX = 2**31 - 1


def _check_rows(fn: str, score, lengths, row_starts, topk) -> None:
    check_tensor(fn, "score", score, ndim=2, dtypes=(torch.float32,))
    device, rows = score.device, score.shape[0]
    check_index(fn, "lengths", lengths, 1, device)
    check_size(fn, "lengths", lengths, 0, rows, "score.shape[0] (rows)")
    if row_starts is not None:
        check_index(fn, "row_starts", row_starts, 1, device)
        check_size(fn, "row_starts", row_starts, 0, rows, "score.shape[0] (rows)")
    if int_scalar(fn, "topk", topk, "an int > 0") <= 0:
        fail(fn, "topk", "is not positive", "an int > 0 (keys per row)", topk)


@define_op("xpu_ops::fast_topk", mutates_args=(), by_device=True)
def fast_topk_op(score: Tensor, lengths: Tensor, row_starts: Optional[Tensor], topk: int) -> Tensor:
    """Op form of ``fast_topk_v2`` (the checks; the provider of score's device computes)."""
    _check_rows(TOPK, score, lengths, row_starts, topk)


@fast_topk_op.register_fake
def _(score, lengths, row_starts, topk):
    _check_rows(TOPK, score, lengths, row_starts, topk)
    return score.new_empty((score.shape[0], topk), dtype=torch.int32)


def _check_transform(score, lengths, page_table, cu_seqlens_q, row_starts, topk) -> None:
    fn = TRANSFORM
    _check_rows(fn, score, lengths, row_starts, topk)
    check_index(fn, "page_table", page_table, 2, score.device)
    check_index(fn, "cu_seqlens_q", cu_seqlens_q, 1, score.device)
    check_size(fn, "cu_seqlens_q", cu_seqlens_q, 0, page_table.shape[0] + 1,
               "page_table.shape[0] + 1 (b + 1)")


@define_op("xpu_ops::fast_topk_transform", mutates_args=(), by_device=True)
def fast_topk_transform_op(score: Tensor, lengths: Tensor, page_table: Tensor,
                           cu_seqlens_q: Tensor, row_starts: Optional[Tensor],
                           topk: int) -> Tensor:
    """Op form of ``fast_topk_transform_fused`` (the checks; the provider computes)."""
    _check_transform(score, lengths, page_table, cu_seqlens_q, row_starts, topk)


@fast_topk_transform_op.register_fake
def _(score, lengths, page_table, cu_seqlens_q, row_starts, topk):
    _check_transform(score, lengths, page_table, cu_seqlens_q, row_starts, topk)
    return score.new_empty((score.shape[0], topk), dtype=torch.int32)


def _topk(fn: str, topk) -> int:
    value = int_scalar(fn, "topk", topk, "an int > 0")
    if value <= 0:
        fail(fn, "topk", "is not positive", "an int > 0 (keys per row)", topk)
    return value


def fast_topk_v2(score, lengths, topk, row_starts=None):
    """Positions of the ``topk`` best keys of each row (sgl-kernel ``fast_topk_v2``).

    Selection and order: the module docstring (ties: lower position wins; ascending positions;
    ``-1`` padding). Positions are relative to ``row_starts`` (the row's key range in ragged
    logits), as sgl-kernel returns them. Any ``topk > 0`` (sgl-kernel: 2048 only).

    Args:
        score: [rows, width] float32 logits (``fp8_mqa_logits``/``fp8_paged_mqa_logits``).
        lengths: [rows] int32 keys per row.
        topk: int > 0.
        row_starts: optional [rows] int32 first column of each row's range.
    Returns:
        [rows, topk] int32, a new tensor.
    Raises:
        TypeError/ValueError: wrong kind, shape or dtype, naming the argument.
    Source: DeepSeek-V3.2 (DSA top-k selection); sgl-kernel ``fast_topk_v2``.

    >>> import torch, xpu_ops
    >>> score = torch.tensor([[0.5, 3.0, 1.0, 3.0, 2.0], [1.0, 0.0, 9.0, 9.0, 9.0]])
    >>> xpu_ops.fast_topk_v2(score, torch.tensor([5, 2], dtype=torch.int32), 3).tolist()
    [[1, 3, 4], [0, 1, -1]]
    """
    check_tensor_args(TOPK, ("row_starts",), score=score, lengths=lengths, row_starts=row_starts)
    return torch.ops.xpu_ops.fast_topk(score, lengths, row_starts, _topk(TOPK, topk))


def fast_topk_transform_fused(score, lengths, page_table_size_1, cu_seqlens_q, topk,
                              row_starts=None):
    """``fast_topk_v2``'s positions mapped to KV-cache slots (sgl-kernel
    ``fast_topk_transform_fused``): what sparse MLA reads.

    Row ``i`` belongs to request ``r`` with ``cu_seqlens_q[r] <= i < cu_seqlens_q[r + 1]``; a
    selected position ``p`` becomes ``page_table_size_1[r, p]`` (the request's token-granular
    page table, sglang's ``req_to_token`` row, page size 1). ``-1`` stays ``-1``, and so does a
    position at or past the table's width or a row no request covers.

    Args:
        score, lengths, topk, row_starts: as ``fast_topk_v2``.
        page_table_size_1: [b, max_len] int32 slot of each request's token position.
        cu_seqlens_q: [b + 1] int32 prefix sums of the rows per request.
    Returns:
        [rows, topk] int32 slots, a new tensor.
    Raises:
        TypeError/ValueError: wrong kind, shape or dtype, naming the argument.
    Source: sgl-kernel ``fast_topk_transform_fused`` (sglang's DSA backend).

    >>> import torch, xpu_ops
    >>> score = torch.tensor([[0.5, 3.0, 1.0], [1.0, 0.0, 9.0]])
    >>> table = torch.tensor([[70, 71, 72], [80, 81, 82]], dtype=torch.int32)
    >>> cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    >>> lengths = torch.tensor([3, 3], dtype=torch.int32)
    >>> xpu_ops.fast_topk_transform_fused(score, lengths, table, cu, 2).tolist()
    [[71, 72], [80, 82]]
    """
    check_tensor_args(TRANSFORM, ("row_starts",), score=score, lengths=lengths,
                      page_table_size_1=page_table_size_1, cu_seqlens_q=cu_seqlens_q,
                      row_starts=row_starts)
    return torch.ops.xpu_ops.fast_topk_transform(score, lengths, page_table_size_1,
                                                 cu_seqlens_q, row_starts,
                                                 _topk(TRANSFORM, topk))


def fast_topk_transform_ragged_fused(score, lengths, topk_indices_offset, topk, row_starts=None):
    """``fast_topk_v2``'s positions plus ``topk_indices_offset[i]`` (the row's first key in the
    ragged KV), ``-1`` kept (sgl-kernel ``fast_topk_transform_ragged_fused``). A sum outside
    ``[0, 2**31)`` (a negative or huge offset) is ``-1`` too, never a wrapped int32.

    Args:
        score, lengths, topk, row_starts: as ``fast_topk_v2``.
        topk_indices_offset: [rows] int32.
    Returns:
        [rows, topk] int32, a new tensor.
    Raises:
        TypeError/ValueError: wrong kind, shape or dtype, naming the argument.

    >>> import torch, xpu_ops
    >>> score = torch.tensor([[0.5, 3.0, 1.0]])
    >>> xpu_ops.fast_topk_transform_ragged_fused(score, torch.tensor([3], dtype=torch.int32),
    ...     torch.tensor([100], dtype=torch.int32), 2).tolist()
    [[101, 102]]
    """
    fn = "fast_topk_transform_ragged_fused"
    check_tensor_args(fn, ("row_starts",), score=score, topk_indices_offset=topk_indices_offset)
    check_index(fn, "topk_indices_offset", topk_indices_offset, 1, score.device)
    check_size(fn, "topk_indices_offset", topk_indices_offset, 0, score.shape[0],
               "score.shape[0] (rows)")
    positions = fast_topk_v2(score, lengths, topk, row_starts)
    slots = positions.long() + topk_indices_offset.long()[:, None]     # no int32 wrap-around
    valid = (positions >= 0) & (slots >= 0) & (slots <= _INT32_MAX)
    return torch.where(valid, slots, -1).to(torch.int32)


__all__ = ["fast_topk_v2", "fast_topk_transform_fused", "fast_topk_transform_ragged_fused"]
