"""``flash_mla_prefill``: absorbed MLA over ragged new tokens on the paged-attention kernel.

As in ``mla_decode``, MLA is paged attention with one KV head: ``q := q_pe`` against the rope
part of the cache and ``qv := q_nope`` against the latent part, which also serves as the values
(strided views of the cache, no copy). Here each request brings ``cu_seqlens_q`` rows, causal
bottom-right, and the kernel runs one pass over the keys (``num_splits=1``): prefill has enough
query rows to fill the device, so no split-KV scratch is needed.
"""

from __future__ import annotations

from .. import provider_table
from ._common import available
from .paged_attention import paged_attention


def _supports(q_nope, q_pe, *args, **kwargs):
    if q_nope.shape[-1] > 512 or q_pe.shape[-1] > 256:
        return f"R={q_nope.shape[-1]} > 512 or r={q_pe.shape[-1]} > 256"
    return None


@provider_table.register("flash_mla_prefill", "triton", available=available, supports=_supports)
def flash_mla_prefill(q_nope, q_pe, kv_c_and_k_pe_cache, cu_seqlens_q, seq_lens_k, page_table,
                      workspace, *, max_seqlen_q, sm_scale, causal, num_kv_splits):
    """Triton ``flash_mla_prefill`` (contract: ``xpu_ops/ops/mla_prefill.py``).

    Runs ``paged_attention`` with one KV head through its ``qv`` path, one pass over the keys;
    ``workspace`` and ``num_kv_splits`` are unused. Returns ``[total_q, H, R]`` in ``q_nope``'s
    dtype.
    """
    latent_dim = q_nope.shape[-1]
    out = q_nope.new_zeros(q_nope.shape)   # rows no request describes: 0 (API.md)
    if q_nope.shape[0] == 0:
        return out
    kv = kv_c_and_k_pe_cache
    keys = kv[:, :, None, latent_dim:]          # [num_pages, page_size, 1, r]
    values = kv[:, :, None, :latent_dim]        # [num_pages, page_size, 1, R]
    paged_attention(q_pe, keys, values, out, seq_lens_k, cu_seqlens_q, page_table=page_table,
                    cu_seqlens_k=None, max_seqlen_q=max_seqlen_q,
                    max_kv_len=page_table.shape[1] * kv.shape[1], qv=q_nope, q_descale=None,
                    k_descale=None, v_descale=None, sinks=None, softmax_scale=sm_scale,
                    window_left=-1, window_right=0 if causal else -1, softcap=0.0, num_splits=1)
    return out
