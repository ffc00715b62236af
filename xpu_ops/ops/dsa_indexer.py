"""DSA lightning-indexer logits: ``fp8_mqa_logits`` (ragged keys) and ``fp8_paged_mqa_logits``
(the paged index-key cache), DeepGEMM's contract, plus ``get_paged_mqa_logits_metadata``.

DeepSeek-V3.2's indexer scores every key ``j`` for every query ``i`` as
``logits[i, j] = sum_h weights[i, h] * relu(scale_j * (q[i, h] . k_j))`` with fp8 queries and
keys (``k_j`` dequantised by its per-token float32 ``scale_j``; the query's own scale and the
softmax scale are folded into ``weights`` by the caller). Keys outside a query's range get
``-inf``. The top-k of each row (``xpu_ops.ops.dsa_topk``) picks the keys sparse MLA attends.
Both ops return a new float32 tensor; nothing is mutated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _value_checks
from .._checks import (check_size, check_tensor, check_tensor_args, fail, int_scalar)
from .._registration import define_op
from ..index_k_layout import SCALE_BYTES
from .common import check_flag, check_head_dim, check_index

MQA = "fp8_mqa_logits"
PAGED = "fp8_paged_mqa_logits"
E4M3 = torch.float8_e4m3fn
_F32 = (torch.float32,)


def _check_weights(fn: str, weights, rows: int, heads: int, rows_rule: str, device) -> None:
    check_tensor(fn, "weights", weights, ndim=2, dtypes=_F32, device=device)
    check_size(fn, "weights", weights, 0, rows, rows_rule)
    check_size(fn, "weights", weights, 1, heads, "q's head count H")


def _check_nonnegative(fn: str, arg: str, value) -> int:
    value = int_scalar(fn, arg, value, "an int >= 0")
    if value < 0:
        fail(fn, arg, "is negative", "an int >= 0", value)
    return value


def _check_fp8_mqa_logits(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits,
                          max_seqlen_k) -> None:
    """Validate shapes/dtypes/devices and scalars (runs in the fake too)."""
    fn = MQA
    check_tensor(fn, "q", q, ndim=3, dtypes=(E4M3,))
    check_head_dim(fn, "q", q)
    device = q.device
    seq_len, heads, dim = q.shape
    check_tensor(fn, "k", k, ndim=2, dtypes=(E4M3,), device=device)
    check_size(fn, "k", k, 1, dim, "q's head dim D")
    check_tensor(fn, "k_scale", k_scale, ndim=1, dtypes=_F32, device=device)
    check_size(fn, "k_scale", k_scale, 0, k.shape[0], "k.shape[0] (seq_len_kv)")
    _check_weights(fn, weights, seq_len, heads, "q.shape[0] (seq_len)", device)
    for arg, t in (("cu_seqlen_ks", cu_seqlen_ks), ("cu_seqlen_ke", cu_seqlen_ke)):
        check_index(fn, arg, t, 1, device)
        check_size(fn, arg, t, 0, seq_len, "q.shape[0] (seq_len)")
    check_flag(fn, "clean_logits", clean_logits)
    _check_nonnegative(fn, "max_seqlen_k", max_seqlen_k)


@define_op("xpu_ops::fp8_mqa_logits", mutates_args=(), by_device=True)
def fp8_mqa_logits_op(q: Tensor, k: Tensor, k_scale: Tensor, weights: Tensor,
                      cu_seqlen_ks: Tensor, cu_seqlen_ke: Tensor, clean_logits: bool,
                      max_seqlen_k: int) -> Tensor:
    """Op form of ``fp8_mqa_logits`` (the checks; the provider of q's device computes)."""
    _check_fp8_mqa_logits(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits,
                          max_seqlen_k)


@fp8_mqa_logits_op.register_fake
def _(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, max_seqlen_k):
    _check_fp8_mqa_logits(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits,
                          max_seqlen_k)
    width = max_seqlen_k if max_seqlen_k > 0 else k.shape[0]
    return q.new_empty((q.shape[0], width), dtype=torch.float32)


def _as_fp8(t):
    """sgl-kernel-xpu passes fp8 tensors as uint8 too: the same bytes, viewed."""
    return t.view(E4M3) if isinstance(t, Tensor) and t.dtype == torch.uint8 else t


def fp8_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=True,
                   max_seqlen_k=0):
    """Indexer logits of ragged queries against ragged fp8 keys (DeepGEMM ``fp8_mqa_logits``).

    ``logits[i, j] = sum_h weights[i, h] * relu(k_scale[j] * (q[i, h] . k[j]))`` for keys
    ``cu_seqlen_ks[i] <= j < cu_seqlen_ke[i]`` (clamped into ``[0, seq_len_kv)``), ``-inf``
    elsewhere. Accumulated in float32 (fp8 products are exact in float32).

    With ``max_seqlen_k > 0`` the logits are compressed: ``[seq_len, max_seqlen_k]``, column
    ``c`` of row ``i`` holding key ``cu_seqlen_ks[i] + c`` (``-inf`` past the row's range), as
    DeepGEMM's compressed form; a loose bound gives the tight one's columns plus ``-inf`` ones.

    Args:
        q: [seq_len, H, D] float8_e4m3fn (uint8 bytes are viewed as it).
        kv: ``(k [seq_len_kv, D] float8_e4m3fn, k_scale [seq_len_kv] float32)``, the per-token
            dequantisation scale (``[seq_len_kv, 1]`` is accepted).
        weights: [seq_len, H] float32, per-head weights (query scale and softmax scale folded).
        cu_seqlen_ks, cu_seqlen_ke: [seq_len] int32, each query's key range ``[ks, ke)``.
        clean_logits: DeepGEMM's flag to fill out-of-range positions with ``-inf``; every
            xpu-ops provider fills them either way, so False never changes the result.
        max_seqlen_k: 0 (full width ``seq_len_kv``) or the compressed width.
    Returns:
        [seq_len, seq_len_kv] (or [seq_len, max_seqlen_k]) float32, a new tensor.
    Raises:
        TypeError/ValueError: wrong kind, shape, dtype or device, naming the argument.
    Source: DeepSeek-V3.2 (DSA lightning indexer); DeepGEMM ``fp8_mqa_logits``.

    >>> import torch, xpu_ops
    >>> q = torch.randn(2, 4, 16).to(torch.float8_e4m3fn); k = torch.randn(3, 16).to(q.dtype)
    >>> scale, w = torch.rand(3) + 0.5, torch.randn(2, 4)
    >>> ks, ke = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2, 3], dtype=torch.int32)
    >>> out = xpu_ops.fp8_mqa_logits(q, (k, scale), w, ks, ke)
    >>> s = (q.float() @ k.float().T * scale).relu()          # [2, 4, 3]
    >>> torch.allclose(out[0, :2], (w[0, :, None] * s[0]).sum(0)[:2]), out[0, 2].item()
    (True, -inf)
    """
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        fail(MQA, "kv", "is not a pair", "(k [seq_len_kv, D] fp8, k_scale [seq_len_kv] float32)",
             type(kv).__name__, exc=TypeError)
    k, k_scale = kv
    check_tensor_args(MQA, q=q, k=k, k_scale=k_scale, weights=weights,
                      cu_seqlen_ks=cu_seqlen_ks, cu_seqlen_ke=cu_seqlen_ke)
    if k_scale.dim() == 2 and k_scale.shape[1] == 1:
        k_scale = k_scale[:, 0]
    return torch.ops.xpu_ops.fp8_mqa_logits(
        _as_fp8(q), _as_fp8(k), k_scale, weights, cu_seqlen_ks, cu_seqlen_ke,
        check_flag(MQA, "clean_logits", clean_logits),
        _check_nonnegative(MQA, "max_seqlen_k", max_seqlen_k))


