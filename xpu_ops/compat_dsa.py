"""sgl-kernel-xpu's DSA-indexer modules on xpu-ops (the shim's ``sgl_kernel.top_k``,
``sgl_kernel.nsa`` and ``sgl_kernel.fp8_paged_mqa_logits``), thin wrappers over xpu-ops' ops.

sgl-kernel-xpu's forms differ from DeepGEMM's (``xpu_ops.fp8_mqa_logits`` /
``fp8_paged_mqa_logits``) in two ways, kept here as sgl-kernel-xpu has them:

* positions outside a query's key range are ``0.0``, not ``-inf``;
* ``nsa.fp8_paged_mqa_logits`` (and the raw op ``torch.ops.sgl_kernel.fp8_paged_mqa_logits``)
  read a *per-token* cache ``uint8 [num_pages, page_size, 1, D + 4]``: each token's ``D`` fp8
  bytes followed by its float32 scale (``src/sycl/kernels/nsa/fp8_mqa_logits_kernel.hpp``);
  ``fp8_paged_mqa_logits_triton`` reads DeepGEMM's page layout (``xpu_ops.index_k_layout``).

``topk_transform_512`` / ``_v2`` (sglang's DeepSeek-V4 top-k then page mapping) run
``xpu_ops.fast_topk_v2``'s selection (any ``topk``) and map positions through the page table.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._checks import (XpuOpsValueError, check_size, check_tensor, check_tensor_args,
                      check_writable, fail, int_scalar)
from .index_k_layout import tokens_to_blocks
from .ops.common import check_index

FP8_DTYPE = torch.float8_e4m3fn
#: ``sgl_kernel.nsa``'s head-loop threshold: read and patched by sgl-kernel-xpu's tests; it only
#: changes how sgl-kernel-xpu splits its work, never a result, and xpu-ops ignores it.
HEAD_LOOP_THRESHOLD = 1 << 27
#: ``sgl_kernel.top_k``'s top-k widths of ``fast_topk_v2`` (sglang's QSA reads it; any works).
FAST_TOPK_SUPPORTED_K = (512, 1024, 2048)
_FP8_BYTES = (torch.uint8, FP8_DTYPE)


class AssertionValueError(XpuOpsValueError, AssertionError):
    """A house ``ValueError`` that is also ``AssertionError``: the limits that
    sgl-kernel-xpu's ``fp8_paged_mqa_logits_triton`` asserts."""


def _zero_outside(logits: Tensor) -> Tensor:
    """xpu-ops marks keys outside a row's range ``-inf``; sgl-kernel-xpu writes 0 there."""
    return logits.masked_fill(logits == float("-inf"), 0.0)


def _fp8_bytes(fn: str, arg: str, t) -> Tensor:
    check_tensor(fn, arg, t, dtypes=_FP8_BYTES)
    return t.view(torch.uint8)


def fp8_mqa_logits_impl(q_fp8, k_fp8, k_scale, weights, ks, ke) -> Tensor:
    """sgl-kernel-xpu ``nsa._fp8_mqa_logits_impl``: ``xpu_ops.fp8_mqa_logits`` with 0 outside.

    ``logits[i, j] = k_scale[j] * sum_h relu(q[i, h] . k[j]) * weights[i, h]`` for
    ``ks[i] <= j < ke[i]``, else 0.0. ``q_fp8 [Nq, H, D]``, ``k_fp8 [Nk, D]`` fp8 e4m3 (or its
    uint8 bytes), ``k_scale [Nk]``/``weights [Nq, H]`` float32, ``ks``/``ke [Nq]`` int32.
    Returns float32 ``[Nq, Nk]``.
    """
    import xpu_ops
    return _zero_outside(xpu_ops.fp8_mqa_logits(q_fp8, (k_fp8, k_scale), weights, ks, ke))


def fp8_mqa_logits(q_fp8, kv_fp8, weights, ks, ke, clean_logits=False) -> Tensor:
    """sgl-kernel-xpu ``nsa.fp8_mqa_logits``: ``kv_fp8 = (k_fp8, k_scale)``; ``clean_logits``
    is accepted and ignored (positions outside ``[ks, ke)`` are always 0.0).

    Raises:
        TypeError (also RuntimeError): q or k neither uint8 nor float8_e4m3fn.

    >>> import torch
    >>> from xpu_ops import compat_dsa
    >>> q, k = torch.ones(1, 1, 4).to(torch.float8_e4m3fn), torch.ones(3, 4).to(torch.float8_e4m3fn)
    >>> compat_dsa.fp8_mqa_logits(q, (k, torch.full((3,), 0.5)), torch.ones(1, 1),
    ...     torch.tensor([1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)).tolist()
    [[0.0, 2.0, 0.0]]
    """
    k_fp8, k_scale = kv_fp8
    for arg, t in (("q_fp8", q_fp8), ("k_fp8", k_fp8)):
        if not isinstance(t, Tensor) or t.dtype not in _FP8_BYTES:
            fail("fp8_mqa_logits", arg, "is not fp8", "uint8 or float8_e4m3fn",
                 getattr(t, "dtype", type(t).__name__), exc=TypeError)
    return fp8_mqa_logits_impl(q_fp8, k_fp8, k_scale, weights, ks, ke)


