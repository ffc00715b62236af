"""``flash_attn_varlen_func``: attention of packed queries over ragged (non-paged) K/V.

The op ``torch.ops.xpu_ops.flash_attn_varlen_func`` writes ``out`` (mutated, never returned) and
returns ``softmax_lse [Hq, total_q]``; the public wrapper allocates ``out`` when none is given.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .. import _value_checks
from .._registration import define_op
from .._checks import (FLOAT_DTYPES, FP8_DTYPES, check_size, check_tensor,
                       check_tensor_args, fail)
from .common import (check_attention_extras, check_cu_seqlens, check_flag, check_head_dim,
                     check_index, check_kv_dtype, check_num_splits, check_op_scalars, check_out,
                     check_query, check_speed_hints, default_softmax_scale, finite_scale,
                     float_scalar, kernel_extras, max_seqlen, no_cap_if_infinite,
                     normalize_window, output_dtype)

NAME = "flash_attn_varlen_func"


def _check_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, out, seqused_k, qv,
                                  q_descale, k_descale, v_descale, sinks, seqused_q, *,
                                  max_seqlen_q, max_seqlen_k, softmax_scale, window_size_left,
                                  window_size_right, softcap, num_splits) -> None:
    """Validate the op's arguments (shapes, dtypes, devices and scalars; runs in the fake too)."""
    fn = NAME
    check_op_scalars(fn, softmax_scale, window_size_left, window_size_right)
    check_query(fn, q)
    device = q.device
    check_tensor(fn, "k", k, ndim=3, dtypes=FLOAT_DTYPES + FP8_DTYPES, device=device)
    check_tensor(fn, "v", v, ndim=3, dtypes=(k.dtype,), device=device,
                 fix="Pass K and V in the same dtype.")
    check_kv_dtype(fn, "k", k, q)
    total_k, num_heads_kv, head_dim = k.shape
    check_size(fn, "q", q, 2, head_dim, "k.shape[2] (D)")
    check_size(fn, "v", v, 0, total_k, "k.shape[0] (total_k)")
    check_size(fn, "v", v, 1, num_heads_kv, "k.shape[1] (Hkv)")
    check_index(fn, "cu_seqlens_q", cu_seqlens_q, 1, device)
    batch = cu_seqlens_q.shape[0] - 1
    check_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, batch, device)
    for arg, seqused in (("seqused_k", seqused_k), ("seqused_q", seqused_q)):
        if seqused is not None:
            check_index(fn, arg, seqused, 1, device)
            check_size(fn, arg, seqused, 0, batch, "cu_seqlens_q.shape[0] - 1 (b)")
    total_q, num_heads_q, _ = q.shape
    head_dim_v = v.shape[2]
    check_out(fn, out, (total_q, num_heads_q, head_dim_v), output_dtype(q), device,
              "[total_q, Hq, Dv]")
    if max_seqlen_k < 0:
        fail(fn, "max_seqlen_k", "is negative", "max_seqlen_k >= 0", max_seqlen_k)
    check_attention_extras(fn, q=q, k_dtype=k.dtype, v_dtype=v.dtype, num_heads_kv=num_heads_kv,
                           head_dim_v=head_dim_v, batch=batch, qv=qv, q_descale=q_descale,
                           k_descale=k_descale, v_descale=v_descale, sinks=sinks,
                           softcap=softcap, max_seqlen_q=max_seqlen_q)
    if num_splits < 0:
        check_num_splits(fn, num_splits)


@define_op("xpu_ops::flash_attn_varlen_func", mutates_args=("out",), by_device=True)
def flash_attn_varlen_func_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, out: Tensor,
    seqused_k: Optional[Tensor], qv: Optional[Tensor], q_descale: Optional[Tensor],
    k_descale: Optional[Tensor], v_descale: Optional[Tensor], sinks: Optional[Tensor],
    seqused_q: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
    causal: bool, window_size_left: int, window_size_right: int, softcap: float,
    num_splits: int,
) -> Tensor:
    """Op form of ``flash_attn_varlen_func``: writes ``out``, returns ``softmax_lse [Hq, total_q]``.

    ``max_seqlen_q``/``max_seqlen_k`` bound one request's query/key count (grid sizes; never read
    from tensor values). ``window_size_right`` is forced to 0 when ``causal``. ``seqused_q``:
    request ``r`` uses its first ``seqused_q[r]`` query rows (alignment ``pos = Lk -
    seqused_q[r] + i``); its other rows get output 0 and LSE ``-inf``. ``num_splits`` as in
    ``flash_attn_with_kvcache``'s op (0 auto, 1 one pass, n > 1 at most n KV splits).
    """
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, out, seqused_k, qv, q_descale, k_descale,
            v_descale, sinks, seqused_q)
    _check_flash_attn_varlen_func(*args, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                  softmax_scale=softmax_scale, window_size_left=window_size_left,
                                  window_size_right=window_size_right, softcap=softcap,
                                  num_splits=num_splits)
    extras = kernel_extras(sinks, q_descale, k_descale, v_descale, cu_seqlens_q.shape[0] - 1,
                           k.shape[1])
    if extras is not None:  # the providers' forms: float32 sinks, [b, Hkv] descales
        sinks, q_descale, k_descale, v_descale = extras
        args = (*args[:8], q_descale, k_descale, v_descale, sinks, seqused_q)
    # softcap inf is no cap (the providers' 0); causal forces the right window bound to 0
    if softcap == math.inf or extras is not None or causal and window_size_right != 0:
        return (*args, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size_left,
                0 if causal else window_size_right, no_cap_if_infinite(softcap), num_splits)
    return None


