"""``flash_mla_decode``: absorbed MLA decode on the paged-attention kernel, split-KV.

MLA is paged attention with one KV head whose keys are ``[latent (R), rope (r)]`` and values the
latent part. The kernel's ``qv`` path computes exactly that without copying the cache:
``q := q_rope`` against ``k := kv_cache[..., R:]`` plus ``qv := q_nope`` against
``v := kv_cache[..., :R]`` (strided views), so each latent tile is loaded once and serves both the
score and the output product; all H query heads are packed into the M dimension.
Split-KV partials live in the caller's ``workspace`` (sized by ``flash_mla_get_workspace_size``);
the split count is ``min(mla_num_kv_splits(max_pages * page_size, num_kv_splits), workspace bytes
// mla_split_bytes)``: shapes only.
"""

from __future__ import annotations

import torch

from .. import provider_table
from ..mla_workspace import mla_num_kv_splits, mla_split_bytes
from ._common import available, next_pow2
from .paged_attention import paged_attention


def _supports(q_nope, q_rope, kv_cache, *args):
    if q_nope.shape[-1] > 512 or q_rope.shape[-1] > 256:
        return f"R={q_nope.shape[-1]} > 512 or r={q_rope.shape[-1]} > 256"
    if q_nope.shape[-1] != next_pow2(q_nope.shape[-1]):
        return f"R={q_nope.shape[-1]} is not a power of two (workspace layout)"
    return None


@provider_table.register("flash_mla_decode", "triton", available=available, supports=_supports)
def flash_mla_decode(q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace,
                     softmax_scale, num_kv_splits):
    """Triton ``flash_mla_decode`` (contract: ``xpu_ops/ops/mla_decode.py``).

    Runs ``paged_attention`` with one KV head through its ``qv`` path (q_rope vs the rope part,
    q_nope vs the latent part), split-KV with partials in ``workspace`` (split count from shapes
    only). Returns ``[b, H, R]`` in ``q_nope``'s dtype.
    """
    batch, num_heads, latent_dim = q_nope.shape
    out = q_nope.new_empty((batch, num_heads, latent_dim))
    if batch == 0:
        return out
    page_size = kv_cache.shape[1]
    split_bytes = mla_split_bytes(batch, num_heads, latent_dim)
    splits = min(mla_num_kv_splits(page_table.shape[1] * page_size, num_kv_splits),
                 workspace.numel() // split_bytes)
    splits = max(splits, 1)
    ws = workspace[:splits * split_bytes].view(torch.float32)
    o_part = ws[:splits * batch * num_heads * latent_dim].view(splits, batch, num_heads, latent_dim)
    lse_part = ws[splits * batch * num_heads * latent_dim:].view(splits, batch, num_heads)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=q_nope.device)
    keys = kv_cache[:, :, None, latent_dim:]          # [num_pages, page_size, 1, r]
    values = kv_cache[:, :, None, :latent_dim]        # [num_pages, page_size, 1, R]
    paged_attention(q_rope, keys, values, out, cache_seqlens, cu_seqlens_q,
                    page_table=page_table, cu_seqlens_k=None, max_seqlen_q=1,
                    max_kv_len=page_table.shape[1] * page_size, qv=q_nope, q_descale=None,
                    k_descale=None, v_descale=None, sinks=None, softmax_scale=softmax_scale,
                    window_left=-1, window_right=-1, softcap=0.0, num_splits=splits,
                    scratch=(o_part, lse_part))
    return out
