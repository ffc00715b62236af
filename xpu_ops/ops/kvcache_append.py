"""FlashAttention-3's in-call append of ``flash_attn_with_kvcache``, as op calls before attention.

With ``k``/``v`` given, FA3 writes the new keys and values into the cache at positions
``cache_seqlens[r], cache_seqlens[r] + 1, ...`` of each request (``cache_seqlens`` is the
length *before* the append), optionally rotating the new keys and the queries first, then
attends over ``cache_seqlens[r] + s_new[r]`` keys. Here that is ``apply_rotary_emb`` (keys,
queries) and ``store_kv_cache`` (the token slots computed from the page table) ahead of the one
attention op, so every step is a custom op with a fake and the whole call traces.

The slot of position ``p`` of request ``r`` is ``page_table[r, p // page_size] * page_size +
p % page_size`` (a dense cache is the one-page table of ``kvcache_layout``, ``page_size =
s_cache``); a position past the table's capacity gets slot -1, which ``store_kv_cache`` skips.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .. import _value_checks
from .._checks import FLOAT_DTYPES, FP8_DTYPES, check_size, check_tensor, fail
from .common import check_cu_seqlens, check_index
from .rotary import apply_rotary_emb


def _owner_and_row(cu_seqlens: Tensor, total: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(owner, row, owned)``, int64/int64/bool ``[total]``: the request of every packed token
    (the first whose range ``cu_seqlens[r]:[r + 1]`` covers it), its row within that request,
    and whether any request covers it at all (padding past ``cu_seqlens[-1]``, or prefix sums
    that are inconsistent with checks off, leave tokens unowned; their owner is clamped into
    range so that indexing with it stays inside the tensors)."""
    cu = cu_seqlens.long()
    batch = cu.shape[0] - 1
    tokens = torch.arange(total, device=cu_seqlens.device)
    ends = torch.cummax(cu[1:], 0).values if batch > 0 else cu[1:]
    owner = torch.searchsorted(ends, tokens, right=True)
    owner_in = owner.clamp(max=max(batch - 1, 0))
    row = tokens - cu[owner_in]
    return owner_in, row, (owner < batch) & (row >= 0)