def _paged_inputs(fn: str, q_fp8, kv_cache, seq_lens):
    check_tensor_args(fn, q_fp8=q_fp8, kv_cache=kv_cache, seq_lens=seq_lens)
    q = _fp8_bytes(fn, "q_fp8", q_fp8)
    check_tensor(fn, "q_fp8", q, ndim=(3, 4))
    if q.dim() == 3:                   # [B, H, D]: next_n = 1
        q = q.unsqueeze(1)
    kv = _fp8_bytes(fn, "kv_cache", kv_cache)
    check_tensor(fn, "kv_cache", kv, ndim=4)
    if seq_lens.dim() == 2:            # [B, 1]
        check_size(fn, "seq_lens", seq_lens, 1, 1, "1 ([B] or [B, 1])")
        seq_lens = seq_lens[:, 0]
    return q.view(FP8_DTYPE), kv, seq_lens


def check_paged_call(q_fp8, kv_cache, weights, seq_lens, block_tables, max_seq_len) -> None:
    """The checks of ``fp8_paged_mqa_logits`` (run by the raw op's fake too)."""
    from .ops.dsa_indexer import _check_fp8_paged_mqa_logits
    fn = "fp8_paged_mqa_logits"
    q, kv, seq_lens = _paged_inputs(fn, q_fp8, kv_cache, seq_lens)
    # this call's names first (xpu-ops' op calls them context_lens, block_table, ...)
    check_tensor(fn, "seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=q.device,
                 fix="Build it with dtype=torch.int32.")
    check_size(fn, "seq_lens", seq_lens, 0, q.shape[0], "q_fp8.shape[0] (B)")
    check_index(fn, "block_tables", block_tables, 2, q.device)
    check_size(fn, "block_tables", block_tables, 0, q.shape[0], "q_fp8.shape[0] (B)")
    if int_scalar(fn, "max_seq_len", max_seq_len, "an int >= 0") < 0:
        fail(fn, "max_seq_len", "is negative", "an int >= 0 (the logits' width)", max_seq_len)
    _check_fp8_paged_mqa_logits(q, kv, weights, seq_lens, block_tables, max_seq_len, False)


def fp8_paged_mqa_logits(q_fp8, kv_cache, weights, seq_lens, block_tables, schedule_metadata,
                         max_seq_len, clean_logits=False) -> Tensor:
    """sgl-kernel-xpu ``nsa.fp8_paged_mqa_logits`` (and its raw op): decode logits over the
    *per-token* cache (module docstring), 0.0 past each request's ``seq_lens``.

    Args:
        q_fp8: ``[B, 1, H, D]`` or ``[B, H, D]`` fp8 e4m3 (or uint8 bytes).
        kv_cache: uint8 (or fp8 view) ``[num_pages, page_size, 1, D + 4]`` per-token layout.
        weights: ``[B, H]`` float32. seq_lens: ``[B]`` or ``[B, 1]`` int32.
        block_tables: ``[B, max_blocks]`` int32. schedule_metadata, clean_logits: ignored.
        max_seq_len: width of the result.
    Returns:
        float32 ``[B, max_seq_len]``. The cache is converted to the block layout first (a copy
        of the cache per call: a compatibility path, not a fast one).
    Raises:
        TypeError/ValueError (also RuntimeError): as ``xpu_ops.fp8_paged_mqa_logits``.
    """
    import xpu_ops
    check_paged_call(q_fp8, kv_cache, weights, seq_lens, block_tables, max_seq_len)
    q, kv, seq_lens = _paged_inputs("fp8_paged_mqa_logits", q_fp8, kv_cache, seq_lens)
    blocks = tokens_to_blocks(kv)
    return _zero_outside(xpu_ops.fp8_paged_mqa_logits(q, blocks, weights, seq_lens,
                                                      block_tables, None, max_seq_len))


