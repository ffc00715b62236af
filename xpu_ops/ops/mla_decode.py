"""``flash_mla_decode``: absorbed multi-head latent attention (MLA) for decode.

Every query head attends over one shared latent KV head: keys are ``[latent, rope]`` and values
the latent part. ``flash_mla_get_workspace_size`` sizes the split-KV scratch buffer from shapes
only, so the op never allocates during a captured graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _value_checks
from .._registration import define_op
from .._checks import (FLOAT_DTYPES, check_contiguous_last, check_size, check_tensor,
                       check_tensor_args, fail, int_scalar)
from ..mla_workspace import mla_num_kv_splits, mla_split_bytes
from .common import (check_finite_scale, check_flag, check_index, check_mla_inputs,
                     check_workspace_size_args, finite_scale)
from .mla_decode_tokens import decode_tokens

NAME = "flash_mla_decode"
WORKSPACE_HEADS = 128         # heads assumed when flash_mla_get_workspace_size is not told
WORKSPACE_LATENT_DIM = 512    # R assumed by the workspace: the partial outputs of each split


def _workspace_size(fn, max_seq_len, num_batches, num_heads, page_size, num_kv_splits,
                    seqlen_q, latent_dim) -> int:
    check_workspace_size_args(fn, max_seq_len=max_seq_len, num_batches=num_batches,
                              num_heads=num_heads, page_size=page_size,
                              num_kv_splits=num_kv_splits, seqlen_q=seqlen_q,
                              latent_dim=latent_dim)
    heads = num_heads if num_heads > 0 else WORKSPACE_HEADS
    splits = mla_num_kv_splits(max_seq_len, num_kv_splits)
    rows = int(num_batches) * max(int(seqlen_q), 1)
    return splits * mla_split_bytes(rows, heads, int(latent_dim) or WORKSPACE_LATENT_DIM)


def flash_mla_decode_get_workspace_size(max_seq_len, num_batches, num_heads=0, page_size=0,
                                        num_kv_splits=-1, *, seqlen_q=1,
                                        latent_dim=WORKSPACE_LATENT_DIM) -> int:
    """Bytes of scratch that ``flash_mla_decode`` needs (split-KV partial outputs and LSEs).

    Args:
        max_seq_len: longest cache of any request, in tokens (a bound; the op uses
            ``page_table.shape[1] * page_size``).
        num_batches: b, requests per call. num_heads: H (0 = assume 128).
        page_size: accepted for sgl-kernel compatibility (unused).
        num_kv_splits: forced split count, or -1 to derive it from ``max_seq_len``.
        seqlen_q: query tokens per request (keyword; several for MTP / verify steps).
        latent_dim: R (keyword; default 512, DeepSeek's; 0 means 512).
    Returns:
        int, bytes: ``b * s_q * H * splits * (R + 1) * 4`` (float32 partials + LSE).
    Raises:
        TypeError: an argument is not an integer. ValueError: a negative size.
    Source: FlashDecoding split-KV (Dao et al., 2023); sgl-kernel's workspace convention
    (sglang 0.5.23 calls this name; ``flash_mla_get_workspace_size`` is the older one).

    >>> flash_mla_decode_get_workspace_size(4096, 2, 16)
    525312
    """
    return _workspace_size("flash_mla_decode_get_workspace_size", max_seq_len, num_batches,
                           num_heads, page_size, num_kv_splits, seqlen_q, latent_dim)


def flash_mla_get_workspace_size(max_seq_len, num_batches, num_heads=0, page_size=0,
                                 num_kv_splits=-1, *, seqlen_q=1,
                                 latent_dim=WORKSPACE_LATENT_DIM) -> int:
    """The older name of ``flash_mla_decode_get_workspace_size`` (same arguments and result).

    >>> flash_mla_get_workspace_size(4096, 2, 16) == flash_mla_decode_get_workspace_size(4096, 2, 16)
    True
    """
    return _workspace_size("flash_mla_get_workspace_size", max_seq_len, num_batches, num_heads,
                           page_size, num_kv_splits, seqlen_q, latent_dim)


def _check_flash_mla_decode(q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace,
                            num_kv_splits, softmax_scale) -> None:
    """Validate shapes/dtypes/devices and the scale (runs in the fake too)."""
    fn = NAME
    check_finite_scale(fn, "softmax_scale", softmax_scale)
    check_mla_inputs(fn, q_nope, "q_rope", q_rope, "kv_cache", kv_cache, "b")
    device = q_nope.device
    batch, num_heads, latent_dim = q_nope.shape
    check_index(fn, "cache_seqlens", cache_seqlens, 1, device)
    check_size(fn, "cache_seqlens", cache_seqlens, 0, batch, "q_nope.shape[0] (b)")
    check_index(fn, "page_table", page_table, 2, device)
    check_size(fn, "page_table", page_table, 0, batch, "q_nope.shape[0] (b)")
    check_tensor(fn, "workspace", workspace, ndim=1, dtypes=(torch.uint8,), device=device,
                 fix="Allocate it with torch.empty(flash_mla_get_workspace_size(...), "
                     "dtype=torch.uint8).")
    check_contiguous_last(fn, "workspace", workspace)  # reinterpreted as float32 partials
    need = mla_split_bytes(batch, num_heads, latent_dim) * max(num_kv_splits, 1)
    if workspace.shape[0] < need:
        fail(fn, "workspace", "is too small",
             f"at least {need} bytes ({max(num_kv_splits, 1)} split(s) of b * H * (R + 1) "
             f"float32)", f"{workspace.shape[0]} bytes",
             "Size it with flash_mla_get_workspace_size.")


@define_op("xpu_ops::flash_mla_decode", mutates_args=("workspace",), by_device=True)
def flash_mla_decode_op(q_nope: Tensor, q_rope: Tensor, kv_cache: Tensor, cache_seqlens: Tensor,
                        page_table: Tensor, workspace: Tensor, softmax_scale: float,
                        num_kv_splits: int) -> Tensor:
    """Op form of ``flash_mla_decode``; returns a new ``[b, H, R]`` tensor, uses ``workspace``
    as scratch (declared mutated)."""
    args = (q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace)
    _check_flash_mla_decode(*args, num_kv_splits, softmax_scale)


@flash_mla_decode_op.register_fake
def _(q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace, softmax_scale,
      num_kv_splits):
    _check_flash_mla_decode(q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace,
                            num_kv_splits, softmax_scale)
    return q_nope.new_empty(q_nope.shape)


def flash_mla_decode(q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace,
                     softmax_scale, num_kv_splits=-1, *, causal=False, return_softmax_lse=False):
    """Absorbed multi-head latent attention for decode, one or several query tokens per request.

    ``out[b, h] = sum_j p_j * latent_j`` with ``p = softmax(softmax_scale * (q_nope.latent_j +
    q_rope.rope_j))`` over the request's ``cache_seqlens[b]`` tokens; a request with an empty
    cache gets 0. With 4-D queries ``[b, s_q, H, R]`` each request has ``s_q`` query tokens at
    positions ``cache_seqlens[b] - s_q + s`` (bottom-right; ``causal`` lets row ``s`` see keys up
    to its position, for MTP / speculative verify); that form and ``return_softmax_lse`` run as
    the dense ``flash_mla_with_kvcache`` (one pass; ``num_kv_splits`` changes nothing).

    Args:
        q_nope: [b, H, R] fp16|bf16|fp32, query projected into the latent space.
        q_rope: [b, H, r], rotary part of the query.
        kv_cache: [num_pages, page_size, R + r], latent then rope part per token (q's dtype).
        cache_seqlens: [b] int32, tokens (not pages) in each request's cache.
        page_table: [b, max_pages_per_seq] int32 page ids; entries past the end are never read.
        workspace: [bytes] uint8 scratch of ``flash_mla_get_workspace_size(...)`` bytes.
        softmax_scale: multiplier on the scores (float), usually ``1/sqrt(D_qk)`` of the
            un-absorbed head (e.g. ``192 ** -0.5``); finite (NaN or inf raises ValueError).
        num_kv_splits: split-KV count, -1 to derive it from shapes.
        causal: bottom-right causal mask among a request's ``s_q`` query tokens (keyword).
        return_softmax_lse: also return the LSE (keyword).
    Returns:
        [b, H, R] (4-D queries: [b, s_q, H, R]), dtype of q_nope; with ``return_softmax_lse``
        ``(out, lse)``, lse float32 [b, H] (or [b, H, s_q]), natural log, -inf for a row
        with no key.
    Raises:
        TypeError/ValueError: shape, dtype or device mismatch, naming the argument; a
            num_kv_splits or softmax_scale that is not an int / a real number.
        ValueError: with ``XPU_OPS_DEBUG_CHECKS=1``, ``cache_seqlens`` or a page id that is read
            out of range.
    Source: DeepSeek-V2 (arXiv 2405.04434) weight absorption; FlashAttention-2 online softmax;
    FlashDecoding split-KV.

    >>> import torch, xpu_ops
    >>> qn, qr, kv = torch.randn(1, 2, 8), torch.randn(1, 2, 4), torch.randn(1, 4, 12)
    >>> ws = torch.empty(xpu_ops.flash_mla_get_workspace_size(4, 1, 2), dtype=torch.uint8)
    >>> o = xpu_ops.flash_mla_decode(qn, qr, kv, torch.tensor([3], dtype=torch.int32),
    ...                              torch.tensor([[0]], dtype=torch.int32), ws, 0.5)
    >>> p = (0.5 * torch.cat([qn, qr], -1)[0] @ kv[0, :3].T).softmax(-1)
    >>> torch.allclose(o[0], p @ kv[0, :3, :8], atol=1e-5)
    True
    """
    check_tensor_args(NAME, q_nope=q_nope, q_rope=q_rope, kv_cache=kv_cache,
                      cache_seqlens=cache_seqlens, page_table=page_table, workspace=workspace)
    causal = check_flag(NAME, "causal", causal)
    return_softmax_lse = check_flag(NAME, "return_softmax_lse", return_softmax_lse)
    if return_softmax_lse or causal or q_nope.dim() == 4:
        return decode_tokens(q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace,
                             finite_scale(NAME, "softmax_scale", softmax_scale),
                             int_scalar(NAME, "num_kv_splits", num_kv_splits,
                                        "an int split count (-1: derived)"),
                             causal, return_softmax_lse)
    _value_checks.check_flash_mla_decode(kv_cache, cache_seqlens, page_table)
    return torch.ops.xpu_ops.flash_mla_decode(q_nope, q_rope, kv_cache, cache_seqlens,
                                              page_table, workspace,
                                              finite_scale(NAME, "softmax_scale", softmax_scale),
                                              int_scalar(NAME, "num_kv_splits", num_kv_splits,
                                                         "an int split count (-1: derived)"))