def _new_tokens(fn: str, k, v, cu_seqlens_k_new, k_cache: Tensor, v_cache: Tensor,
                batch: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(k [total_new, Hkv, D], v [total_new, Hkv, Dv], cu_seqlens_k_new [b + 1])``."""
    if v is None or k is None:
        missing = "v" if v is None else "k"
        fail(fn, missing, "is missing", "k and v together (the new keys and values)", None)
    device = k_cache.device
    if k_cache.dtype in FP8_DTYPES:  # before k's dtype: "pass the cache's dtype" would not help
        raise NotImplementedError(f"{fn}: appending k/v into an fp8 cache is not implemented; "
                                  f"expected a float16/bfloat16/float32 cache, got "
                                  f"{k_cache.dtype}. Quantize with store_kv_cache(k_scale=...) "
                                  f"before the call and pass k=None, v=None.")
    check_tensor(fn, "k", k, ndim=(3, 4), dtypes=(k_cache.dtype,), device=device,
                 fix="Pass the new keys in the cache's dtype.")
    check_tensor(fn, "v", v, ndim=k.dim(), dtypes=(v_cache.dtype,), device=device)
    for dim in range(k.dim() - 1):
        check_size(fn, "v", v, dim, k.shape[dim], f"k.shape[{dim}]")
    check_size(fn, "k", k, -2, k_cache.shape[2], "k_cache.shape[2] (Hkv)")
    check_size(fn, "k", k, -1, k_cache.shape[3], "k_cache.shape[3] (D)")
    check_size(fn, "v", v, -1, v_cache.shape[3], "v_cache.shape[3] (Dv)")
    if k.dim() == 4:
        if cu_seqlens_k_new is not None:
            fail(fn, "cu_seqlens_k_new", "is given with a 4-D k", "None when k is "
                 "[b, s_new, Hkv, D]", "a tensor", "Pass k packed as [total_new, Hkv, D].")
        check_size(fn, "k", k, 0, batch, "cache_seqlens.shape[0] (b)")
        s_new = k.shape[1]
        cu = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * s_new
        return k.reshape(batch * s_new, *k.shape[2:]), v.reshape(batch * s_new, *v.shape[2:]), cu
    if cu_seqlens_k_new is None:
        fail(fn, "cu_seqlens_k_new", "is missing for a packed 3-D k",
             "cu_seqlens_k_new [b + 1] int32 (or a 4-D k [b, s_new, Hkv, D])", None)
    check_cu_seqlens(fn, "cu_seqlens_k_new", cu_seqlens_k_new, batch, device)
    _value_checks.check_cu_seqlens_k_new(fn, cu_seqlens_k_new, k)
    return k, v, cu_seqlens_k_new


def _check_rotary(fn: str, rotary_cos, rotary_sin, rotary_seqlens, head_dim: int,
                  batch: int, device: torch.device) -> None:
    if rotary_cos is None or rotary_sin is None:
        missing = "rotary_sin" if rotary_sin is None else "rotary_cos"
        fail(fn, missing, "is missing", "rotary_cos and rotary_sin together", None)
    check_tensor(fn, "rotary_cos", rotary_cos, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_tensor(fn, "rotary_sin", rotary_sin, ndim=2, dtypes=(rotary_cos.dtype,),
                 device=device)
    for dim in (0, 1):
        check_size(fn, "rotary_sin", rotary_sin, dim, rotary_cos.shape[dim],
                   f"rotary_cos.shape[{dim}]")
    if 2 * rotary_cos.shape[1] > head_dim:
        fail(fn, "rotary_cos", "has more columns than half the head dim",
             f"rotary_cos.shape[1] (rotary_dim / 2) <= D / 2 = {head_dim // 2}",
             rotary_cos.shape[1], "Pass tables of shape [seqlen_ro, rotary_dim / 2].")
    if rotary_seqlens is not None:
        check_index(fn, "rotary_seqlens", rotary_seqlens, 1, device)
        check_size(fn, "rotary_seqlens", rotary_seqlens, 0, batch, "cache_seqlens.shape[0] (b)")


def _slots(page_table: Tensor, page_size: int, owner: Tensor, positions: Tensor) -> Tensor:
    """int64 token slot of (request, position) pairs; -1 (skipped by the store) before
    position 0 or past the table's capacity."""
    max_pages = page_table.shape[1]
    page_index = positions // page_size
    in_table = (positions >= 0) & (page_index < max_pages)  # a negative length writes nothing
    page = page_table.long()[owner, page_index.clamp(0, max(max_pages - 1, 0))]
    return torch.where(in_table, page * page_size + positions % page_size, -1)


def append_new_kv(fn: str, *, q: Tensor, cu_seqlens_q: Tensor, k, v, k_cache: Tensor,
                  v_cache: Tensor, page_table: Tensor, cache_seqlens: Tensor,
                  cu_seqlens_k_new: Optional[Tensor], rotary_cos, rotary_sin, rotary_seqlens,
                  rotary_interleaved: bool, local: bool,
                  check_values: Callable[[Tensor], None]) -> tuple[Tensor, Tensor]:
    """Rotate and store the new keys/values; return ``(q, cache_seqlens after the append)``.

    Args:
        q: [total_q, Hq, D] packed queries, rotated too when ``rotary_cos`` is given: row ``i``
            of request ``r`` at position ``base[r] + i`` when ``local`` (causal or a window),
            else every row at ``base[r]`` (FA3's rule), ``base = rotary_seqlens`` or
            ``cache_seqlens``.
        k, v: [b, s_new, Hkv, D|Dv], or packed [total_new, Hkv, D|Dv] with
            ``cu_seqlens_k_new [b + 1]``, in the cache's dtype. New key ``j`` of request ``r``
            is rotated at ``base[r] + j`` and stored at position ``cache_seqlens[r] + j``.
        page_table, cache_seqlens: the op's canonical [b, pages] table and [b] lengths before
            the append (``kvcache_layout.cache_tables``).
        check_values: the call's debug value checks, run on the lengths after the append
            before anything is written (with them on, rotary positions are checked too).
    Raises:
        ValueError: a missing partner (``k``/``v``, ``rotary_cos``/``rotary_sin``), a shape or
            dtype that does not match the cache, a bad ``cu_seqlens_k_new``/``rotary_seqlens``.
        NotImplementedError: an fp8 cache.
    """
    batch = cache_seqlens.shape[0]
    k, v, cu_new = _new_tokens(fn, k, v, cu_seqlens_k_new, k_cache, v_cache, batch)
    if batch == 0 or page_table.shape[1] == 0:  # no request, or no page to write into
        return q, (cache_seqlens + (cu_new[1:] - cu_new[:-1])).to(torch.int32)
    owner, row, owned = _owner_and_row(cu_new, k.shape[0])
    total_lens = (cache_seqlens + (cu_new[1:] - cu_new[:-1])).to(torch.int32)
    check_values(total_lens)
    if rotary_cos is not None or rotary_sin is not None:
        _check_rotary(fn, rotary_cos, rotary_sin, rotary_seqlens, k.shape[-1], batch, q.device)
        base = (cache_seqlens if rotary_seqlens is None else rotary_seqlens).long()
        q_owner, q_row, _ = _owner_and_row(cu_seqlens_q, q.shape[0])
        k_pos = (base[owner] + row).int()
        q_pos = (base[q_owner] + q_row if local else base[q_owner]).int()
        where = "rotary_seqlens" if rotary_seqlens is not None else "cache_seqlens"
        for positions in (k_pos, q_pos):
            _value_checks.check_rotary_positions(fn, positions, rotary_cos.shape[0], where)
        k = apply_rotary_emb(k, rotary_cos, rotary_sin, k_pos, interleaved=rotary_interleaved)
        q = apply_rotary_emb(q, rotary_cos, rotary_sin, q_pos, interleaved=rotary_interleaved)
    loc = _slots(page_table, k_cache.shape[1], owner, cache_seqlens.long()[owner] + row)
    loc = torch.where(owned, loc, -1)  # padding and unowned tokens are not stored
    # the op, not the public store: its debug checks would reject the skipped (-1) slots
    torch.ops.xpu_ops.store_kv_cache(k_cache, v_cache, loc, k, v, None, None)
    return q, total_lens


def check_no_append_keywords_without_k(fn: str, k, v, rotary_cos, rotary_sin,
                                       cu_seqlens_k_new) -> None:
    """FA3 rotates, and reads ``cu_seqlens_k_new``, only together with an append: those
    without ``k``/``v`` are an error (a missing partner of k/v is ``append_new_kv``'s)."""
    if k is not None or v is not None:
        return
    if rotary_cos is not None or rotary_sin is not None:
        fail(fn, "rotary_cos" if rotary_cos is not None else "rotary_sin",
             "is given without k/v", "rotary tables only with new keys k and values v "
             "(FlashAttention-3 rotates the appended keys and the queries)", "a tensor",
             "Rotate q and k yourself before the call, or pass k and v.")
    if cu_seqlens_k_new is not None:
        fail(fn, "cu_seqlens_k_new", "is given without k/v", "None unless new keys k and "
             "values v are appended", "a tensor")
