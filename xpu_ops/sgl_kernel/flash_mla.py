"""Native glue of the FlashMLA surface: sgl-kernel-xpu's ``flash_mla_sparse_decode`` and
``flash_mla_sparse_prefill`` (schemas in its ``src/torch_extension_sycl.cc``).

* ``flash_mla_with_kvcache`` (sparse only) -> ``flash_mla_sparse_decode(out, lse_out, q, k_cache,
  indices, topk_length, extra_k_cache, extra_indices, extra_topk_length, attn_sink, sm_scale,
  head_dim_v, is_fp8_kvcache)``: writes ``out [b, s_q, h_q, Dv]`` and ``lse [b, h_q, s_q]``.
* ``flash_mla_sparse_fwd`` -> ``flash_mla_sparse_prefill(out, max_logits, lse, q, kv, indices,
  sm_scale, head_dim_v, attn_sink, topk_length)``.

Small tensors (indices, lengths, sinks) are passed contiguous; caches must already be (a copy of
a whole cache per call is declined instead, and the call falls back). An LSE of ``+inf``
(FlashMLA's empty row) is returned as ``-inf`` (API.md). Limits (from sgl-kernel-xpu's Python
wrappers and tests; not measured): bfloat16 queries, ``Dv = 512`` with ``D`` 512 or 576, no dense
``block_table`` path. Nothing here has run on an Intel GPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import provider_table
from ..mla_fp8_layout import is_model1
from . import native

SPARSE_HEAD_DIMS = (512, 576)
SPARSE_HEAD_DIM_V = 512


def _contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


def _common_limits(q, caches, head_dim_v) -> Optional[str]:
    if q.dtype != torch.bfloat16:
        return f"native sparse MLA takes bfloat16 queries, got {q.dtype}"
    if head_dim_v != SPARSE_HEAD_DIM_V or q.shape[-1] not in SPARSE_HEAD_DIMS:
        return (f"native sparse MLA needs Dv = {SPARSE_HEAD_DIM_V} and D in {SPARSE_HEAD_DIMS}, "
                f"got Dv = {head_dim_v}, D = {q.shape[-1]}")
    if any(c is not None and not c.is_contiguous() for c in caches):
        return "the cache is not contiguous (a per-call copy of a whole cache is not made)"
    return None


def _kvcache_limits(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
                    is_fp8_kvcache, indices, attn_sink, extra_k_cache, *args) -> Optional[str]:
    if indices is None:
        return "sgl-kernel-xpu has no dense (block_table) flash_mla_with_kvcache"
    if is_fp8_kvcache and is_model1(q.shape[-1], head_dim_v, k_cache.shape[-1]):
        return _common_limits(q, (), head_dim_v)    # DeepSeek-V4 pages: the kernel's own view
    return _common_limits(q, (k_cache, extra_k_cache), head_dim_v)


def _sparse_fwd_limits(q, kv, indices, sm_scale, d_v, *args) -> Optional[str]:
    return _common_limits(q, (kv,), d_v)


def _available(op: str):
    def available(device_type: str) -> Optional[str]:
        return native.unavailable(op, device_type)
    return available


def _empty_is_minus_inf(lse: torch.Tensor) -> torch.Tensor:
    return lse.masked_fill(lse == float("inf"), float("-inf"))


@provider_table.register("flash_mla_with_kvcache", "sgl_kernel",
                         available=_available("flash_mla_sparse_decode"),
                         supports=_kvcache_limits)
def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
                           causal, is_fp8_kvcache, indices, attn_sink, extra_k_cache,
                           extra_indices_in_kvcache, topk_length, extra_topk_length):
    """sgl_kernel ``flash_mla_with_kvcache`` (contract: ``xpu_ops/ops/flash_mla_kvcache.py``),
    sparse calls only: native ``flash_mla_sparse_decode``. Returns ``(out, lse)``."""
    batch, seqlen_q, num_heads, _ = q.shape
    out = q.new_empty((batch, seqlen_q, num_heads, head_dim_v))
    lse = q.new_empty((batch, num_heads, seqlen_q), dtype=torch.float32)
    native.packet("flash_mla_sparse_decode").default(
        out, lse, q.contiguous(), k_cache, indices.contiguous(), _contiguous(topk_length),
        extra_k_cache, _contiguous(extra_indices_in_kvcache), _contiguous(extra_topk_length),
        _contiguous(attn_sink), softmax_scale, head_dim_v, is_fp8_kvcache)
    return out, _empty_is_minus_inf(lse)


@provider_table.register("flash_mla_sparse_fwd", "sgl_kernel",
                         available=_available("flash_mla_sparse_prefill"),
                         supports=_sparse_fwd_limits)
def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    """sgl_kernel ``flash_mla_sparse_fwd`` (contract: ``xpu_ops/ops/mla_sparse_prefill.py``):
    native ``flash_mla_sparse_prefill``. Returns ``(out, max_logits, lse)``."""
    seqlen_q, num_heads, _ = q.shape
    out = q.new_empty((seqlen_q, num_heads, d_v))
    max_logits = q.new_empty((seqlen_q, num_heads), dtype=torch.float32)
    lse = torch.empty_like(max_logits)
    native.packet("flash_mla_sparse_prefill").default(
        out, max_logits, lse, q.contiguous(), kv, indices.contiguous(), sm_scale, d_v,
        _contiguous(attn_sink), _contiguous(topk_length))
    return out, max_logits, _empty_is_minus_inf(lse)


__all__ = ["flash_mla_with_kvcache", "flash_mla_sparse_fwd"]
