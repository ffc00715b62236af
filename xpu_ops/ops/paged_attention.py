"""``flash_attn_with_kvcache``: attention of packed queries over a paged KV cache.

Schema, fake, checks and the public wrapper of the op ``torch.ops.xpu_ops.flash_attn_with_kvcache``.
The op writes the attention output into ``out`` (a mutated argument, never returned) and returns
the float32 log-sum-exp ``[Hq, total_q]``; the public wrapper allocates ``out`` when the caller
gives none, so the functional form traces and the ``out=`` form writes a fixed buffer.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .. import _value_checks
from . import kvcache_append, kvcache_layout
from .._registration import define_op
from .._checks import (FLOAT_DTYPES, FP8_DTYPES, all_dense_on, check_not_implemented, check_size,
                       check_tensor, check_tensor_args, fail, tensors_or_none)
from .common import (check_attention_extras, check_cu_seqlens, check_flag, check_head_dim,
                     check_index, check_kv_dtype, check_num_splits, check_op_scalars, check_out,
                     check_query, check_speed_hints, kernel_extras,
                     default_softmax_scale, finite_scale, float_scalar, no_cap_if_infinite,
                     normalize_window, output_dtype)

NAME = "flash_attn_with_kvcache"
# Defaults of compatibility keywords that check_not_implemented's None/0/False rule misses.
_KVCACHE_DEFAULTS = {"attention_chunk": 0}
# The wrapper's optional tensor arguments, in the order it checks them.
_OPTIONAL_TENSORS = ("cache_seqlens", "page_table", "cu_seqlens_q", "qv", "q_descale", "k_descale",
                     "v_descale", "sinks", "out", "cache_batch_idx", "cache_leftpad",
                     "rotary_seqlens", "k", "v", "rotary_cos", "rotary_sin", "cu_seqlens_k_new",
                     "bidirectional_block_ids")
_LAYOUTS = ("4-D: [num_pages, page_size, Hkv, D] with page_table, or [b, seqlen_k, Hkv, D] "
            "without page_table")


def _check_cache_rank(fn: str, arg: str, cache) -> None:
    """K/V caches are 4-D (the message names both layouts: a flat [slots, Hkv, D] pool needs a
    view with its page size) with a page size (a dense cache's capacity) of at least 1."""
    if cache.dim() != 4:
        fail(fn, arg, "has the wrong number of dimensions", _LAYOUTS,
             f"{cache.dim()}-D with shape {tuple(cache.shape)}",
             f"View a flat [slots, Hkv, D] pool as {arg}.view(-1, page_size, Hkv, D).")
    if cache.shape[1] == 0:
        fail(fn, arg, "has page size 0",
             f"{arg}.shape[1] (page_size; a dense cache's seqlen_k) >= 1",
             f"shape {tuple(cache.shape)}")


def _check_batch_rows(fn: str, cache_seqlens, page_table, cu_seqlens_q) -> None:
    """``cache_seqlens [b]`` and ``page_table [b, max_pages]`` agree on ``b``. When they do
    not, the one that ``cu_seqlens_q [b + 1]`` (a third witness of ``b``) also contradicts is
    named; ``page_table`` when ``cu_seqlens_q`` sides with neither (it is checked next)."""
    b, rows = cache_seqlens.shape[0], page_table.shape[0]
    if b == rows:
        return
    cu_b = (cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor)
            and cu_seqlens_q.dim() == 1 else None)
    if cu_b is not None and cu_b == rows:
        check_size(fn, "cache_seqlens", cache_seqlens, 0, rows,
                   "page_table.shape[0] = cu_seqlens_q.shape[0] - 1 (b)")
    check_size(fn, "page_table", page_table, 0, b, "cache_seqlens.shape[0] (b)")


