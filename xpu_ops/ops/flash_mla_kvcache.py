"""``flash_mla_with_kvcache`` and ``get_mla_metadata``: FlashMLA's decode surface.

MLA attention of ``s_q`` query tokens per request over one latent KV head of a paged cache,
returning the output and the LSE as FlashMLA does. Two modes:

- **dense** (``indices`` None): request ``i`` reads its first ``cache_seqlens[i]`` tokens
  through ``block_table``; with ``causal`` its query row ``s`` sees keys ``j <= Lk - s_q + s``
  (bottom-right aligned, as speculative verify and MTP need).
- **sparse** (``indices`` given, DeepSeek-V3.2's DSA): query row ``(i, s)`` reads exactly the
  slots ``indices[i, s, :topk_length[i]]`` of the paged cache (slot = page * page_size +
  offset; -1 or any slot outside the cache is skipped), plus the slots
  ``extra_indices_in_kvcache[i, s, :extra_topk_length[i]]`` of ``extra_k_cache``, all in one
  softmax; ``attn_sink`` adds one logit per head to its denominator.

``get_mla_metadata`` returns a plan for FlashMLA's calling convention; the providers accept it
and ignore it: results never depend on it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from .. import _value_checks
from .._registration import define_op
from .._checks import (FLOAT_DTYPES, check_contiguous_last, check_size, check_tensor,
                       check_tensor_args, fail, int_scalar)
from ..mla_fp8_layout import FP8_TILE, MODEL1_VIEW_BYTES, fp8_token_bytes, is_model1
from .common import check_flag, check_index, finite_scale
from .flash_mla_descale import FP8_DTYPES, dequantized_inputs

NAME = "flash_mla_with_kvcache"
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
TILE_SCHEDULER_METADATA_SIZE = 8     # int32 words per scheduler part (FlashMLA's layout)
_SPARSE_ONLY = ("attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "topk_length",
                "extra_topk_length")


@dataclasses.dataclass
class FlashMLASchedMeta:
    """The plan ``get_mla_metadata()`` returns when called without arguments (FlashMLA's current
    form). xpu-ops' kernels need no schedule: the plan only records the call's arguments, and
    ``flash_mla_with_kvcache`` accepts it, a tensor, or None alike."""
    arguments: dict = dataclasses.field(default_factory=dict)


def get_mla_metadata(cache_seqlens: Optional[Tensor] = None, num_q_tokens_per_head_k=None,
                     num_heads_k=None, num_heads_q=None, is_fp8_kvcache: bool = False,
                     topk=None, **kwargs):
    """FlashMLA's scheduling metadata, for ``flash_mla_with_kvcache``'s calling convention.

    Two forms, as the two generations of the interface call it:

    - ``get_mla_metadata()`` (FlashMLA today): returns ``(FlashMLASchedMeta(), None)``.
    - ``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
      is_fp8_kvcache=False, topk=None)`` (sgl-kernel): returns ``(tile_scheduler_metadata
      [1, 8] int32 zeros, num_splits [b + 1] int32 = 0, 1, ..., b)`` on ``cache_seqlens``'s
      device: one split per request. Built without reading ``cache_seqlens``' values (no host
      sync), so it may run inside a captured graph.

    The kernels here schedule themselves: ``flash_mla_with_kvcache`` ignores the metadata and
    its results never depend on it (a plan from other shapes is fine).

    Raises:
        TypeError: ``cache_seqlens`` is given but is not a tensor.
    Source: FlashMLA ``get_mla_metadata``; sgl-kernel's ``flash_mla.get_mla_metadata``.

    >>> import torch
    >>> meta, splits = get_mla_metadata(torch.tensor([5, 9], dtype=torch.int32), 64, 1)
    >>> meta.shape, splits.tolist()
    (torch.Size([1, 8]), [0, 1, 2])
    """
    if cache_seqlens is None:
        given = dict(num_q_tokens_per_head_k=num_q_tokens_per_head_k, num_heads_k=num_heads_k,
                     num_heads_q=num_heads_q, is_fp8_kvcache=is_fp8_kvcache, topk=topk, **kwargs)
        return FlashMLASchedMeta({k: v for k, v in given.items() if v is not None}), None
    check_tensor("get_mla_metadata", "cache_seqlens", cache_seqlens, ndim=1)
    device = cache_seqlens.device
    metadata = torch.zeros((1, TILE_SCHEDULER_METADATA_SIZE), dtype=torch.int32, device=device)
    num_splits = torch.arange(cache_seqlens.shape[0] + 1, dtype=torch.int32, device=device)
    return metadata, num_splits


def _check_cache(fn, arg, cache, q, head_dim_v, is_fp8) -> None:
    """``[num_blocks, page_size, 1, D]`` in q's dtype, or FlashMLA's fp8 bytes per token."""
    device, head_dim = q.device, q.shape[-1]
    if is_fp8:
        check_tensor(fn, arg, cache, ndim=4, dtypes=FP8_CACHE_DTYPES, device=device,
                     fix="An fp8 cache holds FlashMLA's bytes per token (float8_e4m3fn or "
                         "uint8 view).")
        check_contiguous_last(fn, arg, cache)
        if is_model1(head_dim, head_dim_v, cache.shape[3]):
            _check_model1_pages(fn, arg, cache)
            return
        check_size(fn, arg, cache, 3, fp8_token_bytes(head_dim, head_dim_v),
                   "bytes per token Dv + 4 * Dv / 128 + 2 * (D - Dv)")
    else:
        check_tensor(fn, arg, cache, ndim=4, dtypes=(q.dtype,), device=device,
                     fix="Pass is_fp8_kvcache=True for an fp8 cache, else use q's dtype.")
        check_size(fn, arg, cache, 3, head_dim, "q.shape[-1] (D)")
    check_size(fn, arg, cache, 2, 1, "one latent KV head (MLA)")


def _check_model1_pages(fn, arg, cache) -> None:
    """DeepSeek-V4 pages: one latent head; each page's bytes (``stride(0)``) hold its tokens'
    576-byte data and 8-byte scale groups."""
    check_size(fn, arg, cache, 2, 1, "one latent KV head (MLA)")
    need = cache.shape[1] * MODEL1_VIEW_BYTES
    if cache.shape[0] > 1 and cache.stride(0) < need:
        fail(fn, arg, "has pages too small for DeepSeek-V4's layout",
             f"stride(0) (bytes per page) >= page_size * 584 = {need}", cache.stride(0),
             "View the raw page buffer with its page stride.")


def _check_head_dims(fn, q, head_dim_v, is_fp8) -> None:
    head_dim = q.shape[-1]
    if not 1 <= head_dim_v <= head_dim:
        fail(fn, "head_dim_v", "is out of range", f"1 <= head_dim_v <= D = {head_dim}",
             head_dim_v)
    if is_fp8 and head_dim_v % FP8_TILE:
        fail(fn, "head_dim_v", "is not a whole number of fp8 scale tiles",
             f"a multiple of {FP8_TILE} with is_fp8_kvcache=True", head_dim_v)


def _check_sparse(fn, q, head_dim_v, is_fp8, causal, indices, attn_sink, extra_k_cache,
                  extra_indices, topk_length, extra_topk_length) -> None:
    batch, seqlen_q, num_heads = q.shape[:3]
    device = q.device
    if causal:
        fail(fn, "causal", "is True with sparse attention (indices given)",
             "causal=False (the indices select the keys)", True)
    for arg, idx in (("indices", indices), ("extra_indices_in_kvcache", extra_indices)):
        if idx is not None:
            check_index(fn, arg, idx, 3, device)
            check_size(fn, arg, idx, 0, batch, "q.shape[0] (b)")
            check_size(fn, arg, idx, 1, seqlen_q, "q.shape[1] (s_q)")
    for arg, length in (("topk_length", topk_length), ("extra_topk_length", extra_topk_length)):
        if length is not None:
            check_index(fn, arg, length, 1, device)
            check_size(fn, arg, length, 0, batch, "q.shape[0] (b)")
    if attn_sink is not None:
        check_tensor(fn, "attn_sink", attn_sink, ndim=1, dtypes=(torch.float32,), device=device)
        check_size(fn, "attn_sink", attn_sink, 0, num_heads, "q.shape[2] (h_q)")
    if (extra_k_cache is None) != (extra_indices is None):
        fail(fn, "extra_k_cache", "and extra_indices_in_kvcache are not given together",
             "both or neither", "only one of them")
    if extra_topk_length is not None and extra_indices is None:
        fail(fn, "extra_topk_length", "is given without extra_indices_in_kvcache",
             "extra_topk_length only with extra_k_cache", "a tensor")
    if extra_k_cache is not None:
        _check_cache(fn, "extra_k_cache", extra_k_cache, q, head_dim_v, is_fp8)


def _check_dense(fn, q, block_table, cache_seqlens, **sparse_only) -> None:
    batch, device = q.shape[0], q.device
    for arg, value in sparse_only.items():
        if value is not None:
            fail(fn, arg, "is given with dense attention (indices None)",
                 "None unless indices selects the keys", "a tensor")
    for arg, t, ndim in (("block_table", block_table, 2), ("cache_seqlens", cache_seqlens, 1)):
        if t is None:
            fail(fn, arg, "is None with dense attention (indices None)",
                 "an int32 tensor (or indices for sparse attention)", None)
        check_index(fn, arg, t, ndim, device)
        check_size(fn, arg, t, 0, batch, "q.shape[0] (b)")


def _check_flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, causal,
                                  is_fp8_kvcache, indices, attn_sink, extra_k_cache,
                                  extra_indices_in_kvcache, topk_length,
                                  extra_topk_length) -> None:
    """Validate shapes/dtypes/devices (runs in the fake too)."""
    fn = NAME
    check_tensor(fn, "q", q, ndim=4, dtypes=FLOAT_DTYPES)
    _check_head_dims(fn, q, head_dim_v, is_fp8_kvcache)
    _check_cache(fn, "k_cache", k_cache, q, head_dim_v, is_fp8_kvcache)
    if indices is None:
        _check_dense(fn, q, block_table, cache_seqlens, attn_sink=attn_sink,
                     extra_k_cache=extra_k_cache,
                     extra_indices_in_kvcache=extra_indices_in_kvcache,
                     topk_length=topk_length, extra_topk_length=extra_topk_length)
        return
    _check_sparse(fn, q, head_dim_v, is_fp8_kvcache, causal, indices, attn_sink, extra_k_cache,
                  extra_indices_in_kvcache, topk_length, extra_topk_length)
    for arg, t, ndim in (("block_table", block_table, 2), ("cache_seqlens", cache_seqlens, 1)):
        if t is not None:    # unused by sparse attention; sgl-kernel's callers still pass them
            check_index(fn, arg, t, ndim, q.device)


def _outputs(q: Tensor, head_dim_v) -> tuple[Tensor, Tensor]:
    batch, seqlen_q, num_heads = q.shape[:3]
    return (q.new_empty((batch, seqlen_q, num_heads, head_dim_v)),
            q.new_empty((batch, num_heads, seqlen_q), dtype=torch.float32))


@define_op("xpu_ops::flash_mla_with_kvcache", mutates_args=(), by_device=True)
def flash_mla_with_kvcache_op(q: Tensor, k_cache: Tensor, block_table: Optional[Tensor],
                              cache_seqlens: Optional[Tensor], head_dim_v: int,
                              softmax_scale: float, causal: bool, is_fp8_kvcache: bool,
                              indices: Optional[Tensor], attn_sink: Optional[Tensor],
                              extra_k_cache: Optional[Tensor],
                              extra_indices_in_kvcache: Optional[Tensor],
                              topk_length: Optional[Tensor],
                              extra_topk_length: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Op form of ``flash_mla_with_kvcache`` (no scheduler arguments); returns new
    ``(out [b, s_q, h_q, Dv], lse [b, h_q, s_q] float32)``."""
    finite_scale(NAME, "softmax_scale", softmax_scale)
    _check_flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, causal,
                                  is_fp8_kvcache, indices, attn_sink, extra_k_cache,
                                  extra_indices_in_kvcache, topk_length, extra_topk_length)
    _value_checks.check_sinks(NAME, "attn_sink", attn_sink)