def fp8_paged_mqa_logits_triton(q_fp8, kvcache_fp8, weight, seq_lens, page_table,
                                deep_gemm_metadata, max_seq_len, clean_logits=True) -> Tensor:
    """sgl-kernel-xpu ``fp8_paged_mqa_logits_triton`` (DeepSeek-V4's indexer): decode logits over
    DeepGEMM's block layout (``xpu_ops.index_k_layout``), 0.0 past each ``seq_lens``.

    Keeps the original's limits: ``D = 128``, 64-token pages, ``q [B, 1, H, D]`` and
    ``clean_logits=False`` (the default True is refused, as there).

    Returns:
        float32 ``[B, max_seq_len]`` (``xpu_ops.fp8_paged_mqa_logits`` with 0 for -inf).
    Raises:
        AssertionValueError (ValueError, RuntimeError and AssertionError): a limit above.
    """
    import xpu_ops
    fn = "fp8_paged_mqa_logits_triton"
    check_tensor_args(fn, q_fp8=q_fp8, kvcache_fp8=kvcache_fp8)
    rules = ((q_fp8.dim() == 4 and q_fp8.shape[1] == 1, "q_fp8", "[B, 1, H, D]",
              tuple(q_fp8.shape)),
             (q_fp8.shape[-1] == 128, "q_fp8", "head dim D = 128", q_fp8.shape[-1]),
             (kvcache_fp8.dim() == 4 and kvcache_fp8.shape[1] == 64, "kvcache_fp8",
              "64-token pages [P, 64, 1, D + 4]", tuple(kvcache_fp8.shape)),
             (clean_logits is False or clean_logits == 0, "clean_logits", "False", clean_logits))
    for ok, arg, rule, got in rules:
        if not ok:
            fail(fn, arg, "is outside this kernel's limits", rule, got, exc=AssertionValueError)
    q, kv, seq_lens = _paged_inputs(fn, q_fp8, kvcache_fp8, seq_lens)
    return _zero_outside(xpu_ops.fp8_paged_mqa_logits(q, kv, weight, seq_lens, page_table, None,
                                                      max_seq_len))


def _check_transform(fn, scores, seq_lens, page_tables, out_page_indices, page_size,
                     out_raw_indices) -> int:
    check_tensor_args(fn, ("out_raw_indices",), scores=scores, seq_lens=seq_lens,
                      page_tables=page_tables, out_page_indices=out_page_indices,
                      out_raw_indices=out_raw_indices)
    check_tensor(fn, "scores", scores, ndim=2, dtypes=(torch.float32,))
    rows = scores.shape[0]
    for arg, t in (("out_page_indices", out_page_indices), ("out_raw_indices", out_raw_indices)):
        if t is not None:
            check_tensor(fn, arg, t, ndim=2, dtypes=(torch.int32,), device=scores.device)
            check_size(fn, arg, t, 0, rows, "scores.shape[0] (rows)")
    if out_raw_indices is not None:
        check_size(fn, "out_raw_indices", out_raw_indices, 1, out_page_indices.shape[1],
                   "out_page_indices.shape[1] (topk)")
    for arg, t in (("out_page_indices", out_page_indices), ("out_raw_indices", out_raw_indices)):
        if t is not None:
            check_writable(fn, arg, t)
    check_tensor(fn, "page_tables", page_tables, ndim=2, dtypes=(torch.int32,),
                 device=scores.device)
    check_size(fn, "page_tables", page_tables, 0, rows, "scores.shape[0] (rows)")
    page_size = int_scalar(fn, "page_size", page_size, "an int > 0")
    if page_size <= 0:
        fail(fn, "page_size", "is not positive", "an int > 0 (tokens a page)", page_size)
    if page_size >= 2**31:
        fail(fn, "page_size", "is too large", "an int <= 2**31 - 1 (slots are int32)", page_size)
    if out_page_indices.shape[1] == 0:
        fail(fn, "out_page_indices", "has no columns", "[rows, topk] with topk > 0",
             tuple(out_page_indices.shape))
    return page_size