def _check_flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q,
                                   out, qv, q_descale, k_descale, v_descale, sinks,
                                   cache_leftpad, bidirectional_block_ids, *, max_seqlen_q,
                                   softmax_scale, window_size_left, window_size_right, softcap,
                                   num_splits) -> None:
    """Validate the op's arguments (shapes, dtypes, devices and scalars; runs in the fake too)."""
    fn = NAME
    check_op_scalars(fn, softmax_scale, window_size_left, window_size_right)
    check_query(fn, q)
    device = q.device
    check_tensor(fn, "k_cache", k_cache)
    _check_cache_rank(fn, "k_cache", k_cache)
    check_tensor(fn, "k_cache", k_cache, dtypes=FLOAT_DTYPES + FP8_DTYPES, device=device)
    check_tensor(fn, "v_cache", v_cache)
    _check_cache_rank(fn, "v_cache", v_cache)
    check_tensor(fn, "v_cache", v_cache, dtypes=(k_cache.dtype,), device=device,
                 fix="Store K and V in the same dtype.")
    check_kv_dtype(fn, "k_cache", k_cache, q)
    num_pages, page_size, num_heads_kv, head_dim = k_cache.shape
    check_size(fn, "q", q, 2, head_dim, "k_cache.shape[3] (D)")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        for dim, (size, rule) in enumerate(((num_pages, "k_cache.shape[0] (num_pages)"),
                                            (page_size, "k_cache.shape[1] (page_size)"),
                                            (num_heads_kv, "k_cache.shape[2] (Hkv)"))):
            check_size(fn, "v_cache", v_cache, dim, size, rule)
    check_index(fn, "cache_seqlens", cache_seqlens, 1, device)
    batch = cache_seqlens.shape[0]
    check_index(fn, "page_table", page_table, 2, device)
    _check_batch_rows(fn, cache_seqlens, page_table, cu_seqlens_q)
    check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, batch, device)
    head_dim_v = v_cache.shape[3]
    total_q, num_heads_q, _ = q.shape
    check_out(fn, out, (total_q, num_heads_q, head_dim_v), output_dtype(q), device,
              "[total_q, Hq, Dv]")
    check_attention_extras(fn, q=q, k_dtype=k_cache.dtype, v_dtype=v_cache.dtype,
                           num_heads_kv=num_heads_kv, head_dim_v=head_dim_v, batch=batch, qv=qv,
                           q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                           sinks=sinks, softcap=softcap, max_seqlen_q=max_seqlen_q)
    if cache_leftpad is not None:
        check_index(fn, "cache_leftpad", cache_leftpad, 1, device)
        check_size(fn, "cache_leftpad", cache_leftpad, 0, batch, "cache_seqlens.shape[0] (b)")
    if bidirectional_block_ids is not None:
        check_index(fn, "bidirectional_block_ids", bidirectional_block_ids, 1, device)
        check_size(fn, "bidirectional_block_ids", bidirectional_block_ids, 0, total_q,
                   "q.shape[0] (total_q)")
    if num_splits < 0:
        check_num_splits(fn, num_splits)


def _is_plain_valid_flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table,
                                            cu_seqlens_q, out, no_extras: bool,
                                            max_seqlen_q: int, softmax_scale: float,
                                            window_size_left: int, window_size_right: int,
                                            softcap: float, num_splits: int) -> bool:
    """True for a call of the plain form that ``_check_flash_attn_with_kvcache`` accepts: no
    optional tensor (``no_extras``), K/V in q's float dtype, int32 metadata, every size
    consistent, one device. Attribute reads and integer comparisons only (the op's tensors are
    tensors by its schema); False sends the call through the full checks, which raise or accept a
    less common form."""
    dtype, int32 = q.dtype, torch.int32
    if not (no_extras and dtype in FLOAT_DTYPES and k_cache.dtype is dtype
            and v_cache.dtype is dtype and out.dtype is dtype and q.dim() == 3
            and k_cache.dim() == 4 and v_cache.dim() == 4 and cache_seqlens.dim() == 1
            and page_table.dim() == 2 and cu_seqlens_q.dim() == 1 and out.dim() == 3
            and cache_seqlens.dtype is int32 and page_table.dtype is int32
            and cu_seqlens_q.dtype is int32 and max_seqlen_q >= 1 and softcap >= 0.0
            and num_splits >= 0 and -math.inf < softmax_scale < math.inf
            and window_size_left >= -1 and window_size_right >= -1):
        return False
    if not all_dense_on(q.device, (k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q,
                                   out, q)):
        return False
    total_q, num_heads_q, head_dim = q.shape
    _, page_size, num_heads_kv, head_dim_k = k_cache.shape
    batch = cache_seqlens.shape[0]
    return (head_dim >= 1 and page_size >= 1 and head_dim_k == head_dim
            and v_cache.shape[:3] == k_cache.shape[:3]
            and num_heads_kv >= 1 and num_heads_q % num_heads_kv == 0
            and page_table.shape[0] == batch and cu_seqlens_q.shape[0] == batch + 1
            and out.shape == (total_q, num_heads_q, v_cache.shape[3]))