def _check_fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len,
                                clean_logits) -> None:
    """Validate shapes/dtypes/devices and scalars (runs in the fake too)."""
    fn = PAGED
    check_tensor(fn, "q", q, ndim=4, dtypes=(E4M3,))
    check_head_dim(fn, "q", q)
    device = q.device
    batch, next_n, heads, dim = q.shape
    check_tensor(fn, "kv_cache", kv_cache, ndim=4, dtypes=(torch.uint8,), device=device,
                 fix="Pass the fused fp8 index-key cache's bytes (.view(torch.uint8)).")
    check_size(fn, "kv_cache", kv_cache, 2, 1, "one index-key head")
    check_size(fn, "kv_cache", kv_cache, 3, dim + SCALE_BYTES, "D + 4 (fp8 key, float32 scale)")
    if dim % SCALE_BYTES:
        fail(fn, "q", "has a head dim that is not a multiple of 4", "D % 4 == 0 (the scales "
             "after a block's keys stay 4-byte aligned)", f"shape {tuple(q.shape)}")
    _check_weights(fn, weights, batch * next_n, heads, "b * next_n", device)
    check_tensor(fn, "context_lens", context_lens, ndim=(1, 2), dtypes=(torch.int32,),
                 device=device, fix="Build it with dtype=torch.int32.")
    check_size(fn, "context_lens", context_lens, 0, batch, "q.shape[0] (b)")
    if context_lens.dim() == 2:
        check_size(fn, "context_lens", context_lens, 1, next_n, "q.shape[1] (next_n)")
    check_index(fn, "block_table", block_table, 2, device)
    check_size(fn, "block_table", block_table, 0, batch, "q.shape[0] (b)")
    _check_nonnegative(fn, "max_context_len", max_context_len)
    check_flag(fn, "clean_logits", clean_logits)