@flash_attn_varlen_func_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, out, seqused_k, qv, q_descale, k_descale, v_descale,
      sinks, seqused_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size_left,
      window_size_right, softcap, num_splits):
    _check_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, out, seqused_k, qv,
                                  q_descale, k_descale, v_descale, sinks, seqused_q,
                                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                  softmax_scale=softmax_scale, window_size_left=window_size_left,
                                  window_size_right=window_size_right, softcap=softcap,
                                  num_splits=num_splits)
    return q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
    seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
    v_descale=None, window_size=(-1, -1), softcap=0.0, num_splits=1, pack_gqa=None, sm_margin=0,
    return_softmax_lse=False, sinks=None, out=None, ver=3, page_table=None,
):
    """Attention over ragged K/V (no cache), sgl-kernel ``flash_attn_varlen_func`` compatible.

    Request ``r`` has queries ``q[cu_seqlens_q[r]:cu_seqlens_q[r+1]]`` and keys
    ``k[cu_seqlens_k[r]:cu_seqlens_k[r] + Lk]`` with ``Lk = seqused_k[r]`` if given, else the
    ``cu_seqlens_k`` difference. Masks, softcap, sinks and empty rows follow
    ``flash_attn_with_kvcache`` (bottom-right alignment ``pos(i) = Lk - Lq + i``).

    Args:
        q: [total_q, Hq, D] fp16|bf16|fp32|fp8. k: [total_k, Hkv, D]. v: [total_k, Hkv, Dv]
            (Dv may differ from D), q's dtype or fp8 (then ``k_descale``/``v_descale [b, Hkv]``).
        cu_seqlens_q, cu_seqlens_k: [b + 1] int32 prefix sums (tokens).
        max_seqlen_q, max_seqlen_k: upper bounds of one request's lengths (default total_q and
            total_k; pass the true maxima for speed).
        seqused_q: [b] int32 query rows used per request (<= the cu_seqlens_q difference):
            rows past it are not attended and their output is 0 (LSE ``-inf``); the alignment
            is ``pos(i) = Lk - seqused_q[r] + i``.
        seqused_k: [b] int32 keys used per request (<= the cu_seqlens_k difference).
        softmax_scale: default ``1/sqrt(D)`` (``1/sqrt(D + Dv)`` with ``qv``); any finite
            value (NaN or inf raises ValueError).
        causal, window_size, softcap, sinks, qv, return_softmax_lse, out: as in
            ``flash_attn_with_kvcache``.
        num_splits: KV splits: 1 (default) one pass over the keys, so a row's result does not
            depend on the other requests of the batch; 0 lets the provider choose; n > 1 at
            most n splits. Results agree to rounding whatever the value.
        pack_gqa, sm_margin: speed hints (None/bool, int >= 0), accepted; results never
            depend on them. ver: 3 or 4 (sgl-kernel's FA3 or FA4: the same math).
        page_table: FlashAttention-4's paged form: ``k``/``v`` are paged caches
            ``[num_pages, page_size, Hkv, D]``, ``page_table [b, max_pages]`` int32,
            ``seqused_k`` the cache lengths, ``cu_seqlens_k`` None; ``q`` ``[b, s, Hq, D]``
            (``cu_seqlens_q`` None) or packed. Runs ``flash_attn_with_kvcache`` (its returns).
    Returns:
        ``out [total_q, Hq, Dv]`` or ``(out, softmax_lse [Hq, total_q] float32)``.
    Raises:
        TypeError/ValueError: wrong kind, shape, dtype or device, naming the argument; a
            num_splits or sm_margin that is not an int >= 0, a pack_gqa that is not a bool.
        ValueError: with ``XPU_OPS_DEBUG_CHECKS=1``, a value out of range: ``cu_seqlens_q``,
            ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k`` or ``seqused_k``.
    Source: FlashAttention-2 (arXiv 2307.08691) varlen forward; sgl-kernel's semantics.

    >>> import torch, xpu_ops
    >>> q, k, v = torch.randn(4, 2, 32), torch.randn(6, 1, 32), torch.randn(6, 1, 16)
    >>> cu_q = torch.tensor([0, 1, 4], dtype=torch.int32); cu_k = torch.tensor([0, 2, 6], dtype=torch.int32)
    >>> o = xpu_ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True)
    >>> s = torch.einsum("hd,kd->hk", q[0], k[:2, 0]) / 32 ** 0.5
    >>> torch.allclose(o[0], s.softmax(-1) @ v[:2, 0], atol=1e-5)
    True
    """
    fn = NAME
    if page_table is not None:
        return _paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_q, seqused_k,
                      page_table, dict(softmax_scale=softmax_scale, causal=causal, qv=qv,
                                       q_descale=q_descale, k_descale=k_descale,
                                       v_descale=v_descale, window_size=window_size,
                                       softcap=softcap, num_splits=num_splits,
                                       pack_gqa=pack_gqa, sm_margin=sm_margin,
                                       return_softmax_lse=return_softmax_lse, sinks=sinks,
                                       out=out))
    if not (type(num_splits) is int and num_splits >= 0):
        check_num_splits(fn, num_splits)
    check_speed_hints(fn, pack_gqa=pack_gqa, sm_margin=sm_margin, ver=ver)
    check_tensor_args(fn, ("seqused_q", "seqused_k", "qv", "q_descale", "k_descale",
                           "v_descale", "sinks", "out"),
                      q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      seqused_q=seqused_q, seqused_k=seqused_k, qv=qv, q_descale=q_descale,
                      k_descale=k_descale, v_descale=v_descale, sinks=sinks, out=out)
    check_tensor(fn, "q", q, ndim=3)
    check_tensor(fn, "k", k, ndim=3)
    check_tensor(fn, "v", v, ndim=3)
    if softmax_scale is None:
        check_head_dim(fn, "q", q)
        softmax_scale = default_softmax_scale(q.shape[-1], v.shape[-1] if qv is not None else 0)
    causal = check_flag(fn, "causal", causal)
    return_softmax_lse = check_flag(fn, "return_softmax_lse", return_softmax_lse)
    left, right = normalize_window(fn, window_size, causal)
    if out is None:
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]), dtype=output_dtype(q))
    max_seqlen_q = max_seqlen(fn, "max_seqlen_q", max_seqlen_q, q.shape[0])
    max_seqlen_k = max_seqlen(fn, "max_seqlen_k", max_seqlen_k, k.shape[0])
    _value_checks.check_flash_attn_varlen_func(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                               max_seqlen_q, max_seqlen_k, seqused_q)
    _value_checks.check_sinks(fn, "sinks", sinks)
    softmax_scale = finite_scale(fn, "softmax_scale", softmax_scale)
    softcap = float_scalar(fn, "softcap", softcap)
    # Positional, in schema order (as flash_attn_with_kvcache: no per-call keyword dict).
    lse = torch.ops.xpu_ops.flash_attn_varlen_func.default(
        q, k, v, cu_seqlens_q, cu_seqlens_k, out, seqused_k, qv, q_descale, k_descale, v_descale,
        sinks, seqused_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal, left, right,
        softcap, num_splits)
    return (out, lse) if return_softmax_lse else out


def _paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_q, seqused_k, page_table,
           kwargs):
    """FlashAttention-4's ``flash_attn_varlen_func(..., page_table=...)``: attention over paged
    caches, which is ``flash_attn_with_kvcache`` with ``cache_seqlens = seqused_k``."""
    from .paged_attention import flash_attn_with_kvcache
    fn = NAME
    if seqused_k is None:
        fail(fn, "seqused_k", "is missing with page_table", "[b] int32 cache lengths", "None")
    for arg, value in (("cu_seqlens_k", cu_seqlens_k), ("seqused_q", seqused_q)):
        if value is not None:
            fail(fn, arg, "does not fit the paged form", "None with page_table (the cache "
                 "lengths come in seqused_k)", "a tensor")
    return flash_attn_with_kvcache(q, k, v, cache_seqlens=seqused_k, page_table=page_table,
                                   cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                                   **kwargs)
