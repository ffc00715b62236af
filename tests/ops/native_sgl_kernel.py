"""Test-only stand-in for sgl-kernel-xpu's native library (glue tests, not hardware results).

``define_native_library(namespace, convention)`` registers, under ``torch.ops.<namespace>``, the
ops that sgl-kernel-xpu publishes in ``src/torch_extension_sycl.cc`` with the same schemas
(argument names, order, types, mutation annotations), implemented on CPU with xpu-ops'
``reference`` provider. Like the real library it registers **no fake implementations**, so
``xpu_ops.register_sgl_kernel_fakes`` has work to do. It also enforces the native input contract
that the glue must honour (contiguous last dims, fp16/bf16 queries, per-request lengths in the
``cu_seqlens_k`` slot of a paged call, contiguous merge inputs, a large enough MLA workspace), so
a mapping mistake fails loudly instead of matching the reference by accident. The fused
``gdn_attention`` stand-in is in ``native_gdn``.

Conventions of ``fwd``: ``"writes"`` (newer: ``Tensor(a!) out, Tensor(b!)? softmax_lse, ...)
-> ()``) and ``"returns"`` (older: ``Tensor(a!)? out=None) -> (Tensor(a!), Tensor, Tensor,
Tensor)``; the last two are split-KV accumulators, returned here as empty float32 tensors).
"""

from __future__ import annotations

import torch

from xpu_ops.ops.mla_decode import flash_mla_get_workspace_size as xpu_ops_workspace_size
from xpu_ops.reference import flash_mla as ref_flash_mla
from xpu_ops.reference import mla_decode as ref_mla
from xpu_ops.reference import dsa_indexer as ref_dsa
from xpu_ops.reference import merge_state as ref_merge
from xpu_ops.reference import paged_attention as ref_paged
from xpu_ops.reference import varlen_attention as ref_varlen

from . import native_gdn

_FWD_HEAD = (
    "fwd(Tensor q, Tensor k, Tensor v, Tensor? q_v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "int max_seqlen_q, int max_seqlen_k, Tensor? page_table, Tensor? kv_batch_idx, "
    "Tensor? leftpad_k, Tensor? rotary_cos, Tensor? rotary_sin, Tensor? seqlens_rotary, "
    "Tensor? q_descale, Tensor? k_descale, Tensor? v_descale, float softmax_scale, "
    "Tensor? sinks, bool is_causal, int window_size_left, int window_size_right, float softcap, "
    "bool is_rotary_interleaved, Tensor? scheduler_metadata, int num_kv_splits, bool? pack_gqa, "
    "int sm_margin, ")
FWD_SCHEMAS = {
    "writes": _FWD_HEAD + ("Tensor(a!) out, Tensor(b!)? softmax_lse, Tensor? rel_bias=None, "
                           "bool rel_bias_is_sheared=False) -> ()"),
    "returns": _FWD_HEAD + "Tensor(a!)? out=None) -> (Tensor(a!), Tensor, Tensor, Tensor)",
}
OTHER_SCHEMAS = (
    "merge_state_v2(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b, Tensor! v_merged, "
    "Tensor! s_merged) -> ()",
    "flash_mla_get_workspace_size(int max_seq_len, int num_batches, int num_heads, "
    "int page_size, int num_kv_splits) -> int",
    "flash_mla_decode(Tensor! out, Tensor! q_nope, Tensor! q_pe, Tensor! kv_c_and_k_pe_cache, "
    "Tensor! seq_lens, Tensor! page_table, Tensor! workspace, float sm_scale, "
    "int num_kv_splits) -> ()",
    "flash_mla_sparse_decode(Tensor! out, Tensor! lse_out, Tensor! q, Tensor! k_cache, "
    "Tensor! indices, Tensor? topk_length, Tensor? extra_k_cache, Tensor? extra_indices, "
    "Tensor? extra_topk_length, Tensor? attn_sink, float sm_scale, int head_dim_v, "
    "bool is_fp8_kvcache) -> ()",
    "flash_mla_sparse_prefill(Tensor! out, Tensor! max_logits, Tensor! lse, Tensor! q, "
    "Tensor! kv, Tensor! indices, float sm_scale, int head_dim_v, Tensor? attn_sink=None, "
    "Tensor? topk_length=None) -> ()",
    "fp8_paged_mqa_logits(Tensor q_fp8, Tensor kv_cache, Tensor weights, Tensor seq_lens, "
    "Tensor block_tables, Tensor? schedule_metadata, int max_seq_len, bool clean_logits) -> Tensor",
    "fast_topk(Tensor score, Tensor! indices, Tensor lengths, Tensor? row_starts) -> ()",
)

_libraries: dict[str, torch.library.Library] = {}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"native (test stand-in): {message}")


