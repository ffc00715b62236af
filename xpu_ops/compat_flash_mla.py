"""sgl-kernel's ``sgl_kernel.flash_mla`` module on xpu-ops (the shim's ``flash_mla`` submodule).

sglang's sgl-kernel (CUDA) wraps an older FlashMLA: ``get_mla_metadata(cache_seqlens,
num_q_tokens_per_head_k, num_heads_k, num_heads_q=None, is_fp8_kvcache=False, topk=None)``,
``flash_mla_with_kvcache(..., causal=False, descale_q=None, descale_k=None,
is_fp8_kvcache=False, indices=None)`` and ``flash_mla_sparse_fwd(q, kv, indices, sm_scale,
d_v=512)`` whose ``max_logits`` and ``lse`` are in base 2 (``log2``-sum-``exp2`` of the scores
times ``log2(e)``). The first two are xpu-ops' own functions (their keywords are a superset);
``flash_mla_sparse_fwd`` here converts the natural-log statistics of
``xpu_ops.flash_mla_sparse_fwd`` to base 2. sgl-kernel-xpu's top-level ``sgl_kernel`` names keep
FlashMLA's natural log.
"""

from __future__ import annotations

import math

LOG2_E = 1.0 / math.log(2.0)
NAMES = ("get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd")


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """``xpu_ops.flash_mla_sparse_fwd`` with sgl-kernel's base-2 ``max_logits`` and ``lse``
    (``log2(e)`` times the natural values; -inf stays -inf).

    >>> import torch, xpu_ops
    >>> from xpu_ops import compat_flash_mla
    >>> q, kv = torch.randn(1, 2, 6), torch.randn(4, 1, 6)
    >>> idx = torch.tensor([[[0, 2, -1]]], dtype=torch.int32)
    >>> _, m, lse = compat_flash_mla.flash_mla_sparse_fwd(q, kv, idx, 0.5, d_v=4)
    >>> _, m_e, lse_e = xpu_ops.flash_mla_sparse_fwd(q, kv, idx, 0.5, d_v=4)
    >>> torch.allclose(lse, lse_e * LOG2_E) and torch.allclose(m, m_e * LOG2_E)
    True
    """
    import xpu_ops
    out, max_logits, lse = xpu_ops.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v,
                                                        attn_sink, topk_length)
    return out, max_logits * LOG2_E, lse * LOG2_E


def functions() -> dict:
    """The ``sgl_kernel.flash_mla`` module's names and their functions."""
    import xpu_ops
    return dict(get_mla_metadata=xpu_ops.get_mla_metadata,
                flash_mla_with_kvcache=xpu_ops.flash_mla_with_kvcache,
                flash_mla_sparse_fwd=flash_mla_sparse_fwd)


__all__ = ["NAMES", "LOG2_E", "flash_mla_sparse_fwd", "functions"]