@define_op("xpu_ops::flash_attn_with_kvcache", mutates_args=("out",), by_device=True)
def flash_attn_with_kvcache_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, page_table: Tensor,
    cu_seqlens_q: Tensor, out: Tensor, qv: Optional[Tensor], q_descale: Optional[Tensor],
    k_descale: Optional[Tensor], v_descale: Optional[Tensor], sinks: Optional[Tensor],
    cache_leftpad: Optional[Tensor], bidirectional_block_ids: Optional[Tensor],
    max_seqlen_q: int, softmax_scale: float, causal: bool, window_size_left: int,
    window_size_right: int, softcap: float, num_splits: int, return_softmax_lse: bool,
) -> Tensor:
    """Op form of ``flash_attn_with_kvcache``: writes ``out``, returns ``softmax_lse [Hq, total_q]``
    (with ``return_softmax_lse=False``, an empty ``[Hq, 0]``: the LSE is not computed where a
    provider can skip it, e.g. the CPU decode path's SDPA).

    All arguments are explicit (no defaults); see the public wrapper for their meaning.
    ``cache_seqlens`` is the total key count (any append already done). ``window_size_right``
    is forced to 0 when ``causal``. ``max_seqlen_q`` bounds the queries of one request (kernels
    size their grid with it; it is never read from tensor values).

    Masks beyond the public wrapper's: keys ``j < cache_leftpad[r]`` are invisible; with
    ``bidirectional_block_ids [total_q]`` (int32, ``< 0``: no block), key ``j`` of request ``r``
    carries the id of the query at the same absolute position (``j - (Lk - Lq)``; keys of the
    cached prefix carry none), and a key whose id equals the query's is visible past the right
    bound (never past the left bound, ``Lk`` or ``cache_leftpad``). ``num_splits``: 0 lets the
    provider choose the KV split count, 1 is one pass over the keys, n > 1 at most n splits.
    """
    no_extras = (qv is None and q_descale is None and k_descale is None and v_descale is None
                 and sinks is None and cache_leftpad is None and bidirectional_block_ids is None)
    if not _is_plain_valid_flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table,
                                                   cu_seqlens_q, out, no_extras, max_seqlen_q,
                                                   softmax_scale, window_size_left,
                                                   window_size_right, softcap, num_splits):
        _check_flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out, qv, q_descale,
            k_descale, v_descale, sinks, cache_leftpad, bidirectional_block_ids,
            max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale,
            window_size_left=window_size_left, window_size_right=window_size_right,
            softcap=softcap, num_splits=num_splits)
    extras = None if no_extras else kernel_extras(sinks, q_descale, k_descale, v_descale,
                                                  cache_seqlens.shape[0], k_cache.shape[2])
    # providers' forms: softcap 0 for no cap, float32 sinks, [b, Hkv] descales; causal forces
    # the right window bound to 0
    if softcap == math.inf or extras is not None or causal and window_size_right != 0:
        if extras is not None:
            sinks, q_descale, k_descale, v_descale = extras
        return (q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out, qv, q_descale,
                k_descale, v_descale, sinks, cache_leftpad, bidirectional_block_ids,
                max_seqlen_q, softmax_scale, causal, window_size_left,
                0 if causal else window_size_right, no_cap_if_infinite(softcap), num_splits,
                return_softmax_lse)
    return None


