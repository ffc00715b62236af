"""Vertical-slash sparse attention (MInference, arXiv 2407.02490 appendix C.4.2), sgl-kernel's
and sgl-kernel-xpu's ``sparse_flash_attn`` surface: ``sparse_attn_func`` and the index builders
``convert_vertical_slash_indexes`` / ``convert_vertical_slash_indexes_mergehead``.

Layout (``rows = cdiv(seqlen, block_size_M)`` query blocks, ``H`` = query heads): for query block
row ``m`` of request ``b`` and head ``h``, the visible keys are the ``block_count[b, h, m]``
key blocks ``[block_offset[b, h, m, t], + block_size_N)`` and the ``column_count[b, h, m]``
single keys ``column_index[b, h, m, t]``, each inside ``[0, seqlen_k)``; ``causal`` adds the
bottom-right causal mask. Counts are clamped into ``[0, capacity]`` and out-of-range offsets
and columns are ignored, so no input reads outside the tensors.

Providers: reference only (plain PyTorch). These serve sglang's dual-chunk attention backend
and its tests, which are rarely hot; the index builders run on the host (per-row scans).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import (FLOAT_DTYPES, check_gqa, check_shape, check_size, check_tensor,
                       check_tensor_args, fail, int_scalar)
from .._registration import define_op
from .common import check_flag, check_out, default_softmax_scale, finite_scale, float_scalar

NAME = "sparse_attn_func"
CONVERT = "convert_vertical_slash_indexes"
CONVERT_MERGEHEAD = "convert_vertical_slash_indexes_mergehead"
_INDEX = (torch.int32, torch.int64)


def _cdiv(a, b):
    return (a + b - 1) // b


def _check_blocks(fn: str, block_size_M: int, block_size_N: int) -> None:
    for arg, value in (("block_size_M", block_size_M), ("block_size_N", block_size_N)):
        if value < 1:
            fail(fn, arg, "is not positive", f"{arg} >= 1 (tokens)", value)


def _check_sparse_attn(q, k, v, block_count, block_offset, column_count, column_index, out,
                       softmax_scale, softcap, block_size_M, block_size_N) -> None:
    """Validate shapes/dtypes/devices/scalars (runs in the fake too)."""
    fn = NAME
    finite_scale(fn, "softmax_scale", softmax_scale)
    if not softcap >= 0.0:
        fail(fn, "softcap", "is negative or NaN", "softcap >= 0 (0 disables it)", softcap)
    _check_blocks(fn, block_size_M, block_size_N)
    check_tensor(fn, "q", q, ndim=4, dtypes=FLOAT_DTYPES)
    device = q.device
    check_tensor(fn, "k", k, ndim=4, dtypes=(q.dtype,), device=device)
    check_tensor(fn, "v", v, ndim=4, dtypes=(q.dtype,), device=device)
    batch, seqlen_q, num_heads, head_dim = q.shape
    check_size(fn, "k", k, 0, batch, "q.shape[0] (b)")
    check_size(fn, "k", k, 3, head_dim, "q.shape[3] (D)")
    check_shape(fn, "v", v, (*k.shape[:3], v.shape[3]), "[b, seqlen_k, Hkv, Dv] as k")
    check_gqa(fn, num_heads, k.shape[2])
    check_tensor(fn, "block_count", block_count, ndim=3, dtypes=_INDEX, device=device)
    rows = block_count.shape[2]
    if rows * block_size_M < seqlen_q:
        fail(fn, "block_count", "has too few query block rows",
             f"block_count.shape[2] >= cdiv(seqlen_q, block_size_M) = "
             f"{_cdiv(seqlen_q, block_size_M)}", f"shape {tuple(block_count.shape)}")
    check_shape(fn, "block_count", block_count, (batch, num_heads, rows), "[b, Hq, rows]")
    check_tensor(fn, "column_count", column_count, ndim=3, dtypes=_INDEX, device=device)
    check_shape(fn, "column_count", column_count, (batch, num_heads, rows), "[b, Hq, rows]")
    for arg, t in (("block_offset", block_offset), ("column_index", column_index)):
        check_tensor(fn, arg, t, ndim=4, dtypes=_INDEX, device=device)
        check_shape(fn, arg, t, (batch, num_heads, rows, t.shape[3]), "[b, Hq, rows, NNZ]")
    check_out(fn, out, (batch, seqlen_q, num_heads, v.shape[3]), q.dtype, device,
              "[b, seqlen_q, Hq, Dv]")


@define_op("xpu_ops::sparse_attn_func", mutates_args=("out",), by_device=True)
def sparse_attn_func_op(q: Tensor, k: Tensor, v: Tensor, block_count: Tensor,
                        block_offset: Tensor, column_count: Tensor, column_index: Tensor,
                        out: Tensor, softmax_scale: float, causal: bool, softcap: float,
                        block_size_M: int, block_size_N: int) -> Tensor:
    """Op form of ``sparse_attn_func``: writes ``out``, returns ``softmax_lse [b, Hq, seqlen_q]``
    float32."""
    _check_sparse_attn(q, k, v, block_count, block_offset, column_count, column_index, out,
                       softmax_scale, softcap, block_size_M, block_size_N)


@sparse_attn_func_op.register_fake
def _(q, k, v, block_count, block_offset, column_count, column_index, out, softmax_scale,
      causal, softcap, block_size_M, block_size_N):
    _check_sparse_attn(q, k, v, block_count, block_offset, column_count, column_index, out,
                       softmax_scale, softcap, block_size_M, block_size_N)
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def sparse_attn_func(q, k, v, block_count, block_offset, column_count, column_index,
                     dropout_p=0.0, softmax_scale=None, causal=False, softcap=0.0,
                     alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                     return_softmax_lse=False, out=None, block_size_M=64, block_size_N=64):
    """Attention of each query block row over its vertical-slash key set (sgl-kernel
    ``sparse_flash_attn.sparse_attn_func``).

    Query row ``i`` (block row ``m = i // block_size_M``) of head ``h`` sees key ``j`` when ``j``
    lies in one of the first ``block_count[b, h, m]`` blocks ``[block_offset[b, h, m, t],
    block_offset[b, h, m, t] + block_size_N)`` or equals one of the first ``column_count[b, h,
    m]`` entries of ``column_index[b, h, m]``, ``0 <= j < seqlen_k``, and, with ``causal``,
    ``j <= i + seqlen_k - seqlen_q``. Scores ``softmax_scale * q.k`` (softcap as
    ``flash_attn_with_kvcache``); a row with no visible key gives 0 and LSE ``-inf``.

    Args:
        q: [b, seqlen_q, Hq, D] fp16|bf16|fp32. k: [b, seqlen_k, Hkv, D], v: [b, seqlen_k, Hkv,
            Dv] in q's dtype (GQA: ``Hq % Hkv == 0``).
        block_count, column_count: [b, Hq, rows] int32|int64, ``rows * block_size_M >=
            seqlen_q``. block_offset: [b, Hq, rows, NNZ_S]. column_index: [b, Hq, rows, NNZ_V].
        softmax_scale: default ``1/sqrt(D)``. causal, softcap: as above.
        dropout_p, alibi_slopes, deterministic, return_attn_probs: accepted at their defaults
            only (0.0, None, False, False; inference has no dropout).
        return_softmax_lse: also return ``softmax_lse [b, Hq, seqlen_q]`` float32 (natural log).
        out: optional ``[b, seqlen_q, Hq, Dv]`` output, written and returned.
        block_size_M, block_size_N: query rows per block row, keys per block (default 64).
    Returns:
        ``out`` or ``(out, softmax_lse)``.
    Raises:
        TypeError/ValueError (also RuntimeError): wrong kind, shape, dtype, device or scalar,
        naming the argument. NotImplementedError: dropout, ALiBi or attention probabilities.
    Source: MInference (Jiang et al., arXiv 2407.02490), vLLM's and sgl-kernel's
    ``sparse_attn_func`` layout.

    >>> import torch, xpu_ops
    >>> q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8)
    >>> i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    >>> o = xpu_ops.sparse_attn_func(q, k, v, i32([[[1]]]), i32([[[[0]]]]), i32([[[1]]]),
    ...                              i32([[[[5]]]]), block_size_M=4, block_size_N=2)
    >>> keys = [0, 1, 5]
    >>> ref = torch.softmax(q[0, :, 0] @ k[0, keys, 0].T / 8 ** 0.5, -1) @ v[0, keys, 0]
    >>> torch.allclose(o[0, :, 0], ref, atol=1e-6)
    True
    """
    fn = NAME
    check_tensor_args(fn, ("out",), q=q, k=k, v=v, block_count=block_count,
                      block_offset=block_offset, column_count=column_count,
                      column_index=column_index, out=out)
    if not (dropout_p == 0 and alibi_slopes is None and not deterministic
            and not return_attn_probs):
        raise NotImplementedError(
            f"{fn}: dropout_p, alibi_slopes, deterministic and return_attn_probs are accepted "
            f"for compatibility at their defaults only; expected 0.0, None, False, False, got "
            f"{dropout_p!r}, {'a tensor' if alibi_slopes is not None else None}, "
            f"{deterministic!r}, {return_attn_probs!r}. Inference attention has no dropout.")
    check_tensor(fn, "q", q, ndim=4)
    check_tensor(fn, "v", v, ndim=4)
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(q.shape[-1])
    causal = check_flag(fn, "causal", causal)
    return_softmax_lse = check_flag(fn, "return_softmax_lse", return_softmax_lse)
    if out is None:
        out = q.new_empty((*q.shape[:3], v.shape[3]))
    lse = torch.ops.xpu_ops.sparse_attn_func(
        q, k, v, block_count, block_offset, column_count, column_index, out,
        finite_scale(fn, "softmax_scale", softmax_scale), causal,
        float_scalar(fn, "softcap", softcap), int_scalar(fn, "block_size_M", block_size_M),
        int_scalar(fn, "block_size_N", block_size_N))
    return (out, lse) if return_softmax_lse else out


def _check_convert(fn, q_seqlens, kv_seqlens, vertical_indexes, slash_indexes,
                   vertical_indices_count, slash_indices_count, context_size, block_size_M,
                   block_size_N) -> None:
    """Validate the index builders' arguments (runs in the fake too)."""
    _check_blocks(fn, block_size_M, block_size_N)
    if context_size < 0:
        fail(fn, "context_size", "is negative", "context_size >= 0 (query tokens)", context_size)
    check_tensor(fn, "slash_indexes", slash_indexes, ndim=3, dtypes=_INDEX)
    device = slash_indexes.device
    batch, num_heads, _ = slash_indexes.shape
    check_tensor(fn, "vertical_indexes", vertical_indexes, ndim=3, dtypes=_INDEX, device=device)
    check_shape(fn, "vertical_indexes", vertical_indexes,
                (batch, num_heads, vertical_indexes.shape[2]), "[b, H, NNZ_V]")
    for arg, t, size, rule in (("q_seqlens", q_seqlens, batch, "b"),
                               ("kv_seqlens", kv_seqlens, batch, "b"),
                               ("vertical_indices_count", vertical_indices_count, num_heads, "H"),
                               ("slash_indices_count", slash_indices_count, num_heads, "H")):
        if t is not None:
            check_tensor(fn, arg, t, ndim=1, dtypes=_INDEX, device=device)
            check_size(fn, arg, t, 0, size, f"slash_indexes.shape[{0 if rule == 'b' else 1}] "
                                            f"({rule})")


