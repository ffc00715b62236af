"""``flash_attn_varlen_func`` on the paged-attention kernel family, with ragged K/V rows.

Key ``j`` of request ``r`` is row ``cu_seqlens_k[r] + j`` of ``k [total_k, Hkv, D]`` (``PAGED``
off); the request has ``seqused_k[r]`` keys when given, else ``cu_seqlens_k[r + 1] -
cu_seqlens_k[r]``. Everything else (GQA packing, masks, split-KV, LSE) is shared.
"""

from __future__ import annotations

from .. import provider_table
from ._common import available
from .paged_attention import requested_splits, paged_attention, supports_attention


@provider_table.register("flash_attn_varlen_func", "triton", available=available,
                    supports=lambda q, k, v, cu_seqlens_q, cu_seqlens_k, out, seqused_k, qv, *a,
                    **kw: supports_attention(q, k, v, out, qv))
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, out, seqused_k, qv, q_descale,
                           k_descale, v_descale, sinks, seqused_q, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window_size_left, window_size_right, softcap,
                           num_splits):
    """Triton ``flash_attn_varlen_func`` (contract: ``xpu_ops/ops/varlen_attention.py``).

    ``paged_attention`` on ragged K/V rows (no page table); per-request key counts are
    ``seqused_k`` or the ``cu_seqlens_k`` differences; ``seqused_q`` masks the unused rows.
    Writes ``out``, returns the LSE.
    """
    # Without seqused_k, the kernel's clamped cu_seqlens_k range is the key count; the range's
    # end is a bound of it that never overflows (an int32 difference with INT32_MIN would).
    kv_lens = seqused_k if seqused_k is not None else cu_seqlens_k[1:]
    return paged_attention(
        q, k, v, out, kv_lens, cu_seqlens_q, page_table=None, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_kv_len=max_seqlen_k, qv=qv, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, sinks=sinks, softmax_scale=softmax_scale,
        window_left=window_size_left, window_right=window_size_right, softcap=softcap,
        num_splits=requested_splits(num_splits), q_used=seqused_q)