@flash_attn_with_kvcache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out, qv, q_descale,
      k_descale, v_descale, sinks, cache_leftpad, bidirectional_block_ids, max_seqlen_q,
      softmax_scale, causal, window_size_left, window_size_right, softcap, num_splits,
      return_softmax_lse):
    _check_flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q,
                                   out, qv, q_descale, k_descale, v_descale, sinks, cache_leftpad,
                                   bidirectional_block_ids, max_seqlen_q=max_seqlen_q,
                                   softmax_scale=softmax_scale, window_size_left=window_size_left,
                                   window_size_right=window_size_right, softcap=softcap,
                                   num_splits=num_splits)
    return q.new_empty((q.shape[1], q.shape[0] if return_softmax_lse else 0),
                       dtype=torch.float32)


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
    cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
    cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
    q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
    window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
    scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
    return_softmax_lse=False, sinks=None, out=None, bidirectional_block_ids=None,
    max_seqlen_k=None, ver=3,
):
    """Attention of new query tokens over a KV cache (sgl-kernel / FlashAttention-3 compatible).

    Query row ``i`` of a request with ``Lq`` new tokens and ``Lk`` keys sits at position
    ``Lk - Lq + i`` (bottom-right); ``causal`` allows keys ``j <= pos``; ``window_size
    = (left, right)`` allows ``pos - left <= j <= pos + right`` (inclusive, -1 unbounded,
    ``causal`` forces ``right = 0``). Scores are ``softmax_scale * q.k`` (plus ``qv.v`` when
    ``qv`` is given), then ``softcap * tanh(s / softcap)`` when ``softcap > 0``; ``sinks`` adds
    one logit per head to the softmax denominator. Rows with no visible key give 0 and LSE -inf.

    Args:
        q: [total_q, Hq, D] packed (with ``cu_seqlens_q``) or [b, s, Hq, D]; fp16|bf16|fp32|fp8.
        k_cache: paged [num_pages, page_size, Hkv, D] with ``page_table``; without it, a dense
            cache [b_cache, s_cache, Hkv, D] (request r reads row ``cache_batch_idx[r]``, or row
            r, when ``b_cache`` must equal b). q's dtype or fp8 (then ``k_descale``).
        v_cache: same layout with Dv, same dtype as ``k_cache``.
        cache_seqlens: [b] int32 (or an int for every request): keys per request in tokens, not
            a prefix sum. Optional only for a dense cache (then ``s_cache``).
        cache_batch_idx: [b] int32, the dense-cache row (or page-table row) of each request.
        cache_leftpad: [b] int32: keys before it are ignored (positions stay absolute).
        page_table: [b, max_pages_per_seq] int32 physical page ids; entries past a request's
            last page are never read. None: the cache is dense (above).
        cu_seqlens_q: [b + 1] int32 prefix sums of new tokens per request (packed q only).
        max_seqlen_q: upper bound of new tokens in one request (int); default total_q.
        qv: [total_q, Hq, Dv] ([b, s, Hq, Dv] for a 4-D q), extra query part dotted with V
            (absorbed MLA extend).
        q_descale/k_descale/v_descale: float32 dequantisation scales of fp8 inputs, [b, Hkv],
            [b] or [1] (broadcast to [b, Hkv]; expanded views fine).
        softmax_scale: float, default ``1/sqrt(D)`` (``1/sqrt(D + Dv)`` with ``qv``); any
            finite value (NaN or inf raises ValueError).
        causal, window_size, softcap: see above. sinks: [Hq] logits in any float dtype
            (read as float32).
        bidirectional_block_ids: [total_q] int32 block id of each query token (< 0: none), for
            Gemma-3 image tokens: the mask is causal (whatever ``causal`` says; sgl-kernel-xpu
            passes ``causal=False``) except that a query and a key with the same id >= 0 see
            each other in both directions (key j carries the id of the query at position j, so
            ``Lq == Lk`` gives every key an id; cached-prefix keys have none). The left window
            bound still applies.
        return_softmax_lse: also return ``softmax_lse`` float32 [Hq, total_q] ([b, Hq, s] for
            a 4-D q), natural log.
        out: optional output tensor of the result's shape; written in place and returned.
        num_splits: KV splits: 1 is one pass over the keys, so a row's result does not depend
            on the other requests of the batch; 0 (default) lets the provider choose; n > 1 at
            most n splits. Results agree to rounding whatever the value.
        k, v: new keys/values to append first (FA3): [b, s_new, Hkv, D|Dv], or packed
            [total_new, Hkv, D|Dv] with ``cu_seqlens_k_new [b + 1]`` int32, in the cache's
            dtype. Then ``cache_seqlens`` is the length *before* the append: new key j of
            request r is written at position ``cache_seqlens[r] + j`` (paged or dense; a
            position past the cache's capacity is skipped) and attention runs over
            ``cache_seqlens[r] + s_new[r]`` keys. The caches are modified in place.
        rotary_cos, rotary_sin: [seqlen_ro, rotary_dim / 2] tables, only with k/v: the new
            keys are rotated at positions ``base[r] + j`` and the queries at ``base[r] + i``
            when causal or local (a window), else all at ``base[r]``, with ``base =
            rotary_seqlens`` ([b] int32) or ``cache_seqlens``; the first rotary_dim features
            turn, GPT-J pairs when ``rotary_interleaved`` (default), NeoX halves otherwise.
        pack_gqa, sm_margin, scheduler_metadata, max_seqlen_k: FlashAttention-3 speed hints,
            accepted (typed) and never changing the result. ver: 3 or 4, sgl-kernel's choice
            of FA3 or FA4 (the same math; one implementation here).
        attention_chunk: not implemented; only 0 (chunked-local attention: use window_size on
            the virtual batches instead).
    Returns:
        ``out`` [total_q, Hq, Dv] (or [b, s, Hq, Dv]) in q's dtype (bf16 for an fp8 q), or
        ``(out, softmax_lse)``.
    Raises:
        TypeError: an argument is not a tensor (or number) where one is required; num_splits
            is not an int.
        ValueError: a shape, dtype or device mismatch, naming the argument and both values
            (a dense cache whose row count is not b without ``cache_batch_idx`` names k_cache
            and both layouts); a negative num_splits.
        NotImplementedError: ``attention_chunk`` other than 0; k/v appended into an fp8
            cache.
        ValueError: with ``XPU_OPS_DEBUG_CHECKS=1``, a value out of range: ``cu_seqlens_q``,
            ``max_seqlen_q``, ``cache_seqlens`` or a page id that is read, an append's
            ``cu_seqlens_k_new`` (not from 0, decreasing, past the packed k) (unchecked
            otherwise). Every check runs before the append's store: a rejected call writes
            nothing.
    Source: FlashAttention-2 (arXiv 2307.08691) online softmax; paged KV cache from vLLM
    PagedAttention (arXiv 2309.06180); semantics of FlashAttention-3's
    ``hopper/flash_attn_interface.py`` and sgl-kernel(-xpu)'s ``flash_attn_with_kvcache``.

    >>> import torch, xpu_ops
    >>> q = torch.randn(3, 4, 64); kc = torch.randn(2, 16, 2, 64); vc = torch.randn(2, 16, 2, 64)
    >>> o = xpu_ops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([20], dtype=torch.int32),
    ...     page_table=torch.tensor([[1, 0]], dtype=torch.int32),
    ...     cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32), causal=True)
    >>> keys = torch.cat([kc[1], kc[0]])[:20].repeat_interleave(2, 1); vals = torch.cat([vc[1], vc[0]])[:20].repeat_interleave(2, 1)
    >>> mask = torch.arange(20)[None, :] <= torch.arange(17, 20)[:, None]
    >>> s = torch.einsum("qhd,khd->hqk", q, keys) / 8.0
    >>> ref = torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), vals)
    >>> torch.allclose(o, ref, atol=1e-5)
    True
    """
    fn = NAME
    _check_keywords(attention_chunk, rotary_interleaved, num_splits, pack_gqa, sm_margin,
                    scheduler_metadata, max_seqlen_k, ver)
    if (k is None and v is None and qv is None and rotary_cos is None and rotary_sin is None
            and cache_batch_idx is None and cache_leftpad is None and cu_seqlens_k_new is None
            and rotary_seqlens is None and q_descale is None and k_descale is None
            and v_descale is None and sinks is None and bidirectional_block_ids is None
            and type(q) is Tensor and type(k_cache) is Tensor and type(v_cache) is Tensor
            and type(cache_seqlens) is Tensor and type(page_table) is Tensor
            and (out is None or type(out) is Tensor)
            and (max_seqlen_q is None or type(max_seqlen_q) is int)
            and (softmax_scale is None or type(softmax_scale) is float)
            and type(softcap) is float and window_size == (-1, -1)
            and type(causal) is bool and type(return_softmax_lse) is bool
            and k_cache.dim() == 4):
        if type(cu_seqlens_q) is Tensor and q.dim() == 3:
            return _plain_call(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q,
                               max_seqlen_q, softmax_scale, causal, softcap, num_splits,
                               return_softmax_lse, out)
        if cu_seqlens_q is None and q.dim() == 4:
            return _plain_batched_call(q, k_cache, v_cache, cache_seqlens, page_table,
                                       softmax_scale, causal, softcap, num_splits,
                                       return_softmax_lse, out)
    optional = (None if type(cache_seqlens) is int else cache_seqlens, page_table, cu_seqlens_q,
                qv, q_descale, k_descale, v_descale, sinks, out, cache_batch_idx, cache_leftpad,
                rotary_seqlens, k, v, rotary_cos, rotary_sin, cu_seqlens_k_new,
                bidirectional_block_ids)
    if not tensors_or_none((q, k_cache, v_cache), optional):
        named = dict(zip(_OPTIONAL_TENSORS, optional))
        check_tensor_args(fn, named, q=q, k_cache=k_cache, v_cache=v_cache, **named)
    kvcache_append.check_no_append_keywords_without_k(fn, k, v, rotary_cos, rotary_sin,
                                                      cu_seqlens_k_new)
    q3, cu_seqlens_q, max_seqlen_q, batch_shape = kvcache_layout.as_packed(
        fn, q, cu_seqlens_q, max_seqlen_q)
    qv = kvcache_layout.pack_rows(fn, "qv", qv, batch_shape)
    _check_cache_rank(fn, "k_cache", k_cache)
    page_table, cache_seqlens, dense = kvcache_layout.cache_tables(
        fn, k_cache, cache_seqlens, page_table, cache_batch_idx, cu_seqlens_q, batch_shape)
    head_dim_v = v_cache.shape[-1]
    if softmax_scale is None:
        check_head_dim(fn, "q", q3)
        softmax_scale = default_softmax_scale(q3.shape[-1], head_dim_v if qv is not None else 0)
    causal = check_flag(fn, "causal", causal) or bidirectional_block_ids is not None
    return_softmax_lse = check_flag(fn, "return_softmax_lse", return_softmax_lse)
    left, right = normalize_window(fn, window_size, causal)

    def check_values(lens):  # debug value checks, before anything is written
        _value_checks.check_flash_attn_with_kvcache(q3, k_cache, lens, page_table, cu_seqlens_q,
                                                    max_seqlen_q, contiguous=dense,
                                                    cache_leftpad=cache_leftpad)
        _value_checks.check_sinks(fn, "sinks", sinks)
    out3, mergeable = _packed_out(fn, out, q3, head_dim_v, batch_shape)
    softmax_scale = finite_scale(fn, "softmax_scale", softmax_scale)
    softcap = float_scalar(fn, "softcap", softcap)
    if k is not None or v is not None:
        # every check of the attention op before the append's store: a rejected call
        # writes nothing (the op checks again; the lengths' shape is the same after the append)
        _check_flash_attn_with_kvcache(
            q3, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out3, qv, q_descale,
            k_descale, v_descale, sinks, cache_leftpad, bidirectional_block_ids,
            max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, window_size_left=left,
            window_size_right=right, softcap=softcap, num_splits=num_splits)
        q3, cache_seqlens = kvcache_append.append_new_kv(
            fn, q=q3, cu_seqlens_q=cu_seqlens_q, k=k, v=v, k_cache=k_cache, v_cache=v_cache,
            page_table=page_table, cache_seqlens=cache_seqlens, cu_seqlens_k_new=cu_seqlens_k_new,
            rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_seqlens=rotary_seqlens,
            rotary_interleaved=bool(rotary_interleaved), local=causal or (left, right) != (-1, -1),
            check_values=check_values)
    else:
        check_values(cache_seqlens)
    # Positional, in schema order: keyword arguments cost the dispatcher a dict per call.
    lse = torch.ops.xpu_ops.flash_attn_with_kvcache.default(
        q3, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out3, qv, q_descale,
        k_descale, v_descale, sinks, cache_leftpad, bidirectional_block_ids, max_seqlen_q,
        softmax_scale, causal, left, right, softcap, num_splits, return_softmax_lse)
    result, lse = _unpacked(out, out3, lse if return_softmax_lse else None, batch_shape,
                            mergeable)
    return (result, lse) if return_softmax_lse else result


