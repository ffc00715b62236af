"""``flash_mla_sparse_fwd``: FlashMLA's sparse MLA prefill (DeepSeek-V3.2 DSA).

Every query token attends over its own top-k selection of a flat latent KV array: token ``t``
reads rows ``indices[t, 0, :topk_length[t]]`` of ``kv`` (an index < 0 or >= s_kv is skipped),
all heads over one latent KV head. Returns the output, the maximum logit and the LSE of each
(token, head), as FlashMLA does.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _value_checks
from .._registration import define_op
from .._checks import (FLOAT_DTYPES, check_size, check_tensor, check_tensor_args, fail,
                       int_scalar)
from .common import check_index, finite_scale

NAME = "flash_mla_sparse_fwd"


def _check_flash_mla_sparse_fwd(q, kv, indices, d_v, attn_sink, topk_length) -> None:
    """Validate shapes/dtypes/devices (runs in the fake too)."""
    fn = NAME
    check_tensor(fn, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    seqlen_q, num_heads, head_dim = q.shape
    device = q.device
    check_tensor(fn, "kv", kv, ndim=3, dtypes=(q.dtype,), device=device)
    check_size(fn, "kv", kv, 1, 1, "one latent KV head (MLA)")
    check_size(fn, "kv", kv, 2, head_dim, "q.shape[2] (d_qk)")
    check_index(fn, "indices", indices, 3, device)
    check_size(fn, "indices", indices, 0, seqlen_q, "q.shape[0] (s_q)")
    check_size(fn, "indices", indices, 1, 1, "kv.shape[1] (h_kv)")
    if not 1 <= d_v <= head_dim:
        fail(fn, "d_v", "is out of range", f"1 <= d_v <= d_qk = {head_dim}", d_v)
    if attn_sink is not None:
        check_tensor(fn, "attn_sink", attn_sink, ndim=1, dtypes=(torch.float32,), device=device)
        check_size(fn, "attn_sink", attn_sink, 0, num_heads, "q.shape[1] (h_q)")
    if topk_length is not None:
        check_index(fn, "topk_length", topk_length, 1, device)
        check_size(fn, "topk_length", topk_length, 0, seqlen_q, "q.shape[0] (s_q)")


@define_op("xpu_ops::flash_mla_sparse_fwd", mutates_args=(), by_device=True)
def flash_mla_sparse_fwd_op(q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float, d_v: int,
                            attn_sink: Optional[Tensor],
                            topk_length: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Op form of ``flash_mla_sparse_fwd``; returns new ``(out [s_q, h_q, d_v], max_logits
    [s_q, h_q], lse [s_q, h_q])``."""
    finite_scale(NAME, "sm_scale", sm_scale)
    _check_flash_mla_sparse_fwd(q, kv, indices, d_v, attn_sink, topk_length)
    _value_checks.check_sinks(NAME, "attn_sink", attn_sink)


@flash_mla_sparse_fwd_op.register_fake
def _(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    finite_scale(NAME, "sm_scale", sm_scale)
    _check_flash_mla_sparse_fwd(q, kv, indices, d_v, attn_sink, topk_length)
    seqlen_q, num_heads = q.shape[:2]
    stats = q.new_empty((seqlen_q, num_heads), dtype=torch.float32)
    return q.new_empty((seqlen_q, num_heads, d_v)), stats, torch.empty_like(stats)


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """Sparse MLA prefill: each query token attends over its own top-k rows of ``kv``.

    Token ``t`` reads rows ``indices[t, 0, k]`` for ``k < topk_length[t]`` (all ``topk`` when
    None); an index < 0 or >= s_kv is skipped, a row listed twice counts twice. Scores
    ``s = sm_scale * q[t, h] . kv[j, 0]`` over the full ``d_qk``; values are the first ``d_v``
    entries of each row. ``attn_sink [h_q]``: ``out = sum_j e^{s_j} v_j / (e^{sink} +
    sum_j e^{s_j})`` (+inf gives 0, -inf no effect); it changes neither ``max_logits`` nor
    ``lse``. A token with no valid index gets output 0, max_logits -inf and LSE -inf.

    Args:
        q: [s_q, h_q, d_qk] bf16|fp16|fp32.
        kv: [s_kv, 1, d_qk] in q's dtype (one latent KV head).
        indices: [s_q, 1, topk] int32 rows of kv.
        sm_scale: finite float multiplying every score (no default, as FlashMLA).
        d_v: value dims, 1 <= d_v <= d_qk (512 for DeepSeek).
        attn_sink: [h_q] float32 or None. topk_length: [s_q] int32 or None.
    Returns:
        ``(out [s_q, h_q, d_v] q's dtype, max_logits [s_q, h_q] float32, lse [s_q, h_q]
        float32)``; max_logits and lse in natural-log units of the scaled scores.
    Raises:
        TypeError/ValueError: shape, dtype or device mismatch, naming the argument.
    Source: FlashMLA ``flash_mla_sparse_fwd`` and ``tests/ref.py`` (semantics); DeepSeek-V3.2.

    >>> import torch, xpu_ops
    >>> q, kv = torch.randn(1, 2, 6), torch.randn(5, 1, 6)
    >>> out, m, lse = xpu_ops.flash_mla_sparse_fwd(
    ...     q, kv, torch.tensor([[[3, -1, 0, 9]]], dtype=torch.int32), 0.5, d_v=4)
    >>> s = 0.5 * q[0] @ kv[[3, 0], 0].T
    >>> torch.allclose(out[0], s.softmax(-1) @ kv[[3, 0], 0, :4], atol=1e-5)
    True
    >>> torch.allclose(lse[0], s.logsumexp(-1)) and torch.allclose(m[0], s.amax(-1))
    True
    """
    check_tensor_args(NAME, ("attn_sink", "topk_length"), q=q, kv=kv, indices=indices,
                      attn_sink=attn_sink, topk_length=topk_length)
    return torch.ops.xpu_ops.flash_mla_sparse_fwd(
        q, kv, indices, finite_scale(NAME, "sm_scale", sm_scale), int_scalar(NAME, "d_v", d_v),
        attn_sink, topk_length)


__all__ = ["flash_mla_sparse_fwd", "flash_mla_sparse_fwd_op"]
