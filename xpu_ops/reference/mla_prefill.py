"""Reference ``flash_mla_prefill``: MLA is paged attention with one shared KV head."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import provider_table
from .attention import attend_packed
from .paged_attention import gather_pages, paged_lengths, request_spans


def mla_attention(q_nope: Tensor, q_rope: Tensor, kv_cache: Tensor, cu_seqlens_q: Tensor,
                  max_seqlen_q: int, seq_lens_k: Tensor, page_table: Tensor, *,
                  softmax_scale: float, causal: bool, per_request: bool = False) -> Tensor:
    """Absorbed MLA of packed queries ``[total_q, H, R]`` / ``[total_q, H, r]`` over the paged
    latent cache ``[num_pages, page_size, R + r]``: keys are whole token rows, values their first
    R entries. Returns ``[total_q, H, R]`` in ``q_nope``'s dtype.

    ``per_request`` (``num_kv_splits=1``, deterministic inference): each request runs as a batch
    of its own, over its own pages and query rows, so its bits do not depend on how wide the
    batch's padded block is (see ``paged_attention.flash_attn_with_kvcache``)."""
    if per_request:
        return _one_request_at_a_time(q_nope, q_rope, kv_cache, cu_seqlens_q, max_seqlen_q,
                                      seq_lens_k, page_table, softmax_scale=softmax_scale,
                                      causal=causal)
    latent_dim = q_nope.shape[-1]
    q = torch.cat([q_nope, q_rope], dim=-1)                                # [total_q, H, R + r]
    k_lens = paged_lengths(page_table, seq_lens_k, kv_cache.shape[1])
    kv, valid = gather_pages(kv_cache.unsqueeze(2), page_table, k_lens)   # [b, L, 1, R + r]
    out = q_nope.new_zeros(q_nope.shape)   # rows no request describes: 0 (API.md)
    attend_packed(q, cu_seqlens_q, max_seqlen_q, kv, kv[..., :latent_dim], k_lens, out,
                  qv=None, q_descale=None, sinks=None, softmax_scale=softmax_scale,
                  window_size_left=-1, window_size_right=0 if causal else -1, softcap=0.0,
                  key_valid=valid)
    return out


def _one_request_at_a_time(q_nope: Tensor, q_rope: Tensor, kv_cache: Tensor,
                           cu_seqlens_q: Tensor, max_seqlen_q: int, seq_lens_k: Tensor,
                           page_table: Tensor, *,
                           softmax_scale: float, causal: bool) -> Tensor:
    """``mla_attention`` once per request: its query rows, its ``[1, pages_r]`` page-table
    slice, ``max_seqlen_q`` its own row count (rows no request describes come back zero)."""
    out = torch.zeros_like(q_nope)
    for r, lo, hi, pages in request_spans(cu_seqlens_q, max_seqlen_q, q_nope.shape[0],
                                          page_table, seq_lens_k, kv_cache.shape[1]):
        out[lo:hi] = mla_attention(q_nope[lo:hi], q_rope[lo:hi], kv_cache,
                                   cu_seqlens_q.new_tensor([0, hi - lo]), hi - lo,
                                   seq_lens_k[r:r + 1], page_table[r:r + 1, :pages],
                                   softmax_scale=softmax_scale, causal=causal)
    return out


@provider_table.register("flash_mla_prefill", "reference")
def flash_mla_prefill(q_nope, q_pe, kv_c_and_k_pe_cache, cu_seqlens_q, seq_lens_k, page_table,
                      workspace, *, max_seqlen_q, sm_scale, causal, num_kv_splits):
    """Reference ``flash_mla_prefill`` (contract: ``xpu_ops/ops/mla_prefill.py``).

    Gathers each request's latent cache into a padded float32 block and runs masked softmax
    attention (bottom-right causal when ``causal``); ``workspace`` is unused, and
    ``num_kv_splits=1`` runs each request on its own (batch invariant, see ``mla_attention``).
    Returns ``[total_q, H, R]`` in ``q_nope``'s dtype.
    """
    return mla_attention(q_nope, q_pe, kv_c_and_k_pe_cache, cu_seqlens_q, max_seqlen_q,
                         seq_lens_k, page_table, softmax_scale=sm_scale, causal=causal,
                         per_request=num_kv_splits == 1)