def _plain_call(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q,
                softmax_scale, causal: bool, softcap: float, num_splits: int,
                return_softmax_lse: bool, out):
    """The public call in its plain form (the decode layer's): packed ``q [total_q, Hq, D]``,
    a paged cache with ``page_table``, ``cache_seqlens`` and ``cu_seqlens_q`` tensors, no
    append, rotary, dense-cache rows, descales, sinks, leftpad, blocks or window; the checked
    keywords and the argument kinds already known. What the general path would do for it, with
    none of its argument forms: default the scale and bound, the debug value checks, allocate
    ``out`` when not given, then the op."""
    if max_seqlen_q is None:
        max_seqlen_q = q.shape[0]
    if softmax_scale is None:
        check_head_dim(NAME, "q", q)
        softmax_scale = default_softmax_scale(q.shape[-1])
    _value_checks.check_flash_attn_with_kvcache(q, k_cache, cache_seqlens, page_table,
                                                cu_seqlens_q, max_seqlen_q)
    if out is None:
        out = q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]), dtype=output_dtype(q))
    lse = torch.ops.xpu_ops.flash_attn_with_kvcache.default(
        q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out, None, None, None,
        None, None, None, None, max_seqlen_q, softmax_scale, causal, -1, 0 if causal else -1,
        softcap, num_splits, return_softmax_lse)
    return (out, lse) if return_softmax_lse else out