def _fwd(names, convention):
    def fwd(*args, **kwargs):
        a = dict(zip(names, args), **kwargs)
        q, k, v, page_table = a["q"], a["k"], a["v"], a["page_table"]
        for arg in ("q", "k", "v"):
            _require(a[arg].stride(-1) == 1, f"{arg} must have a contiguous last dimension")
        for arg in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table", "q_descale",
                    "k_descale", "v_descale", "sinks", "leftpad_k"):
            _require(a.get(arg) is None or a[arg].is_contiguous(), f"{arg} must be contiguous")
        _require(q.dtype in (torch.float16, torch.bfloat16), f"q must be fp16/bf16, got {q.dtype}")
        out = a.get("out")
        if out is None:
            out = q.new_empty((*q.shape[:2], v.shape[-1]))
        right = 0 if a["is_causal"] else a["window_size_right"]
        scalars = dict(max_seqlen_q=a["max_seqlen_q"], softmax_scale=a["softmax_scale"],
                       causal=a["is_causal"], window_size_left=a["window_size_left"],
                       window_size_right=right, softcap=a["softcap"])
        extras = (a["q_v"], a["q_descale"], a["k_descale"], a["v_descale"], a["sinks"])
        scalars["num_splits"] = a["num_kv_splits"]
        if page_table is not None:
            # sgl-kernel-xpu: a paged call carries per-request cache lengths in cu_seqlens_k.
            _require(a["cu_seqlens_k"].shape == (page_table.shape[0],),
                     "paged fwd takes per-request cache_seqlens [b] in cu_seqlens_k")
            lse = ref_paged.flash_attn_with_kvcache(
                q, k, v, a["cu_seqlens_k"], page_table, a["cu_seqlens_q"], out, *extras,
                a["leftpad_k"], None, **scalars, return_softmax_lse=True)
        else:
            lse = ref_varlen.flash_attn_varlen_func(
                q, k, v, a["cu_seqlens_q"], a["cu_seqlens_k"], out, None, *extras, None,
                max_seqlen_k=a["max_seqlen_k"], **scalars)
        if convention == "writes":
            if a.get("softmax_lse") is not None:
                a["softmax_lse"].copy_(lse)
            return None
        empty = q.new_empty((0,), dtype=torch.float32)
        return out, lse, empty, empty.clone()
    return fwd


def _merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged):
    for name, t in (("v_a", v_a), ("s_a", s_a), ("v_b", v_b), ("s_b", s_b),
                    ("v_merged", v_merged), ("s_merged", s_merged)):
        _require(t.is_contiguous(), f"merge_state_v2 needs contiguous {name}")
    # Not every native kernel is known to read +inf as an empty state; the glue passes -inf.
    _require(not (torch.isposinf(s_a).any() or torch.isposinf(s_b).any()),
             "merge_state_v2 got an LSE of +inf (map it to -inf first)")
    ref_merge.merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged)


#: Extra bytes the stand-in's MLA decode asks for beyond xpu-ops' own sizing, so the glue must
#: size workspaces with the *native* function (as the real kernels have their own formula).
NATIVE_WORKSPACE_EXTRA = 4096


def _workspace_size(max_seq_len, num_batches, num_heads, page_size, num_kv_splits):
    return NATIVE_WORKSPACE_EXTRA + xpu_ops_workspace_size(max_seq_len, num_batches, num_heads,
                                                           page_size, num_kv_splits)


def _flash_mla_decode(out, q_nope, q_pe, kv_cache, seq_lens, page_table, workspace, sm_scale,
                      num_kv_splits):
    batch, heads = q_nope.shape[:2]
    needed = _workspace_size(page_table.shape[1] * kv_cache.shape[1], batch, heads,
                             kv_cache.shape[1], num_kv_splits)
    _require(workspace.numel() >= needed, f"workspace of {workspace.numel()} bytes < {needed}")
    out.copy_(ref_mla.flash_mla_decode(q_nope, q_pe, kv_cache, seq_lens, page_table, workspace,
                                       sm_scale, num_kv_splits))


def _flash_mla_sparse_decode(out, lse_out, q, k_cache, indices, topk_length, extra_k_cache,
                             extra_indices, extra_topk_length, attn_sink, sm_scale, head_dim_v,
                             is_fp8_kvcache):
    _require(q.dtype == torch.bfloat16, f"sparse decode takes bf16 q, got {q.dtype}")
    _require(all(t is None or t.is_contiguous() for t in (q, k_cache, indices, topk_length,
                                                          extra_indices, attn_sink)),
             "sparse decode takes contiguous tensors")
    o, lse = ref_flash_mla.flash_mla_with_kvcache(
        q, k_cache, None, None, head_dim_v, sm_scale, False, is_fp8_kvcache, indices, attn_sink,
        extra_k_cache, extra_indices, topk_length, extra_topk_length)
    out.copy_(o)
    lse_out.copy_(lse.masked_fill(torch.isneginf(lse), float("inf")))   # FlashMLA: +inf empty