@define_op("xpu_ops::fp8_paged_mqa_logits", mutates_args=(), by_device=True)
def fp8_paged_mqa_logits_op(q: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                            block_table: Tensor, max_context_len: int,
                            clean_logits: bool) -> Tensor:
    """Op form of ``fp8_paged_mqa_logits`` (the checks; the provider of q's device computes)."""
    _check_fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table,
                                max_context_len, clean_logits)
    _value_checks.check_fp8_paged_mqa_logits(q, kv_cache, context_lens, block_table)


@fp8_paged_mqa_logits_op.register_fake
def _(q, kv_cache, weights, context_lens, block_table, max_context_len, clean_logits):
    _check_fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table,
                                max_context_len, clean_logits)
    return q.new_empty((q.shape[0] * q.shape[1], max_context_len), dtype=torch.float32)


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                         max_context_len, clean_logits=False):
    """Indexer logits of ``next_n`` queries per request against the paged fp8 index-key cache
    (DeepGEMM ``fp8_paged_mqa_logits``; decode, and MTP verify with ``next_n > 1``).

    Row ``i * next_n + n`` scores key positions ``j`` of request ``i`` (position ``j`` lives in
    block ``block_table[i, j // block_size]``, row ``j % block_size``, layout:
    ``xpu_ops.index_k_layout``) as ``fp8_mqa_logits`` does, for ``j < L`` where
    ``L = context_lens[i] - next_n + n + 1`` (1-D ``context_lens``: the queries are the last
    ``next_n`` tokens, causal among themselves) or ``L = context_lens[i, n]`` (2-D). ``L`` is
    clamped into ``[0, min(max_context_len, block_table.shape[1] * block_size)]``; positions
    ``>= L``, and keys of a block id outside ``[0, num_blocks)``, are ``-inf``
    (``xpu_ops.debug_checks()`` rejects such lengths and block ids instead).

    Args:
        q: [b, next_n, H, D] float8_e4m3fn (uint8 bytes are viewed; a 3-D [b, H, D] means
            ``next_n = 1``, as sgl-kernel-xpu accepts).
        kv_cache: [num_blocks, block_size, 1, D + 4] uint8, the fused index-key cache.
        weights: [b * next_n, H] float32.
        context_lens: [b] or [b, next_n] int32 (tokens, not blocks).
        block_table: [b, max_blocks] int32 block ids; entries past a request's last block are
            never read.
        schedule_meta: ``get_paged_mqa_logits_metadata``'s tensor or None; never changes the
            result.
        max_context_len: width of the logits (int tokens).
        clean_logits: as ``fp8_mqa_logits`` (positions past ``L`` are ``-inf`` either way).
    Returns:
        [b * next_n, max_context_len] float32, a new tensor.
    Raises:
        TypeError/ValueError: wrong kind, shape, dtype or device, naming the argument.
    Source: DeepSeek-V3.2 (DSA lightning indexer); DeepGEMM ``fp8_paged_mqa_logits``.

    >>> import torch, xpu_ops
    >>> cache = torch.zeros(2, 4, 1, 20, dtype=torch.uint8)
    >>> k = torch.randn(6, 16); table = torch.tensor([[1, 0]], dtype=torch.int32)
    >>> xpu_ops.store_index_k_cache(cache, torch.tensor([4, 5, 6, 7, 0, 1]), k)
    >>> q = torch.randn(1, 1, 2, 16).to(torch.float8_e4m3fn); w = torch.ones(1, 2)
    >>> out = xpu_ops.fp8_paged_mqa_logits(q, cache, w, torch.tensor([6], dtype=torch.int32),
    ...                                    table, None, 8)
    >>> out.shape, bool(out[0, :6].isfinite().all()), out[0, 6:].tolist()
    (torch.Size([1, 8]), True, [-inf, -inf])
    """
    check_tensor_args(PAGED, ("schedule_meta",), q=q, kv_cache=kv_cache, weights=weights,
                      context_lens=context_lens, block_table=block_table,
                      schedule_meta=schedule_meta)
    q = _as_fp8(q)
    if q.dim() == 3:
        q = q.unsqueeze(1)
    if kv_cache.dtype == E4M3:
        kv_cache = kv_cache.view(torch.uint8)
    return torch.ops.xpu_ops.fp8_paged_mqa_logits(
        q, kv_cache, weights, context_lens, block_table,
        _check_nonnegative(PAGED, "max_context_len", max_context_len),
        check_flag(PAGED, "clean_logits", clean_logits))


