"""What the native kernels support: the ``supports=`` hooks of the ``sgl_kernel`` provider.

Each hook receives the op's own (validated, defaulted) arguments, reads only shapes, dtypes and
Python scalars, and returns ``None`` or the reason the native kernel cannot serve the call; the
registry then falls back to the next provider (``triton``) and records the reason, which
``python -m xpu_ops info`` prints.

The limits of the ``"xpu"`` flavour come from sgl-kernel-xpu's kernel instantiation lists
(``xe_fmha_fwd_decode_dispatch.hpp``: head dims 64/96/128/192/256, page sizes 64/128, query
groups 1/2/4/8/16; ``xe_fmha_fwd_prefill_dispatch.hpp``: paged head dims 64/96/128/192/256/512,
non-paged 64/72/80/96/128/192/256/512, bf16/fp16 queries, fp8 KV only with a bf16 query) and its
Python wrappers (``flash_mla_decode``: R = 512, r = 64, H <= 128). Read from source, not measured.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import native

HALF_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

XPU_DECODE_HEAD_DIMS = (64, 96, 128, 192, 256)
XPU_DECODE_PAGE_SIZES = (64, 128)
XPU_DECODE_QUERY_GROUPS = (1, 2, 4, 8, 16)
XPU_PAGED_HEAD_DIMS = (64, 96, 128, 192, 256, 512)
XPU_VARLEN_HEAD_DIMS = (64, 72, 80, 96, 128, 192, 256, 512)
XPU_SINK_HEAD_DIMS = (64,)
FA3_MAX_HEAD_DIM = 256
MLA_LATENT_DIM, MLA_ROPE_DIM, MLA_MAX_HEADS, MLA_TILE_TOKENS = 512, 64, 128, 128


def _common(q, k_dtype, head_dim, head_dim_v, qv, sinks, flavour) -> Optional[str]:
    """Limits shared by paged and varlen attention."""
    if qv is not None:
        return "qv (absorbed-MLA extend) is not supported by the native kernel"
    if q.dtype in FP8_DTYPES:
        return f"fp8 query ({q.dtype}) is not supported by the native kernel"
    if q.dtype not in HALF_DTYPES:
        return f"the native kernel takes float16/bfloat16 queries, got {q.dtype}"
    if head_dim != head_dim_v:
        return f"head dim D={head_dim} differs from Dv={head_dim_v}"
    if k_dtype in FP8_DTYPES and q.dtype != torch.bfloat16:
        return f"fp8 KV cache needs a bfloat16 query, got {q.dtype}"
    if flavour == "xpu" and sinks is not None and head_dim not in XPU_SINK_HEAD_DIMS:
        return f"sinks need head dim in {XPU_SINK_HEAD_DIMS}, got {head_dim}"
    if flavour == "fa3" and head_dim > FA3_MAX_HEAD_DIM:
        return f"head dim {head_dim} > {FA3_MAX_HEAD_DIM}"
    return None


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out,
                            qv, q_descale, k_descale, v_descale, sinks, cache_leftpad,
                            bidirectional_block_ids, max_seqlen_q, *_, **__) -> Optional[str]:
    """``supports=`` hook of ``flash_attn_with_kvcache``: ``None``, or why native ``fwd`` cannot
    serve it (``bidirectional_block_ids``: not mapped; on ``"xpu"``: listed head dims; decode
    also listed page sizes and Hq/Hkv, no ``cache_leftpad``).
    """
    if bidirectional_block_ids is not None:
        return "bidirectional_block_ids is not mapped onto native fwd (no verified argument)"
    flavour = native.fwd_flavour(native.schema("fwd"))
    _, page_size, num_heads_kv, head_dim = k_cache.shape
    reason = _common(q, k_cache.dtype, head_dim, v_cache.shape[-1], qv, sinks, flavour)
    if reason is not None or flavour != "xpu":
        return reason
    if max_seqlen_q == 1:   # decode kernels
        group = q.shape[1] // num_heads_kv
        if cache_leftpad is not None:
            return "cache_leftpad is not supported by the native decode kernels"
        if page_size not in XPU_DECODE_PAGE_SIZES:
            return f"decode needs page_size in {XPU_DECODE_PAGE_SIZES}, got {page_size}"
        if head_dim not in XPU_DECODE_HEAD_DIMS:
            return f"decode needs head dim in {XPU_DECODE_HEAD_DIMS}, got {head_dim}"
        if group not in XPU_DECODE_QUERY_GROUPS:
            return f"decode needs Hq/Hkv in {XPU_DECODE_QUERY_GROUPS}, got {group}"
    elif head_dim not in XPU_PAGED_HEAD_DIMS:
        return f"paged prefill needs head dim in {XPU_PAGED_HEAD_DIMS}, got {head_dim}"
    return None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, out, seqused_k, qv, q_descale,
                           k_descale, v_descale, sinks, seqused_q, *_, **__) -> Optional[str]:
    """``supports=`` hook of ``flash_attn_varlen_func``: ``None``, or why native ``fwd`` cannot
    serve it (on ``"xpu"``: no ``seqused_k``/``seqused_q``, listed head dims only).
    """
    flavour = native.fwd_flavour(native.schema("fwd"))
    head_dim = k.shape[-1]
    reason = _common(q, k.dtype, head_dim, v.shape[-1], qv, sinks, flavour)
    if reason is not None or flavour != "xpu":
        return reason
    if seqused_k is not None or seqused_q is not None:
        return "seqused_k/seqused_q have no slot in sgl-kernel-xpu's fwd"
    if head_dim not in XPU_VARLEN_HEAD_DIMS:
        return f"varlen needs head dim in {XPU_VARLEN_HEAD_DIMS}, got {head_dim}"
    return None


def native_mla_workspace_bytes(max_seq_len: int, batch: int, num_heads: int, page_size: int,
                               num_kv_splits: int) -> Optional[int]:
    """Workspace bytes the native MLA decode asks for, or None when it has no sizing op."""
    for name in ("flash_mla_get_workspace_size", "flash_mla_decode_get_workspace_size"):
        op = native.packet(name)
        if op is not None and len(op.default._schema.arguments) == 5:
            return int(op(max_seq_len, batch, num_heads, page_size, num_kv_splits))
    return None


def flash_mla_decode(q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace,
                     softmax_scale, num_kv_splits) -> Optional[str]:
    """``supports=`` hook of ``flash_mla_decode``: ``None``, or why the native kernel cannot serve
    it ((R, r) = (512, 64), H <= 128, fp16/bf16, page-table width a multiple of 128 tokens, enough
    ``workspace`` bytes).
    """
    batch, num_heads, latent_dim = q_nope.shape
    page_size = kv_cache.shape[1]
    if (latent_dim, q_rope.shape[-1]) != (MLA_LATENT_DIM, MLA_ROPE_DIM):
        return (f"native MLA decode needs (R, r) = ({MLA_LATENT_DIM}, {MLA_ROPE_DIM}), got "
                f"({latent_dim}, {q_rope.shape[-1]})")
    if num_heads > MLA_MAX_HEADS:
        return f"native MLA decode needs H <= {MLA_MAX_HEADS}, got {num_heads}"
    if q_nope.dtype not in HALF_DTYPES:
        return f"native MLA decode takes float16/bfloat16, got {q_nope.dtype}"
    tile_pages = max(1, MLA_TILE_TOKENS // page_size)
    if page_table.shape[1] % tile_pages != 0:
        return (f"native MLA decode needs page_table.shape[1] divisible by {tile_pages} "
                f"(128 tokens / page_size), got {page_table.shape[1]}")
    needed = native_mla_workspace_bytes(page_table.shape[1] * page_size, batch, num_heads,
                                        page_size, num_kv_splits)
    if needed is None:
        return "the native library has no 5-argument flash_mla_get_workspace_size"
    have = workspace.numel() * workspace.element_size()
    if have < needed:
        return (f"workspace has {have} bytes, the native kernel needs {needed} "
                f"(size it with the native flash_mla_get_workspace_size)")
    return None
