"""Argument forms of ``flash_attn_with_kvcache`` turned into the op's one canonical form.

FlashAttention-3 accepts a 4-D ``q [b, s, Hq, D]`` or packed queries, a dense cache
``[b_cache, s_cache, Hkv, D]`` (rows picked by ``cache_batch_idx``) or a paged one, and an
``int`` or per-request ``cache_seqlens``. The op takes only packed queries, a paged cache and a
``[b]`` int32 ``cache_seqlens``: a dense cache is a paged cache whose pages are its rows
(``page_size = s_cache``, request ``r`` owns the single page ``cache_batch_idx[r]``). Everything
here is shape logic plus index arithmetic on tensors (no host synchronisation), so it traces.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _value_checks
from .._checks import fail
from .common import check_index, max_seqlen


def as_packed(fn: str, q, cu_seqlens_q, max_seqlen_q):
    """``(q [total_q, Hq, D], cu_seqlens_q, max_seqlen_q, batch_shape)`` of a 3-D or 4-D ``q``.

    A 4-D ``q [b, s, Hq, D]`` becomes ``[b*s, Hq, D]`` with ``cu_seqlens_q = arange(b+1) * s``
    and ``batch_shape = (b, s)``; a 3-D ``q`` needs ``cu_seqlens_q`` (``batch_shape`` None).
    """
    if q.dim() not in (3, 4):
        fail(fn, "q", "has the wrong number of dimensions",
             "3-D [total_q, Hq, D] (with cu_seqlens_q) or 4-D [b, s, Hq, D]",
             f"{q.dim()}-D with shape {tuple(q.shape)}")
    if q.dim() == 3:
        if cu_seqlens_q is None:
            fail(fn, "cu_seqlens_q", "is missing for a packed 3-D q",
                 "cu_seqlens_q [b + 1] int32 (or a 4-D q [b, s, Hq, D])", None)
        return q, cu_seqlens_q, max_seqlen(fn, "max_seqlen_q", max_seqlen_q, q.shape[0]), None
    if cu_seqlens_q is not None:
        fail(fn, "cu_seqlens_q", "is given with a 4-D q", "None when q is [b, s, Hq, D]",
             "a tensor", "Pass q packed as [total_q, Hq, D] to use cu_seqlens_q.")
    batch, seqlen = q.shape[:2]
    return (q.reshape(batch * seqlen, *q.shape[2:]), uniform_cu_seqlens(q, batch, seqlen), seqlen,
            (batch, seqlen))


# The cu_seqlens_q of 4-D queries, one read-only int32 tensor per (stream, b, s) on a GPU and per
# (device, b, s) elsewhere: an eager call of a 4-D q then does no device work (an arange and a
# multiply, each an allocation and a launch) to build it. On a GPU it is built on the stream that
# reads it (the current one, whose later work runs after it) and only that stream's calls get
# it: no synchronisation, and no other stream can read it before it is written. Entries are
# never dropped (a block freed back to the caching allocator could be handed out while a stream
# still reads it) and hold b + 1 ints each.
_UNIFORM_CU_SEQLENS: dict[tuple, Tensor] = {}


def _cu_seqlens_key(device: torch.device) -> Optional[object]:
    """The stream (CUDA, XPU) or device whose calls may share a kept ``cu_seqlens_q``; None
    while the current stream of ``device`` is capturing a graph (a tensor made during a capture
    lives in the graph's memory pool, which later captures reuse: it must not outlive the
    call)."""
    if device.type not in ("cuda", "xpu"):
        return device
    if _value_checks._capturing(device):
        return None
    return torch.accelerator.current_stream(device.index)


def uniform_cu_seqlens(q: Tensor, batch: int, seqlen: int) -> Tensor:
    """``cu_seqlens_q = arange(b + 1) * s`` (int32, q's device) of a 4-D ``q [b, s, Hq, D]``.

    An eager call of a plain tensor gets the tensor kept for its stream (device) and ``(b, s)``
    (made once, outside any dispatch mode and inference mode; nothing writes it). Built as part
    of the call instead while Dynamo traces, for tensor subclasses (fake, functional, proxy
    tensors) and during a graph capture (``_cu_seqlens_key``).
    """
    key = (None if torch.compiler.is_compiling() or type(q) is not Tensor
           else _cu_seqlens_key(q.device))
    if key is None:
        return torch.arange(0, batch + 1, dtype=torch.int32, device=q.device) * seqlen
    key = (key, batch, seqlen)
    cu = _UNIFORM_CU_SEQLENS.get(key)
    if cu is None:
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes(), torch.inference_mode(False):
            cu = torch.arange(0, batch + 1, dtype=torch.int32, device=q.device) * seqlen
        cu = _UNIFORM_CU_SEQLENS.setdefault(key, cu)
    return cu


def pack_rows(fn: str, arg: str, t, batch_shape):
    """A per-query tensor (``qv``) in q's layout: ``[b, s, ...]`` flattened to ``[b*s, ...]``
    when q was 4-D (``batch_shape = (b, s)``); left as it is otherwise."""
    if batch_shape is None or not isinstance(t, Tensor):
        return t
    if t.dim() != 4 or tuple(t.shape[:2]) != tuple(batch_shape):
        fail(fn, arg, "does not match the 4-D q", f"[b, s, Hq, Dv] with (b, s) = "
             f"{tuple(batch_shape)}", f"shape {tuple(t.shape)}")
    return t.reshape(batch_shape[0] * batch_shape[1], *t.shape[2:])


def request_count(cache_seqlens, cu_seqlens_q, batch_shape) -> tuple[Optional[int], str]:
    """``(b, where it comes from)``: the requests of the call, or ``(None, "")`` when no argument
    gives it well-formed (the op's checks then name the malformed one)."""
    if isinstance(cache_seqlens, Tensor) and cache_seqlens.dim() == 1:
        return cache_seqlens.shape[0], "cache_seqlens.shape[0]"
    if batch_shape is not None:
        return batch_shape[0], "q.shape[0]"
    if isinstance(cu_seqlens_q, Tensor) and cu_seqlens_q.dim() == 1:
        return cu_seqlens_q.shape[0] - 1, "cu_seqlens_q.shape[0] - 1"
    return None, ""


def _check_dense_rows(fn: str, k_cache: Tensor, want: Optional[int], rule: str) -> None:
    """Without ``cache_batch_idx``, a dense cache has one row per request."""
    rows = k_cache.shape[0]
    if want is not None and rows != want:
        fail(fn, "k_cache", f"has {rows} rows in dimension 0 for a batch of {want} requests "
             "and page_table is None", f"a contiguous cache [b, seqlen_k, Hkv, D] (the layout "
             f"without page_table) with b = {rule} = {want}", f"shape {tuple(k_cache.shape)}",
             "For a paged cache [num_pages, page_size, Hkv, D], pass page_table "
             "[b, max_pages_per_seq] int32 and cache_seqlens; to pick rows of a larger dense "
             "cache, pass cache_batch_idx [b] int32.")


def _select_rows(page_table: Tensor, rows: Tensor, num_pages: int) -> Tensor:
    """``page_table[rows]``; a row out of range becomes a row of the out-of-range page id
    ``num_pages`` (its keys are hidden and appends to it skipped, API.md "Writes")."""
    rows = rows.long()
    valid = (rows >= 0) & (rows < page_table.shape[0])
    if page_table.shape[0] == 0:
        return torch.full((rows.shape[0], page_table.shape[1]), num_pages,
                          dtype=page_table.dtype, device=page_table.device)
    picked = page_table.index_select(0, rows.clamp(0, page_table.shape[0] - 1))
    return torch.where(valid.unsqueeze(1), picked, num_pages).to(page_table.dtype)


def cache_tables(fn: str, k_cache: Tensor, cache_seqlens, page_table: Optional[Tensor],
                 cache_batch_idx: Optional[Tensor], cu_seqlens_q, batch_shape
                 ) -> tuple[Tensor, Tensor, bool]:
    """``(page_table [b, pages], cache_seqlens [b] int32, dense)`` for the op.

    Args:
        k_cache: paged [num_pages, page_size, Hkv, D] (with ``page_table``) or dense
            [b_cache, s_cache, Hkv, D] (without).
        cache_seqlens: [b] int32, an int (every request), or None (dense only: ``s_cache``).
        cache_batch_idx: [b] int32 cache row (dense) or page-table row (paged) of each request;
            None is ``arange(b)``.
    Raises:
        ValueError: a dense cache without ``cache_batch_idx`` whose row count is not b; a paged
            cache without ``cache_seqlens``; ``cache_batch_idx`` not int32 ``[b]``.
    """
    device = k_cache.device
    batch, rule = request_count(cache_seqlens if not isinstance(cache_seqlens, int) else None,
                                cu_seqlens_q, batch_shape)
    dense = page_table is None
    if cache_batch_idx is not None:
        check_index(fn, "cache_batch_idx", cache_batch_idx, 1, device)
        if batch is not None and cache_batch_idx.shape[0] != batch:
            fail(fn, "cache_batch_idx", "has one row per request of another batch",
                 f"[b] with b = {rule} = {batch}", f"shape {tuple(cache_batch_idx.shape)}",
                 "Give one cache row per request.")
        batch, rule = cache_batch_idx.shape[0], "cache_batch_idx.shape[0]"
        if dense:
            _value_checks.check_cache_batch_idx(fn, cache_batch_idx, k_cache.shape[0],
                                                "k_cache.shape[0], rows of the dense cache")
            page_table = cache_batch_idx.view(-1, 1)
        else:
            check_index(fn, "page_table", page_table, 2, device)
            _value_checks.check_cache_batch_idx(fn, cache_batch_idx, page_table.shape[0],
                                                "page_table.shape[0]")
            page_table = _select_rows(page_table, cache_batch_idx, k_cache.shape[0])
    elif dense:
        _check_dense_rows(fn, k_cache, batch, rule)
        batch = k_cache.shape[0] if batch is None else batch
        page_table = torch.arange(batch, dtype=torch.int32, device=device).unsqueeze(1)
    if cache_seqlens is None:
        if not dense:
            fail(fn, "cache_seqlens", "is missing", "cache_seqlens [b] int32 with a page_table",
                 None)
        cache_seqlens = k_cache.shape[1]
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        count = page_table.shape[0] if batch is None else batch
        cache_seqlens = torch.full((count,), cache_seqlens, dtype=torch.int32, device=device)
    return page_table, cache_seqlens, dense