@define_op("xpu_ops::convert_vertical_slash_indexes", mutates_args=(), by_device=True)
def convert_vertical_slash_indexes_op(
    q_seqlens: Tensor, kv_seqlens: Tensor, vertical_indexes: Tensor, slash_indexes: Tensor,
    vertical_indices_count: Optional[Tensor], slash_indices_count: Optional[Tensor],
    context_size: int, block_size_M: int, block_size_N: int, causal: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Op form of both index builders (the per-head counts given: the mergehead form)."""
    _check_convert(CONVERT, q_seqlens, kv_seqlens, vertical_indexes, slash_indexes,
                   vertical_indices_count, slash_indices_count, context_size, block_size_M,
                   block_size_N)


@convert_vertical_slash_indexes_op.register_fake
def _(q_seqlens, kv_seqlens, vertical_indexes, slash_indexes, vertical_indices_count,
      slash_indices_count, context_size, block_size_M, block_size_N, causal):
    _check_convert(CONVERT, q_seqlens, kv_seqlens, vertical_indexes, slash_indexes,
                   vertical_indices_count, slash_indices_count, context_size, block_size_M,
                   block_size_N)
    batch, heads, nnz_s = slash_indexes.shape
    rows, dtype = _cdiv(context_size, block_size_M), q_seqlens.dtype
    new = slash_indexes.new_empty
    return (new((batch, heads, rows), dtype=dtype), new((batch, heads, rows, nnz_s), dtype=dtype),
            new((batch, heads, rows), dtype=dtype),
            new((batch, heads, rows, vertical_indexes.shape[2]), dtype=dtype))


def convert_vertical_slash_indexes(q_seqlens, kv_seqlens, vertical_indexes, slash_indexes,
                                   context_size, block_size_M, block_size_N, causal=True):
    """Turn MInference's vertical (key columns, ascending) and slash (diagonal offsets,
    descending) indexes into ``sparse_attn_func``'s blocks and columns (sgl-kernel
    ``convert_vertical_slash_indexes``).

    For query block row ``m`` (rows ``[m BM, (m + 1) BM)``) of request ``b`` with ``q_len`` and
    ``kv_len`` tokens, slash ``s`` covers the key range ending at ``conv = kv_len - q_len + (m +
    1) BM - s`` (causal: at least ``BM``, slashes with ``s >= kv_len - q_len + (m + 1) BM`` are
    dropped; not causal: ``conv = kv_len + (m + 1) BM - s``), ``[conv - BM, conv)``. Ranges are
    merged in slash order (a range whose end is within ``BM`` of the current one extends it by
    ``BM``; a farther one starts a new range) and each merged range is stored as key blocks
    ``range_start, range_start + BN, ...`` below its end and ``kv_len``. Vertical columns that no
    range covers are stored as columns (causal: only columns before the causal limit). This is
    the CUDA kernel's two-pointer merge; counts never pass the capacities ``NNZ_S`` blocks and
    ``NNZ_V`` columns (further entries are dropped).

    Args:
        q_seqlens, kv_seqlens: [b] int32 tokens per request.
        vertical_indexes: [b, H, NNZ_V] int32 key columns, ascending.
        slash_indexes: [b, H, NNZ_S] int32 diagonal offsets, descending.
        context_size: query tokens covered (rows = cdiv(context_size, block_size_M)).
        block_size_M, block_size_N: query block rows and key block size.
        causal: bottom-right causal limits as above.
    Returns:
        ``(block_count [b, H, rows], block_offset [b, H, rows, NNZ_S], column_count [b, H,
        rows], column_index [b, H, rows, NNZ_V])`` in q_seqlens' dtype; unused entries 0.
    Raises:
        TypeError/ValueError (also RuntimeError): naming the argument.
    Source: MInference (arXiv 2407.02490) and vLLM's ``convert_vertical_slash_indexes`` kernel.

    >>> import torch, xpu_ops
    >>> i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    >>> bc, bo, cc, ci = xpu_ops.convert_vertical_slash_indexes(
    ...     i32([4]), i32([4]), i32([[[1, 3]]]), i32([[[0]]]), 4, 2, 2, causal=True)
    >>> bo[0, 0, :, 0].tolist(), bc[0, 0].tolist(), cc[0, 0].tolist(), ci[0, 0, 1, 0].item()
    ([0, 2], [1, 1], [0, 1], 1)
    """
    check_tensor_args(CONVERT, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
                      vertical_indexes=vertical_indexes, slash_indexes=slash_indexes)
    return torch.ops.xpu_ops.convert_vertical_slash_indexes(
        q_seqlens, kv_seqlens, vertical_indexes, slash_indexes, None, None,
        int_scalar(CONVERT, "context_size", context_size),
        int_scalar(CONVERT, "block_size_M", block_size_M),
        int_scalar(CONVERT, "block_size_N", block_size_N), check_flag(CONVERT, "causal", causal))


def convert_vertical_slash_indexes_mergehead(q_seqlens, kv_seqlens, vertical_indexes,
                                             slash_indexes, vertical_indices_count,
                                             slash_indices_count, context_size, block_size_M,
                                             block_size_N, causal=True):
    """``convert_vertical_slash_indexes`` where head ``h`` uses only its first
    ``vertical_indices_count[h]`` verticals and ``slash_indices_count[h]`` slashes ([H] int32,
    clamped to the index tensors' sizes) (sgl-kernel ``..._mergehead``).

    >>> import torch, xpu_ops
    >>> i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    >>> bc, bo, cc, ci = xpu_ops.convert_vertical_slash_indexes_mergehead(
    ...     i32([4]), i32([4]), i32([[[1, 3], [2, 0]]]), i32([[[2, 0], [1, 3]]]), i32([2, 1]),
    ...     i32([1, 2]), 4, 2, 2, causal=False)
    >>> bc.shape, ci.shape
    (torch.Size([1, 2, 2]), torch.Size([1, 2, 2, 2]))
    """
    check_tensor_args(CONVERT_MERGEHEAD, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
                      vertical_indexes=vertical_indexes, slash_indexes=slash_indexes,
                      vertical_indices_count=vertical_indices_count,
                      slash_indices_count=slash_indices_count)
    return torch.ops.xpu_ops.convert_vertical_slash_indexes(
        q_seqlens, kv_seqlens, vertical_indexes, slash_indexes, vertical_indices_count,
        slash_indices_count, int_scalar(CONVERT_MERGEHEAD, "context_size", context_size),
        int_scalar(CONVERT_MERGEHEAD, "block_size_M", block_size_M),
        int_scalar(CONVERT_MERGEHEAD, "block_size_N", block_size_N),
        check_flag(CONVERT_MERGEHEAD, "causal", causal))