def _plain_batched_call(q, k_cache, v_cache, cache_seqlens, page_table, softmax_scale,
                        causal: bool, softcap: float, num_splits: int, return_softmax_lse: bool,
                        out):
    """``_plain_call``'s form with a 4-D ``q [b, s, Hq, D]`` (and no ``cu_seqlens_q``): the
    general path's steps for it in its order (packed q, the kept ``cu_seqlens_q``, the cache's
    rank, the default scale, ``out`` in the packed layout, the scale's finiteness, the debug
    value checks), none of its other argument forms; the results in the 4-D layout."""
    batch, seqlen, num_heads_q, head_dim = q.shape
    q3 = q.reshape(batch * seqlen, num_heads_q, head_dim)
    cu_seqlens_q = kvcache_layout.uniform_cu_seqlens(q, batch, seqlen)
    _check_cache_rank(NAME, "k_cache", k_cache)
    if softmax_scale is None:
        check_head_dim(NAME, "q", q3)
        softmax_scale = default_softmax_scale(head_dim)
    if out is None:  # _packed_out's new buffer, without its frame
        out3 = q3.new_empty((batch * seqlen, num_heads_q, v_cache.shape[-1]),
                            dtype=output_dtype(q3))
        mergeable = True
    else:
        out3, mergeable = _packed_out(NAME, out, q3, v_cache.shape[-1], (batch, seqlen))
    if not -math.inf < softmax_scale < math.inf:  # False for NaN too
        finite_scale(NAME, "softmax_scale", softmax_scale)
    _value_checks.check_flash_attn_with_kvcache(q3, k_cache, cache_seqlens, page_table,
                                                cu_seqlens_q, seqlen)
    lse = torch.ops.xpu_ops.flash_attn_with_kvcache.default(
        q3, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out3, None, None, None,
        None, None, None, None, seqlen, softmax_scale, causal, -1, 0 if causal else -1,
        softcap, num_splits, return_softmax_lse)
    if out is None and not return_softmax_lse:
        return out3.view(batch, seqlen, num_heads_q, out3.shape[2])
    result, lse = _unpacked(out, out3, lse if return_softmax_lse else None, (batch, seqlen),
                            mergeable)
    return (result, lse) if return_softmax_lse else result


