"""Reference ``flash_attn_varlen_func``: ragged K/V gathered into padded per-request blocks."""

from __future__ import annotations

import torch

from .. import provider_table
from .attention import attend_packed, dequantize, gather_padded, request_rows, tight_bound


@provider_table.register("flash_attn_varlen_func", "reference")
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, out, seqused_k, qv, q_descale,
                           k_descale, v_descale, sinks, seqused_q, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window_size_left, window_size_right, softcap,
                           num_splits):
    """Reference ``flash_attn_varlen_func`` (contract: ``xpu_ops/ops/varlen_attention.py``).

    Gathers the ragged K/V rows (``cu_seqlens_k``, cut to ``seqused_k`` when given) into padded
    float32 blocks, then masked softmax attention per request (rows past ``seqused_q`` see no
    key); writes ``out``, returns the LSE. One pass over the keys (``num_splits`` does not apply).
    """
    max_seqlen_k = tight_bound(cu_seqlens_k, max_seqlen_k, k.shape[0])
    k_idx, k_valid, k_lens = request_rows(cu_seqlens_k, max_seqlen_k, k.shape[0])
    if seqused_k is not None:
        k_lens = torch.minimum(seqused_k.long().clamp(min=0), k_lens)
        k_valid = k_valid & (torch.arange(max_seqlen_k, device=k.device)[None, :]
                             < k_lens[:, None])
    k_pad = dequantize(gather_padded(k, k_idx, k_valid), k_descale)
    v_pad = dequantize(gather_padded(v, k_idx, k_valid), v_descale)
    return attend_packed(q, cu_seqlens_q, max_seqlen_q, k_pad, v_pad, k_lens, out, qv=qv,
                         q_descale=q_descale, sinks=sinks, softmax_scale=softmax_scale,
                         window_size_left=window_size_left, window_size_right=window_size_right,
                         softcap=softcap, q_used=seqused_q)