@flash_mla_with_kvcache_op.register_fake
def _(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, is_fp8_kvcache,
      indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
      extra_topk_length):
    finite_scale(NAME, "softmax_scale", softmax_scale)
    _check_flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, causal,
                                  is_fp8_kvcache, indices, attn_sink, extra_k_cache,
                                  extra_indices_in_kvcache, topk_length, extra_topk_length)
    return _outputs(q, head_dim_v)


def _check_schedule(tile_scheduler_metadata, num_splits) -> None:
    # FlashMLA's own plan (flash_mla.FlashMLASchedMeta) is accepted by its name, duck-typed.
    plan = type(tile_scheduler_metadata).__name__ == FlashMLASchedMeta.__name__
    if not (tile_scheduler_metadata is None or plan
            or isinstance(tile_scheduler_metadata, Tensor)):
        fail(NAME, "tile_scheduler_metadata", "is not a schedule",
             "None, a tensor or get_mla_metadata()'s plan",
             type(tile_scheduler_metadata).__name__, exc=TypeError)
    if not (num_splits is None or isinstance(num_splits, Tensor)):
        fail(NAME, "num_splits", "is not a tensor", "None or get_mla_metadata()'s tensor",
             type(num_splits).__name__, exc=TypeError)


def flash_mla_with_kvcache(q, k_cache, block_table=None, cache_seqlens=None, head_dim_v=512,
                           tile_scheduler_metadata=None, num_splits=None, softmax_scale=None,
                           causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None,
                           extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None, *, descale_q=None, descale_k=None):
    """MLA attention over a paged latent cache, dense or sparse, with the LSE (FlashMLA's API).

    Scores ``s_j = softmax_scale * q . k_j`` over the full head (``D``, latent then rope);
    values are the first ``head_dim_v`` entries of each key. Dense: request ``i`` reads its first
    ``cache_seqlens[i]`` tokens through ``block_table`` (``causal``: row ``s`` sees keys
    ``j <= cache_seqlens[i] - s_q + s``). Sparse (``indices`` given): row ``(i, s)`` reads the
    slots ``indices[i, s, :topk_length[i]]`` (slot = page id * page_size + offset; -1 or a slot
    outside ``k_cache`` is skipped; a slot listed twice counts twice), plus
    ``extra_indices_in_kvcache[i, s, :extra_topk_length[i]]`` of ``extra_k_cache``, in one
    softmax. ``attn_sink [h_q]``: ``out = sum_j e^{s_j} v_j / (e^{sink} + sum_j e^{s_j})``
    (+inf gives 0, -inf no effect); the returned LSE excludes the sink, as FlashMLA's does.
    A row with no key gets output 0 and LSE -inf.

    Args:
        q: [b, s_q, h_q, D] bf16|fp16|fp32 (float8 with ``descale_q``).
        k_cache: [num_blocks, page_size, 1, D] in q's dtype, or with ``is_fp8_kvcache`` FlashMLA's
            fp8 token bytes ``[num_blocks, page_size, 1, Dv + 4 * Dv / 128 + 2 * (D - Dv)]``
            (float8_e4m3fn or uint8; see ``xpu_ops.mla_fp8_layout``), or DeepSeek-V4's pages
            (``D = Dv = 512``, a ``[..., 584]`` view, ``stride(0)`` bytes per page).
        block_table: [b, max_blocks] int32 page ids (dense; optional and unused when sparse).
        cache_seqlens: [b] int32 tokens per request (dense; optional and unused when sparse).
        head_dim_v: Dv, 1 <= Dv <= D (a multiple of 128 with fp8); 512 for DeepSeek.
        tile_scheduler_metadata, num_splits: ``get_mla_metadata()``'s results, or None:
            accepted and ignored (results never depend on them).
        softmax_scale: finite float, default ``D ** -0.5``.
        causal: bottom-right causal mask (dense only).
        is_fp8_kvcache: the caches hold FlashMLA's fp8 token bytes.
        indices: [b, s_q, topk] int32 slots (sparse). topk_length: [b] int32 or None.
        attn_sink: [h_q] float32 or None (sparse).
        extra_k_cache: a second cache in k_cache's format (its own page size) or None;
            extra_indices_in_kvcache: [b, s_q, extra_topk] int32; extra_topk_length: [b] int32.
        descale_q, descale_k: float32 ``[1]`` or ``[b]`` (sgl-kernel's FlashMLA fp8 path): the
            query is ``q * descale_q`` (``q`` float8), keys and values ``k_cache * descale_k``
            (a plain float8 ``k_cache`` without ``is_fp8_kvcache``); output bfloat16
            (``xpu_ops.ops.flash_mla_descale``). Given exactly when that side is float8.
    Returns:
        ``(out [b, s_q, h_q, Dv] q's dtype, lse [b, h_q, s_q] float32, natural log)``.
    Raises:
        TypeError/ValueError: shape, dtype, device or mode mismatch, naming the argument
            (sparse-only arguments with dense attention, causal with sparse, a missing
            block_table or cache_seqlens when dense).
        ValueError: with ``XPU_OPS_DEBUG_CHECKS=1`` (dense), ``cache_seqlens`` past the block
            table or a page id that is read out of range.
    Source: FlashMLA ``flash_mla_interface.py`` and ``tests/ref.py`` (semantics);
    DeepSeek-V2 (arXiv 2405.04434) MLA; DeepSeek-V3.2 DSA sparse attention.

    >>> import torch, xpu_ops
    >>> q, kv = torch.randn(1, 1, 2, 6), torch.randn(2, 4, 1, 6)
    >>> idx = torch.tensor([[[5, -1, 0]]], dtype=torch.int32)
    >>> out, lse = xpu_ops.flash_mla_with_kvcache(q, kv, None, None, 4, None, None, 0.5,
    ...                                           indices=idx)
    >>> keys = kv.view(8, 6)[[5, 0]]
    >>> p = (0.5 * q[0, 0] @ keys.T).softmax(-1)
    >>> torch.allclose(out[0, 0], p @ keys[:, :4], atol=1e-5), out.shape, lse.shape
    (True, torch.Size([1, 1, 2, 4]), torch.Size([1, 2, 1]))
    """
    check_tensor_args(NAME, ("block_table", "cache_seqlens", "indices", "attn_sink",
                             "extra_k_cache", "extra_indices_in_kvcache", "topk_length",
                             "extra_topk_length"),
                      q=q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                      indices=indices, attn_sink=attn_sink, extra_k_cache=extra_k_cache,
                      extra_indices_in_kvcache=extra_indices_in_kvcache,
                      topk_length=topk_length, extra_topk_length=extra_topk_length)
    _check_schedule(tile_scheduler_metadata, num_splits)
    is_fp8_kvcache = check_flag(NAME, "is_fp8_kvcache", is_fp8_kvcache)
    out_scale = None
    if descale_q is not None or descale_k is not None or q.dtype in FP8_DTYPES:
        q, k_cache, out_scale = dequantized_inputs(NAME, q, k_cache, is_fp8_kvcache, descale_q,
                                                   descale_k)
    head_dim_v = int_scalar(NAME, "head_dim_v", head_dim_v)
    if indices is None:
        _value_checks.check_flash_mla_with_kvcache(k_cache, block_table, cache_seqlens)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    out, lse = torch.ops.xpu_ops.flash_mla_with_kvcache(
        q, k_cache, block_table, cache_seqlens, head_dim_v,
        finite_scale(NAME, "softmax_scale", softmax_scale), check_flag(NAME, "causal", causal),
        is_fp8_kvcache, indices, attn_sink, extra_k_cache, extra_indices_in_kvcache,
        topk_length, extra_topk_length)
    if out_scale is not None:            # the values' descale (ops/flash_mla_descale.py)
        out = (out.float() * out_scale).to(out.dtype)
    return out, lse


__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache",
           "flash_mla_with_kvcache_op"]
