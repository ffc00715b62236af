"""Reference ``flash_mla_decode``: MLA decode is paged attention with one shared KV head."""

from __future__ import annotations

import torch

from .. import providers
from .attention import attend_packed
from .paged_attention import gather_pages, paged_lengths


@providers.register("flash_mla_decode", "reference")
def flash_mla_decode(q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace,
                     softmax_scale, num_kv_splits):
    """Reference ``flash_mla_decode`` (contract: ``xpu_ops/ops/mla_decode.py``).

    Gathers each request's latent cache into a padded block and runs masked softmax attention with
    one KV head (keys ``[R + r]``, values the latent ``[R]``); ``workspace`` and ``num_kv_splits``
    are unused. Returns ``[b, H, R]`` in ``q_nope``'s dtype.
    """
    batch, num_heads, latent_dim = q_nope.shape
    q = torch.cat([q_nope, q_rope], dim=-1)                        # [b, H, R + r], one token each
    k_lens = paged_lengths(page_table, cache_seqlens, kv_cache.shape[1])
    kv, valid = gather_pages(kv_cache.unsqueeze(2), page_table, k_lens)   # [b, L, 1, R + r]
    out = q_nope.new_empty((batch, num_heads, latent_dim))
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    attend_packed(q, cu_seqlens_q, 1, kv, kv[..., :latent_dim], k_lens, out, qv=None,
                  q_descale=None, sinks=None, softmax_scale=softmax_scale, window_size_left=-1,
                  window_size_right=-1, softcap=0.0, key_valid=valid)
    return out