def get_paged_mqa_logits_metadata(context_lens, block_size, num_sms):
    """Schedule metadata of ``fp8_paged_mqa_logits`` (DeepGEMM's function of the same name).

    Splits the batch's key blocks evenly over ``num_sms`` workers: row ``s`` is
    ``(request, block)`` where worker ``s`` starts; row ``num_sms`` is ``(b, 0)``. Plain tensor
    ops (traceable, no host sync). xpu-ops kernels plan their own grids, so the result never
    changes the logits; it exists so DeepGEMM's callers run unchanged.

    Args:
        context_lens: [b] or [b, next_n] int32 (the longest of a request's rows counts).
        block_size: tokens per block (int > 0). num_sms: workers (int > 0).
    Returns:
        [num_sms + 1, 2] int32 on context_lens' device.
    Raises:
        TypeError/ValueError: wrong kind, rank or dtype, or a size that is not positive.

    >>> import torch, xpu_ops
    >>> lens = torch.tensor([64, 0, 128], dtype=torch.int32)
    >>> xpu_ops.get_paged_mqa_logits_metadata(lens, 64, 2).tolist()
    [[0, 0], [2, 0], [3, 0]]
    """
    fn = "get_paged_mqa_logits_metadata"
    check_tensor(fn, "context_lens", context_lens, ndim=(1, 2), dtypes=(torch.int32,))
    for arg, value in (("block_size", block_size), ("num_sms", num_sms)):
        if int_scalar(fn, arg, value, "an int > 0") <= 0:
            fail(fn, arg, "is not positive", "an int > 0", value)
    lens = context_lens.amax(1) if context_lens.dim() == 2 else context_lens
    blocks = (lens.long().clamp(min=0) + block_size - 1) // block_size          # [b]
    ends = torch.cumsum(blocks, 0)                                               # [b]
    total = ends[-1:] if blocks.numel() else torch.zeros(1, dtype=torch.long,
                                                         device=lens.device)
    targets = torch.arange(num_sms + 1, device=lens.device) * total // num_sms   # [num_sms + 1]
    request = torch.searchsorted(ends, targets, right=True)                     # [num_sms + 1]
    starts = ends - blocks
    block = targets - starts.gather(0, request.clamp(max=max(blocks.numel() - 1, 0))) \
        if blocks.numel() else torch.zeros_like(targets)
    block = torch.where(request < blocks.numel(), block, 0)
    return torch.stack([request, block], 1).to(torch.int32)


__all__ = ["fp8_mqa_logits", "fp8_paged_mqa_logits", "get_paged_mqa_logits_metadata"]