def _flash_mla_sparse_prefill(out, max_logits, lse, q, kv, indices, sm_scale, head_dim_v,
                              attn_sink=None, topk_length=None):
    _require(q.is_contiguous() and kv.is_contiguous() and indices.is_contiguous(),
             "sparse prefill takes contiguous q, kv and indices")
    o, m, s = ref_flash_mla.flash_mla_sparse_fwd(q, kv, indices, sm_scale, head_dim_v, attn_sink,
                                                 topk_length)
    out.copy_(o)
    max_logits.copy_(m)
    lse.copy_(s.masked_fill(torch.isneginf(s), float("inf")))


def _fp8_paged_mqa_logits(q_fp8, kv_cache, weights, seq_lens, block_tables, schedule_metadata,
                          max_seq_len, clean_logits):
    # sgl-kernel-xpu: uint8 [B, 1, H, D] queries, no schedule metadata, every position below
    # seq_lens read through the table (ids must be valid there) from per-token rows, zeros past.
    _require(q_fp8.dtype == torch.uint8 and q_fp8.dim() == 4 and q_fp8.shape[1] == 1,
             "q_fp8 must be uint8 [B, 1, H, D]")
    _require(schedule_metadata is None, "schedule_metadata is not supported on XPU")
    for name, t in (("q_fp8", q_fp8), ("kv_cache", kv_cache), ("weights", weights),
                    ("seq_lens", seq_lens), ("block_tables", block_tables)):
        _require(t.is_contiguous(), f"fp8_paged_mqa_logits needs contiguous {name}")
    bs = kv_cache.shape[1]
    lens = seq_lens.reshape(-1)
    _require(max(lens.tolist(), default=0) <= block_tables.shape[1] * bs, "seq_lens past the table")
    for i, n in enumerate(lens.tolist()):
        used = block_tables[i, :-(-n // bs)]
        _require(bool(((used >= 0) & (used < kv_cache.shape[0])).all()), "a block id out of range")
    # sgl-kernel-xpu's cache is per token (D fp8 bytes, then the float32 scale); the reference
    # reads DeepGEMM's blocks (a block's keys, then its scales): regroup each page's bytes.
    pages, _, _, width = kv_cache.shape
    rows = kv_cache.reshape(pages, bs, width)
    blocks = torch.cat([rows[..., :width - 4].reshape(pages, -1),
                        rows[..., width - 4:].reshape(pages, -1)], 1).view(kv_cache.shape)
    logits = ref_dsa.fp8_paged_mqa_logits(q_fp8.view(torch.float8_e4m3fn), blocks, weights,
                                          lens, block_tables, max_seq_len, clean_logits)
    return torch.where(logits == -torch.inf, 0.0, logits)


def _fast_topk(score, indices, lengths, row_starts):
    # Radix select: the set of the top indices.shape[1] (2048) in no specified order.
    _require(indices.shape[1] == 2048 and indices.is_contiguous() and score.is_contiguous(),
             "fast_topk writes 2048 indices per row into contiguous tensors")
    chosen = ref_dsa.fast_topk(score, lengths, row_starts, indices.shape[1])
    indices.copy_(chosen.roll(37, dims=1))            # any order: the glue sorts


def define_native_library(namespace: str, convention: str = "writes") -> str:
    """Register the stand-in under ``torch.ops.<namespace>`` once; return the namespace."""
    if namespace in _libraries:
        return namespace
    lib = torch.library.Library(namespace, "DEF")
    lib.define(FWD_SCHEMAS[convention])
    for schema in OTHER_SCHEMAS:
        lib.define(schema)
    names = [arg.name for arg in getattr(torch.ops, namespace).fwd.default._schema.arguments]
    lib.impl("fwd", _fwd(names, convention), "CPU")
    lib.impl("merge_state_v2", _merge_state_v2, "CPU")
    lib.impl("flash_mla_decode", _flash_mla_decode, "CPU")
    lib.impl("flash_mla_sparse_decode", _flash_mla_sparse_decode, "CPU")
    lib.impl("flash_mla_sparse_prefill", _flash_mla_sparse_prefill, "CPU")
    lib.impl("flash_mla_get_workspace_size", _workspace_size, "CompositeExplicitAutograd")
    lib.impl("fp8_paged_mqa_logits", _fp8_paged_mqa_logits, "CPU")
    lib.impl("fast_topk", _fast_topk, "CPU")
    lib.define(native_gdn.SCHEMA)
    lib.impl("gdn_attention", native_gdn.gdn_attention, "CPU")
    _libraries[namespace] = lib
    return namespace