def _check_keywords(attention_chunk, rotary_interleaved, num_splits, pack_gqa, sm_margin,
                    scheduler_metadata, max_seqlen_k, ver) -> None:
    """The scalar keywords (the usual call passes none of them, and is tested without building
    keyword dicts)."""
    fn = NAME
    if not (attention_chunk is None or type(attention_chunk) is int and attention_chunk == 0):
        check_not_implemented(fn, _KVCACHE_DEFAULTS, attention_chunk=attention_chunk)
    if not isinstance(rotary_interleaved, bool):
        fail(fn, "rotary_interleaved", "is not a bool", "True (GPT-J pairs) or False (NeoX)",
             type(rotary_interleaved).__name__, exc=TypeError)
    if not (type(num_splits) is int and num_splits >= 0):
        check_num_splits(fn, num_splits)
    if not (pack_gqa is None and sm_margin == 0 and scheduler_metadata is None
            and max_seqlen_k is None and type(ver) is int and ver == 3):
        check_speed_hints(fn, pack_gqa=pack_gqa, sm_margin=sm_margin,
                          scheduler_metadata=scheduler_metadata, max_seqlen_k=max_seqlen_k,
                          ver=ver)


def _unpacked(out, out3, lse, batch_shape, mergeable):
    """``(out, softmax_lse)`` in the caller's layout: for a 4-D q ``[b, s, Hq, Dv]`` (the
    caller's ``out`` when given) and ``[b, Hq, s]``; packed results as they are (``lse`` None
    when not requested)."""
    if batch_shape is None:
        return out3, lse
    if out is None:
        result = out3.view(*batch_shape, *out3.shape[1:])
    else:
        if not mergeable:
            out.copy_(out3.view(*batch_shape, *out3.shape[1:]))
        result = out
    if lse is None:
        return result, None
    return result, lse.view(lse.shape[0], *batch_shape).transpose(0, 1)


def _packed_out(fn, out, q3, head_dim_v, batch_shape):
    """``(out3 [total_q, Hq, Dv], mergeable)``: the op's output buffer for the caller's ``out``.

    For a 4-D q, ``out [b, s, Hq, Dv]`` is used as one token dimension when its strides allow
    (``mergeable``); otherwise the op writes a new contiguous buffer that is copied into ``out``.
    """
    if out is None:
        return q3.new_empty((q3.shape[0], q3.shape[1], head_dim_v), dtype=output_dtype(q3)), True
    if batch_shape is None:
        return out, True
    check_out(fn, out, (*batch_shape, q3.shape[1], head_dim_v), output_dtype(q3), q3.device,
              "[b, s, Hq, Dv] for a 4-D q")
    mergeable = out.shape[0] <= 1 or out.shape[1] <= 1 or out.stride(0) == (
        out.shape[1] * out.stride(1))
    out3 = (out.view(q3.shape[0], q3.shape[1], head_dim_v) if mergeable
            else q3.new_empty((q3.shape[0], q3.shape[1], head_dim_v), dtype=out.dtype))
    return out3, mergeable
