"""``sparse_attn_varlen_func``: sgl-kernel-xpu's packed-sequence form of the vertical-slash
sparse attention, request by request through ``sparse_attn_func``'s op.

Reference only, like ``sparse_attn_func`` (dual-chunk attention, rarely hot): a host loop over
the requests that reads ``cu_seqlens_q`` / ``cu_seqlens_k`` on the host (one sync), so it is for
eager callers, not for a ``torch.compile(fullgraph=True)`` region.
"""

from __future__ import annotations

import torch

from .._checks import check_size, check_tensor, check_tensor_args, fail
from .common import check_flag, check_index
from .sparse_attn import sparse_attn_func

NAME = "sparse_attn_varlen_func"


def _bounds(fn: str, cu, arg: str, total: int, batch: int) -> list[int]:
    """The host copy of ``cu`` ([b + 1], non-decreasing, from 0, at most ``total``)."""
    check_size(fn, arg, cu, 0, batch + 1, "block_count.shape[0] + 1 (b + 1)")
    values = cu.tolist()
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or values[-1] > total:
        fail(fn, arg, "is not a cumulative length table", f"0 = {arg}[0] <= ... <= {arg}[b] <= "
             f"{total} (the packed rows)", values)
    return values


def sparse_attn_varlen_func(q, k, v, block_count, block_offset, column_count, column_index,
                            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            dropout_p=0.0, softmax_scale=None, causal=False, softcap=0.0,
                            alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                            return_softmax_lse=False, out=None, block_size_M=64,
                            block_size_N=64):
    """Vertical-slash sparse attention of packed requests (sgl-kernel-xpu
    ``sparse_flash_attn.sparse_attn_varlen_func``).

    Request ``r`` is query rows ``cu_seqlens_q[r] .. cu_seqlens_q[r + 1]`` and key rows
    ``cu_seqlens_k[r] .. cu_seqlens_k[r + 1]``; its rows attend as ``sparse_attn_func`` of that
    one request with ``block_count[r]``, ``block_offset[r]``, ``column_count[r]``,
    ``column_index[r]`` (block rows and key indices relative to the request's start; ``causal``
    bottom-right within it). Rows past ``cu_seqlens_q[b]`` get output 0 and LSE ``-inf``.

    Args:
        q: [total_q, Hq, D]; k: [total_k, Hkv, D]; v: [total_k, Hkv, Dv] (fp16|bf16|fp32).
        block_count, column_count: [b, Hq, rows]; block_offset: [b, Hq, rows, NNZ_S];
            column_index: [b, Hq, rows, NNZ_V] (int32|int64), ``rows * block_size_M`` at least
            each request's query length.
        cu_seqlens_q, cu_seqlens_k: [b + 1] int32 cumulative lengths.
        max_seqlen_q, max_seqlen_k: accepted; results never depend on them.
        Other arguments: as ``sparse_attn_func``.
    Returns:
        ``out [total_q, Hq, Dv]`` or ``(out, softmax_lse [Hq, total_q] float32)``.
    Raises:
        TypeError/ValueError (also RuntimeError): as ``sparse_attn_func``, and cumulative tables
        that are not non-decreasing from 0 within the packed rows. NotImplementedError: dropout,
        ALiBi or attention probabilities.
    Source: MInference (Jiang et al., arXiv 2407.02490); sgl-kernel-xpu's varlen form.
    """
    fn = NAME
    check_tensor_args(fn, ("out",), q=q, k=k, v=v, block_count=block_count,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, out=out)
    check_tensor(fn, "q", q, ndim=3)
    check_tensor(fn, "k", k, ndim=3, device=q.device)
    check_tensor(fn, "v", v, ndim=3, device=q.device)
    check_tensor(fn, "block_count", block_count, ndim=3, device=q.device)
    batch = block_count.shape[0]
    for arg, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_index(fn, arg, cu, 1, q.device)
    q_ends = _bounds(fn, cu_seqlens_q, "cu_seqlens_q", q.shape[0], batch)
    k_ends = _bounds(fn, cu_seqlens_k, "cu_seqlens_k", k.shape[0], batch)
    return_softmax_lse = check_flag(fn, "return_softmax_lse", return_softmax_lse)
    if out is None:
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    check_tensor(fn, "out", out, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_size(fn, "out", out, 0, q.shape[0], "q.shape[0] (total_q)")
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    parts = []
    for r in range(batch):
        qs, ks = slice(q_ends[r], q_ends[r + 1]), slice(k_ends[r], k_ends[r + 1])
        parts.append(sparse_attn_func(
            q[qs][None], k[ks][None], v[ks][None], block_count[r:r + 1], block_offset[r:r + 1],
            column_count[r:r + 1], column_index[r:r + 1], dropout_p, softmax_scale, causal,
            softcap, alibi_slopes, deterministic, return_attn_probs, return_softmax_lse=True,
            block_size_M=block_size_M, block_size_N=block_size_N))
    out[q_ends[-1]:] = 0                         # every check ran: now write
    for r, (o, l) in enumerate(parts):
        out[q_ends[r]:q_ends[r + 1]] = o[0]
        lse[:, q_ends[r]:q_ends[r + 1]] = l[0]
    return (out, lse) if return_softmax_lse else out


__all__ = ["sparse_attn_varlen_func"]
