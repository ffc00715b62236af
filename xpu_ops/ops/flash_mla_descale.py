"""fp8 queries and plain fp8 caches with per-tensor or per-request descales for
``flash_mla_with_kvcache`` (sgl-kernel's FlashMLA keywords ``descale_q`` / ``descale_k``).

FlashMLA's fp8 path (sgl-kernel's and sgl-kernel-xpu's ``test_flash_mla_fp8``) takes
``q [b, s_q, h_q, D]`` and ``k_cache [num_blocks, page_size, 1, D]`` as ``float8_e4m3fn``
tensors with float32 descales: the real query is ``q * descale_q`` and the real key (and value)
``k * descale_k``. Here the raw fp8 keys are widened to bfloat16 (exact: every e4m3 / e5m2 value
is a bfloat16 value), ``descale_q * descale_k`` is folded into the query (the scores are then
exact in the scale) and the output is multiplied by ``descale_k`` (the values' scale), so a
per-request ``descale_k`` needs no per-request copy of shared pages. The attention itself is
``flash_mla_with_kvcache``'s op on bfloat16 (output bfloat16, as FlashMLA's fp8 path returns).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import check_tensor, fail

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _descale(fn: str, arg: str, t, batch: int, device) -> Tensor:
    """float32 ``[1]`` or ``[b]`` (any shape of that many elements) as ``[1|b, 1, 1, 1]``."""
    check_tensor(fn, arg, t, dtypes=(torch.float32,), device=device)
    if t.numel() not in (1, batch):
        fail(fn, arg, "has the wrong number of elements", f"1 (per tensor) or b = {batch} "
             "(per request)", tuple(t.shape))
    return t.reshape(-1, 1, 1, 1)


def dequantized_inputs(fn: str, q, k_cache, is_fp8_kvcache: bool, descale_q: Optional[Tensor],
                       descale_k: Optional[Tensor]):
    """``(q', k_cache', out_scale)``: the bfloat16 query (descales folded in) and cache for the
    op, and the ``[1|b, 1, 1, 1]`` float32 factor of the output (None: none).

    Raises:
        TypeError/ValueError (also RuntimeError): a descale that is not float32 with 1 or b
            elements, a descale for a side that is not fp8, an fp8 side without its descale,
            ``descale_k`` with ``is_fp8_kvcache`` (that format carries its own scales).
    """
    check_tensor(fn, "q", q, ndim=4)
    check_tensor(fn, "k_cache", k_cache, ndim=4)
    batch, device = q.shape[0], q.device
    if is_fp8_kvcache and descale_k is not None:
        fail(fn, "descale_k", "is given with is_fp8_kvcache", "None (FlashMLA's fp8 pages carry "
             "their own scales)", "a tensor")
    for arg, t, scale in (("q", q, descale_q), ("k_cache", k_cache, descale_k)):
        is_fp8 = t.dtype in FP8_DTYPES and not (arg == "k_cache" and is_fp8_kvcache)
        if is_fp8 != (scale is not None):
            fail(fn, f"descale_{arg[0]}", "does not match the dtype of " + arg,
                 f"a descale exactly when {arg} is float8 (e4m3fn / e5m2)",
                 f"{'a tensor' if scale is not None else 'None'} with {arg} {t.dtype}")
    dq = None if descale_q is None else _descale(fn, "descale_q", descale_q, batch, device)
    dk = None if descale_k is None else _descale(fn, "descale_k", descale_k, batch, device)
    dtype = torch.bfloat16 if q.dtype in FP8_DTYPES else q.dtype
    factor = dq if dk is None else (dk if dq is None else dq * dk)
    q_new = (q.float() * factor).to(dtype) if factor is not None else q
    k_new = k_cache.to(dtype) if dk is not None else k_cache
    return q_new, k_new, dk


__all__ = ["FP8_DTYPES", "dequantized_inputs"]
