"""``flash_mla_prefill``: absorbed multi-head latent attention (MLA) for ragged new tokens.

The extend-with-prefix form of ``flash_mla_decode``: every request has ``cu_seqlens_q[r + 1] -
cu_seqlens_q[r]`` new query tokens over its ``seq_lens_k[r]`` cached tokens (prefix and the new
tokens, already stored), all query heads over one shared latent KV head: keys are ``[latent,
rope]``, values the latent part. Causal masking is bottom-right aligned, so prefix tokens are
visible to every query. ``flash_mla_prefill_get_workspace_size`` exists for sgl-kernel's calling
convention; the op makes one pass over each request's keys and needs no scratch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _value_checks
from .._registration import define_op
from .._checks import check_size, check_tensor, check_tensor_args, fail, int_scalar
from .common import (check_cu_seqlens, check_finite_scale, check_flag, check_index,
                     check_mla_inputs, check_workspace_size_args, finite_scale)

NAME = "flash_mla_prefill"


def flash_mla_prefill_get_workspace_size(max_seq_len, num_batches, num_heads=0, page_size=0,
                                         num_kv_splits=-1) -> int:
    """Bytes of scratch that ``flash_mla_prefill`` needs: 0 (one pass over the keys, no split-KV
    partials), for any valid arguments.

    Args:
        max_seq_len: longest cache of any request, in tokens. num_batches: b.
        num_heads, page_size, num_kv_splits: accepted for sgl-kernel compatibility (unused).
    Returns:
        int, bytes (0). A 0-byte ``torch.uint8`` workspace is valid.
    Raises:
        TypeError: an argument is not an integer. ValueError: a negative size.
    Source: the signature of sgl-kernel-xpu's ``flash_mla_prefill_get_workspace_size``.

    >>> flash_mla_prefill_get_workspace_size(4096, 2, 16, 64)
    0
    """
    check_workspace_size_args("flash_mla_prefill_get_workspace_size", max_seq_len=max_seq_len,
                              num_batches=num_batches, num_heads=num_heads, page_size=page_size,
                              num_kv_splits=num_kv_splits)
    return 0


def _check_flash_mla_prefill(q_nope, q_pe, kv_c_and_k_pe_cache, cu_seqlens_q, seq_lens_k,
                             page_table, workspace, max_seqlen_q, sm_scale) -> None:
    """Validate shapes/dtypes/devices and the scale (runs in the fake too)."""
    fn = NAME
    check_finite_scale(fn, "sm_scale", sm_scale)
    check_mla_inputs(fn, q_nope, "q_pe", q_pe, "kv_c_and_k_pe_cache", kv_c_and_k_pe_cache,
                     "total_q")
    device = q_nope.device
    total_q = q_nope.shape[0]
    check_index(fn, "seq_lens_k", seq_lens_k, 1, device)
    batch = seq_lens_k.shape[0]
    check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, batch, device)
    check_index(fn, "page_table", page_table, 2, device)
    check_size(fn, "page_table", page_table, 0, batch, "seq_lens_k.shape[0] (b)")
    check_tensor(fn, "workspace", workspace, ndim=1, dtypes=(torch.uint8,), device=device,
                 fix="Allocate it with torch.empty(flash_mla_prefill_get_workspace_size(...), "
                     "dtype=torch.uint8).")
    if max_seqlen_q < 0:
        fail(fn, "max_seqlen_q", "is negative", "max_seqlen_q >= 0", max_seqlen_q)
    if type(max_seqlen_q) is int and max_seqlen_q == 0 and type(total_q) is int and total_q > 0:
        fail(fn, "max_seqlen_q", f"is 0 while q_nope has {total_q} tokens",
             "max_seqlen_q >= 1 (an upper bound of the new tokens of any request)", 0)


@define_op("xpu_ops::flash_mla_prefill", mutates_args=("workspace",), by_device=True)
def flash_mla_prefill_op(q_nope: Tensor, q_pe: Tensor, kv_c_and_k_pe_cache: Tensor,
                         cu_seqlens_q: Tensor, seq_lens_k: Tensor, page_table: Tensor,
                         workspace: Tensor, *, max_seqlen_q: int, sm_scale: float, causal: bool,
                         num_kv_splits: int) -> Tensor:
    """Op form of ``flash_mla_prefill``; returns a new ``[total_q, H, R]`` tensor (rows that
    no request describes, with inconsistent metadata, are 0), may use ``workspace`` as scratch
    (declared mutated)."""
    args = (q_nope, q_pe, kv_c_and_k_pe_cache, cu_seqlens_q, seq_lens_k, page_table, workspace)
    _check_flash_mla_prefill(*args, max_seqlen_q, sm_scale)


@flash_mla_prefill_op.register_fake
def _(q_nope, q_pe, kv_c_and_k_pe_cache, cu_seqlens_q, seq_lens_k, page_table, workspace, *,
      max_seqlen_q, sm_scale, causal, num_kv_splits):
    _check_flash_mla_prefill(q_nope, q_pe, kv_c_and_k_pe_cache, cu_seqlens_q, seq_lens_k,
                             page_table, workspace, max_seqlen_q, sm_scale)
    return q_nope.new_empty(q_nope.shape)


def flash_mla_prefill(q_nope, q_pe, kv_c_and_k_pe_cache, cu_seqlens_q, seq_lens_k, max_seqlen_q,
                      page_table, workspace, sm_scale, causal=True, num_kv_splits=-1):
    """Absorbed multi-head latent attention of ragged new tokens over a paged latent cache.

    Request ``r`` has ``Lq = cu_seqlens_q[r + 1] - cu_seqlens_q[r]`` new tokens and ``Lk =
    seq_lens_k[r]`` keys (its cached prefix plus the new tokens, stored before the call). Query
    row ``i`` sits at position ``Lk - Lq + i``; ``causal`` lets it see keys ``j <= Lk - Lq + i``
    (the whole prefix and the new tokens up to itself), otherwise all ``Lk`` keys.
    ``out[t, h] = sum_j p_j * latent_j`` with ``p = softmax(sm_scale * (q_nope[t, h].latent_j +
    q_pe[t, h].rope_j))``; a row with no visible key gets 0.

    Args:
        q_nope: [total_q, H, R] fp16|bf16|fp32, queries projected into the latent space.
        q_pe: [total_q, H, r], rotary part of the queries (q_nope's dtype).
        kv_c_and_k_pe_cache: [num_pages, page_size, R + r], latent then rope part per token.
        cu_seqlens_q: [b + 1] int32 prefix sums of new tokens per request.
        seq_lens_k: [b] int32, keys (tokens, not pages) of each request, prefix included.
        max_seqlen_q: upper bound of any request's new tokens (int).
        page_table: [b, max_pages_per_seq] int32 page ids; entries past the end are never read.
        workspace: [bytes] uint8, ``flash_mla_prefill_get_workspace_size(...)`` bytes or more.
        sm_scale: multiplier on the scores (float), usually ``1/sqrt(D_qk)`` of the un-absorbed
            head (e.g. ``192 ** -0.5``); finite (NaN or inf raises ValueError).
        causal: bottom-right causal mask (default True); a bool (or an int 0 or 1), any
            other value is a TypeError (``"False"`` is not read as True).
        num_kv_splits: accepted for sgl-kernel compatibility (any int); results do not depend
            on it.
    Returns:
        [total_q, H, R], dtype of q_nope.
    Raises:
        TypeError/ValueError: shape, dtype or device mismatch, naming the argument.
        ValueError: with ``XPU_OPS_DEBUG_CHECKS=1``, ``cu_seqlens_q``, ``max_seqlen_q``,
            ``seq_lens_k`` or a page id that is read out of range.
    Source: DeepSeek-V2 (arXiv 2405.04434) weight absorption; FlashAttention-2 online softmax;
    semantics of sgl-kernel-xpu's ``flash_mla_prefill``.

    >>> import torch, xpu_ops
    >>> qn, qp, kv = torch.randn(2, 3, 8), torch.randn(2, 3, 4), torch.randn(2, 4, 12)
    >>> o = xpu_ops.flash_mla_prefill(qn, qp, kv, torch.tensor([0, 2], dtype=torch.int32),
    ...                               torch.tensor([6], dtype=torch.int32), 2,
    ...                               torch.tensor([[1, 0]], dtype=torch.int32),
    ...                               torch.empty(0, dtype=torch.uint8), 0.5)
    >>> keys = torch.cat([kv[1], kv[0]])[:6]                       # the request's 6 tokens
    >>> s = 0.5 * torch.einsum("qhd,kd->hqk", torch.cat([qn, qp], -1), keys)
    >>> s = s.masked_fill(torch.arange(6) > torch.arange(4, 6)[:, None], float("-inf"))
    >>> torch.allclose(o, torch.einsum("hqk,kd->qhd", s.softmax(-1), keys[:, :8]), atol=1e-5)
    True
    """
    check_tensor_args(NAME, q_nope=q_nope, q_pe=q_pe, kv_c_and_k_pe_cache=kv_c_and_k_pe_cache,
                      cu_seqlens_q=cu_seqlens_q, seq_lens_k=seq_lens_k, page_table=page_table,
                      workspace=workspace)
    max_seqlen_q = int_scalar(NAME, "max_seqlen_q", max_seqlen_q)
    _value_checks.check_flash_mla_prefill(q_nope, kv_c_and_k_pe_cache, cu_seqlens_q, seq_lens_k,
                                          page_table, max_seqlen_q)
    return torch.ops.xpu_ops.flash_mla_prefill(
        q_nope, q_pe, kv_c_and_k_pe_cache, cu_seqlens_q, seq_lens_k, page_table, workspace,
        max_seqlen_q=max_seqlen_q, sm_scale=finite_scale(NAME, "sm_scale", sm_scale),
        causal=check_flag(NAME, "causal", causal), num_kv_splits=int_scalar(NAME, "num_kv_splits", num_kv_splits))