def topk_transform_512(scores, seq_lens, page_tables, out_page_indices, page_size,
                       out_raw_indices=None) -> None:
    """sgl-kernel-xpu ``topk_transform_512``: top-k per row, then positions to cache slots.

    Row ``i`` selects ``topk = out_page_indices.shape[1]`` positions of ``scores[i, :L]``,
    ``L = seq_lens[i]``, by ``xpu_ops.fast_topk_v2``'s rule (``L <= topk``: ``0 .. L-1``, then
    -1). A selected position whose score is ``-inf`` or NaN in a row with ``L > topk`` is -1
    in its place (sglang's fallback rule). Position ``p`` becomes slot
    ``page_tables[i, p // page_size] * page_size + p % page_size`` (-1 stays -1, as does a page
    index past the table). Writes ``out_page_indices`` (and the positions into
    ``out_raw_indices`` when given); all checks run first.

    Args:
        scores: [rows, width] float32. seq_lens: [rows] int32.
        page_tables: [rows, max_pages] int32. page_size: tokens a page (any int > 0).
        out_page_indices, out_raw_indices: [rows, topk] int32, written in place.
    Raises:
        TypeError/ValueError (also RuntimeError): wrong kind, shape or dtype, naming the argument.

    >>> import torch
    >>> from xpu_ops import compat_dsa
    >>> out = torch.empty(1, 2, dtype=torch.int32)
    >>> compat_dsa.topk_transform_512(torch.tensor([[0.0, 5.0, 1.0, 7.0]]),
    ...     torch.tensor([4], dtype=torch.int32), torch.tensor([[3, 9]], dtype=torch.int32), out, 2)
    >>> out.tolist()     # positions 1 and 3: page 0 -> 3, page 1 -> 9
    [[7, 19]]
    """
    import xpu_ops
    fn = "topk_transform_512"
    page_size = _check_transform(fn, scores, seq_lens, page_tables, out_page_indices, page_size,
                                 out_raw_indices)
    check_index(fn, "seq_lens", seq_lens, 1, scores.device)
    check_size(fn, "seq_lens", seq_lens, 0, scores.shape[0], "scores.shape[0] (rows)")
    topk = out_page_indices.shape[1]
    raw = xpu_ops.fast_topk_v2(scores, seq_lens, topk)
    picked = scores.gather(1, raw.clamp(min=0).long())
    dropped = (seq_lens > topk)[:, None] & ~(picked > float("-inf"))
    raw = raw.masked_fill(dropped, -1)
    page = (raw.clamp(min=0) // page_size).long()
    in_table = page < page_tables.shape[1]
    pages = page_tables.gather(1, page.clamp(max=max(page_tables.shape[1] - 1, 0))) \
        if page_tables.shape[1] else torch.zeros_like(raw)
    slots = pages.long() * page_size + raw % page_size
    valid = (raw >= 0) & in_table & (pages >= 0) & (slots < 2**31)
    out_page_indices.copy_(torch.where(valid, slots, -1))
    if out_raw_indices is not None:
        out_raw_indices.copy_(raw)


def topk_transform_512_v2(scores, seq_lens, page_tables, out_page_indices, page_size, metadata,
                          out_raw_indices=None) -> None:
    """sgl-kernel-xpu ``topk_transform_512_v2``: ``topk_transform_512`` with a ``metadata``
    scratch tensor (``[rows + 1, 2]`` int32 in sgl-kernel-xpu's tests), which is checked to be a
    tensor on the scores' device and never read or written: results never depend on it."""
    check_tensor("topk_transform_512_v2", "metadata", metadata, device=getattr(scores, "device",
                                                                                 None))
    topk_transform_512(scores, seq_lens, page_tables, out_page_indices, page_size,
                       out_raw_indices)


def shim_functions() -> dict:
    """The shim's names served by this module (every shim module may export them)."""
    return dict(fp8_paged_mqa_logits_triton=fp8_paged_mqa_logits_triton,
                topk_transform_512=topk_transform_512,
                topk_transform_512_v2=topk_transform_512_v2, FP8_DTYPE=FP8_DTYPE,
                _FAST_TOPK_SUPPORTED_K=FAST_TOPK_SUPPORTED_K)


def nsa_functions() -> dict:
    """``sgl_kernel.nsa``'s names: sgl-kernel-xpu's forms (0.0 outside, per-token cache)."""
    return dict(fp8_mqa_logits=fp8_mqa_logits, fp8_paged_mqa_logits=fp8_paged_mqa_logits,
                _fp8_mqa_logits_impl=fp8_mqa_logits_impl,
                _HEAD_LOOP_THRESHOLD=HEAD_LOOP_THRESHOLD)


__all__ = ["shim_functions", "nsa_functions", "FP8_DTYPE", "HEAD_LOOP_THRESHOLD",
           "FAST_TOPK_SUPPORTED_K", "AssertionValueError",
           "fp8_mqa_logits_impl", "fp8_mqa_logits", "fp8_paged_mqa_logits",
           "fp8_paged_mqa_logits_triton", "topk_transform_512",
           "topk_transform_512_v2"]
