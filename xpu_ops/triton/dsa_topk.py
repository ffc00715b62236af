"""DSA top-k (``fast_topk``, ``fast_topk_transform``): one program per row, exact selection by
a radix search for the k-th largest score, then an in-order compaction.

Scores become order-preserving integer keys (float bits, negatives' magnitude bits flipped;
NaN as ``-inf``, ``-0.0`` as ``0.0``), shifted into ``[0, 2**32)`` as int64; positions past the
row's length get ``-2``. The k-th largest key ``T`` is found 8 bits at a time from the top (a
radix select: 4 passes over the row, each a ``tl.histogram`` of the 256 digits of the keys that
share the prefix found so far, ``RADIX_BLOCK`` keys a step; keys off the prefix are counted in
digit 0, a count the search never reads). The compaction pass keeps every key ``> T`` and
the first ``k - count(> T)`` keys ``== T`` (lower positions win ties), writing them in ascending
position through a running prefix sum, so the output equals the reference's bit for bit.
Rows with ``L <= topk`` skip the search: positions ``0 .. L-1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import provider_table
from ..index_k_layout import request_of_rows
from ._common import available, launch
from .dsa_indexer import declines_strided_rows

_BLOCK = 1024
_RADIX_BLOCK = 2048     # keys per histogram step of a radix pass
TOPK_WARPS = 8          # one program per row: warps in flight hide the row's load latency


@triton.jit
def _keys(SCORE, row_base, start, length, offs):
    # Order-preserving int64 keys of positions offs (-2 past the row's length).
    inside = offs < length
    v = tl.load(SCORE + row_base + start + offs, mask=inside, other=0.0)
    v = tl.where(v == v, v, float("-inf"))                             # NaN -> -inf
    v = tl.where(v == 0.0, 0.0, v)                                      # -0.0 -> 0.0
    bits = v.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648
    return tl.where(inside, ordered, -2)


@triton.jit
def _kth_key(SCORE, row_base, start, length, topk, BLOCK: tl.constexpr):
    # Radix select, 8 bits a pass from the top: T (the k-th largest key) and count(key > T).
    # Invariant: `above` keys have a prefix above T's, and above < topk <= above + (keys
    # sharing T's prefix), so one digit of each pass keeps topk inside.
    digits = tl.arange(0, 256)
    threshold = tl.full([], 0, tl.int64)
    above = tl.full([], 0, tl.int64)
    for p in range(4):
        shift = 24 - 8 * p
        counts = tl.zeros([256], tl.int32)
        for c in range(0, length, BLOCK):
            keys = _keys(SCORE, row_base, start, length, c + tl.arange(0, BLOCK))
            match = (keys >= 0) & ((keys >> (shift + 8)) == (threshold >> (shift + 8)))
            # keys off the prefix land in digit 0, whose count is never read: d = 0 is the
            # fallback when no higher digit keeps topk inside, and `above` sums digits > d
            digit = tl.where(match, (keys >> shift) & 255, 0).to(tl.int32)
            counts += tl.histogram(digit, 256)
        wide = counts.to(tl.int64)
        at_least = tl.sum(wide, axis=0) - tl.cumsum(wide, 0) + wide          # digit >= d
        d = tl.max(tl.where(above + at_least >= topk, digits, -1), axis=0)
        threshold = threshold | (d.to(tl.int64) << shift)
        above += tl.sum(tl.where(digits > d, wide, 0), axis=0)
    return threshold, above


@triton.jit
def _topk_kernel(
    SCORE, LENGTHS, STARTS, REQUEST, TABLE, OUT,
    stride_sr, stride_l, stride_st, stride_rq, stride_tb, stride_tc, stride_or,
    width, topk, table_rows, table_width,
    BLOCK: tl.constexpr, RADIX_BLOCK: tl.constexpr, HAS_STARTS: tl.constexpr,
    TRANSFORM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_base = row * stride_sr
    start = 0
    if HAS_STARTS:
        start = tl.minimum(tl.maximum(tl.load(STARTS + row * stride_st), 0), width)
    length = tl.minimum(tl.maximum(tl.load(LENGTHS + row * stride_l), 0), width - start)
    offs0 = tl.arange(0, BLOCK)
    # -1 padding after the min(topk, length) selected positions
    for c in range(0, topk, BLOCK):
        idx = c + offs0
        tl.store(OUT + row * stride_or + idx, tl.full([BLOCK], -1, tl.int32),
                 mask=(idx < topk) & (idx >= tl.minimum(length, topk)))
    threshold = tl.full([], -1, tl.int64)
    need = tl.full([], 0, tl.int64)
    if length > topk:
        threshold, above = _kth_key(SCORE, row_base, start, length, topk, RADIX_BLOCK)
        need = topk - above
    request = tl.full([], 0, tl.int64)
    if TRANSFORM:
        request = tl.load(REQUEST + row * stride_rq).to(tl.int64)
    # in-order compaction of the selected positions
    written = tl.full([], 0, tl.int64)
    ties = tl.full([], 0, tl.int64)
    for c in range(0, length, BLOCK):
        pos = c + offs0
        keys = _keys(SCORE, row_base, start, length, pos)
        tie = (keys == threshold).to(tl.int64)
        tie_rank = ties + tl.cumsum(tie, 0) - tie
        pick = (keys > threshold) | ((tie > 0) & (tie_rank < need))
        picked = pick.to(tl.int64)
        slot = written + tl.cumsum(picked, 0) - picked
        value = pos
        if TRANSFORM:
            known = (request >= 0) & (request < table_rows)        # a request covers the row
            mapped = (pos < table_width) & ((offs0 * 0 + known.to(tl.int32)) > 0)
            safe = tl.where(known, request, 0)
            value = tl.load(TABLE + safe * stride_tb + pos * stride_tc, mask=pick & mapped,
                            other=-1)
            value = tl.where(mapped, value, -1)
        tl.store(OUT + row * stride_or + slot, value.to(tl.int32), mask=pick)
        written += tl.sum(picked)
        ties += tl.sum(tie)


def _launch(score, lengths, row_starts, topk, request=None, table=None):
    rows, width = score.shape
    out = torch.empty((rows, topk), dtype=torch.int32, device=score.device)
    if rows == 0:
        return out
    starts = row_starts if row_starts is not None else lengths
    req = request if request is not None else lengths
    tbl = table if table is not None else lengths[:, None]
    launch(_topk_kernel, (rows,), score.device,
           score, lengths, starts, req, tbl, out,
           score.stride(0), lengths.stride(0), starts.stride(0), req.stride(0), tbl.stride(0),
           tbl.stride(1), out.stride(0), width, topk, tbl.shape[0], tbl.shape[1],
           BLOCK=_BLOCK, RADIX_BLOCK=_RADIX_BLOCK, HAS_STARTS=row_starts is not None,
           TRANSFORM=table is not None,
           num_warps=TOPK_WARPS)
    return out


def fast_topk(score, lengths, row_starts, topk):
    """Launch ``_topk_kernel`` with one program per row; ``score`` needs unit column stride."""
    return _launch(score, lengths, row_starts, topk)


def fast_topk_transform(score, lengths, page_table, cu_seqlens_q, row_starts, topk):
    """``fast_topk`` with each position looked up in its request's page-table row; the
    request of each row (``-1``: none) comes from one ``searchsorted`` on the device."""
    request = request_of_rows(cu_seqlens_q, score.shape[0], page_table.shape[0])
    return _launch(score, lengths, row_starts, topk, request, page_table)


def _supports(score, *args):
    return declines_strided_rows(score=score)


provider_table.register("fast_topk", "triton", available=available,
                        supports=_supports)(fast_topk)
provider_table.register("fast_topk_transform", "triton", available=available,
                        supports=_supports)(fast_topk_transform)
