"""``flash_mla_decode`` with the LSE and several query tokens per request.

The one-token form without LSE keeps its own op (``xpu_ops::flash_mla_decode``, split-KV in
the caller's workspace). With ``return_softmax_lse``, ``causal`` or 4-D queries the call is MLA
over the request's pages with ``s_q`` rows each, bottom-right aligned: exactly the dense mode of
``flash_mla_with_kvcache`` with ``q = [q_nope, q_rope]`` and the cache as its one KV head, so it
runs that op (one pass over the keys: deterministic and batch invariant for any
``num_kv_splits``). The workspace is checked as for ``b * s_q`` one-token rows, so a caller
that sizes it with ``seqlen_q`` may switch paths without reallocating.
"""

from __future__ import annotations

import torch

from .. import _value_checks
from .._checks import (FLOAT_DTYPES, check_contiguous_last, check_size, check_tensor,
                       fail)
from ..mla_workspace import mla_split_bytes
from .common import check_index

NAME = "flash_mla_decode"


def _check_tokens(q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace,
                  num_kv_splits) -> None:
    """Shapes of the several-token form: ``q_nope [b, s_q, H, R]`` (or ``[b, H, R]``)."""
    fn = NAME
    check_tensor(fn, "q_nope", q_nope, ndim=(3, 4), dtypes=FLOAT_DTYPES)
    device, ndim = q_nope.device, q_nope.dim()
    check_tensor(fn, "q_rope", q_rope, ndim=ndim, dtypes=(q_nope.dtype,), device=device)
    for dim in range(ndim - 1):
        check_size(fn, "q_rope", q_rope, dim, q_nope.shape[dim], f"q_nope.shape[{dim}]")
    check_tensor(fn, "kv_cache", kv_cache, ndim=3, dtypes=(q_nope.dtype,), device=device)
    check_size(fn, "kv_cache", kv_cache, 2, q_nope.shape[-1] + q_rope.shape[-1], "R + r")
    batch = q_nope.shape[0]
    for arg, t, rank in (("cache_seqlens", cache_seqlens, 1), ("page_table", page_table, 2)):
        check_index(fn, arg, t, rank, device)
        check_size(fn, arg, t, 0, batch, "q_nope.shape[0] (b)")
    check_tensor(fn, "workspace", workspace, ndim=1, dtypes=(torch.uint8,), device=device,
                 fix="Allocate it with torch.empty(flash_mla_get_workspace_size(..., "
                     "seqlen_q=s_q), dtype=torch.uint8).")
    check_contiguous_last(fn, "workspace", workspace)
    rows = batch * (q_nope.shape[1] if ndim == 4 else 1)
    need = mla_split_bytes(rows, q_nope.shape[-2], q_nope.shape[-1]) * max(num_kv_splits, 1)
    if workspace.shape[0] < need:
        fail(fn, "workspace", "is too small",
             f"at least {need} bytes ({max(num_kv_splits, 1)} split(s) of b * s_q * H * (R + 1) "
             f"float32)", f"{workspace.shape[0]} bytes",
             "Size it with flash_mla_get_workspace_size(..., seqlen_q=s_q).")


def decode_tokens(q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace, softmax_scale,
                  num_kv_splits, causal, return_softmax_lse):
    """The several-token / LSE form of ``flash_mla_decode`` (arguments already typed):
    ``out [b, (s_q,) H, R]`` and, with ``return_softmax_lse``, ``lse [b, H(, s_q)]``."""
    _check_tokens(q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace, num_kv_splits)
    _value_checks.check_flash_mla_decode(kv_cache, cache_seqlens, page_table)
    tokens = q_nope.dim() == 4
    q = torch.cat([q_nope, q_rope], dim=-1)
    if not tokens:
        q = q[:, None]
    out, lse = torch.ops.xpu_ops.flash_mla_with_kvcache(
        q, kv_cache[:, :, None], page_table, cache_seqlens, q_nope.shape[-1], softmax_scale,
        causal, False, None, None, None, None, None, None)
    if not tokens:
        out, lse = out[:, 0], lse[:, :, 0]
    return (out, lse) if return_softmax_lse else out


__all__ = ["decode_tokens"]
