"""Reference ``flash_mla_decode``: MLA decode is paged attention with one shared KV head."""

from __future__ import annotations

import torch

from .. import provider_table
from .mla_prefill import mla_attention


@provider_table.register("flash_mla_decode", "reference")
def flash_mla_decode(q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace,
                     softmax_scale, num_kv_splits):
    """Reference ``flash_mla_decode`` (contract: ``xpu_ops/ops/mla_decode.py``).

    One query token per request over its whole cache (``mla_attention``); ``workspace`` is
    unused, and ``num_kv_splits=1`` runs each request on its own (batch invariant). Returns
    ``[b, H, R]`` in ``q_nope``'s dtype.
    """
    cu_seqlens_q = torch.arange(q_nope.shape[0] + 1, dtype=torch.int32, device=q_nope.device)
    return mla_attention(q_nope, q_rope, kv_cache, cu_seqlens_q, 1, cache_seqlens, page_table,
                         softmax_scale=softmax_scale, causal=False,
                         per_request=num_kv_splits == 1)
