"""``DSAAttentionBackend``: DeepSeek Sparse Attention over the MLA latent cache (sglang's
``dsa_backend`` / ``nsa_backend`` role).

Each DSA layer passes the indexer's inputs (``index_q``, ``index_k``, ``index_weights``;
``compile.models.deepseek_v32``) with its absorbed MLA query. Per layer and step:

1. the latent row and the index key of every new token are written at the step's slots
   (``DSATokenToKVPool``: the same slot in both caches);
2. dense MLA prefill (``mla_attention.forward_absorbed``: ``flash_mla_prefill``) when the step
   is an extend (with or without cached prefix, mixed) whose every request holds at most
   ``index_topk`` keys: the top-k would then keep every key, so sparse equals dense (sglang
   also runs short prefills dense); decided on the host, once per step;
3. otherwise the indexer picks each query row's top-k cache slots
   (``compile.backend.dsa_indexer.topk_slots``) and sparse MLA attends over exactly those slots
   of the paged latent cache, no gather copy: ``flash_mla_with_kvcache(indices=...)`` for
   DECODE and TARGET_VERIFY (``[b, s_q, topk]``, ``s_q`` query tokens per request),
   ``flash_mla_sparse_fwd`` over the whole cache as rows for extend.

An fp8 latent cache (``DSATokenToKVPool(dtype=torch.float8_e4m3fn)``: FlashMLA's fp8 tokens,
as sglang's DSA backend keeps with ``--kv-cache-dtype fp8_e4m3``) is read by
``flash_mla_with_kvcache(is_fp8_kvcache=True)`` in every mode (extend rows as requests of one
query token each) and never by dense prefill (the top-k of a short request keeps all its keys,
so sparse equals dense there). DeepSeek-V3.2 has no attention sinks; the layers pass none.

Metadata (host, once per step, ``build_metadata``): the parent's, plus ``DSARows`` (per query
row: its request's page table and causal key count) for every mode but DECODE, whose rows are
the requests themselves (``main``); so a plain decode step still computes its metadata inside
its graph (``init_forward_metadata_in_graph``), and TARGET_VERIFY keeps its rows in fixed graph
buffers (``rows.page_table``, ``rows.cache_seqlens``). Nothing in ``forward`` syncs the host.
Modes: EXTEND (with or without cached prefix), MIXED, DECODE, TARGET_VERIFY with topk 1, IDLE;
others raise ``NotImplementedError``. Layers without indexer inputs run the parent's MLA.
Source: DeepSeek-V3.2-Exp; sglang ``python/sglang/srt/layers/attention/nsa_backend.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

import xpu_ops

from compile.backend import mla_attention
from compile.backend.attention_backend import XPUAttentionBackend
from compile.backend.attention_metadata import AttentionMetadata
from compile.backend.dsa_indexer import DSARows, rows_of, topk_slots


@dataclasses.dataclass
class DSAMetadata(AttentionMetadata):
    """``AttentionMetadata`` plus the DSA facts of the step.

    Attributes:
        rows: ``DSARows`` of the query rows (None for DECODE: the rows are ``main``'s).
        dense_prefill: an extend step whose every request holds <= ``index_topk`` keys.
    """

    rows: Optional[DSARows] = None
    dense_prefill: bool = False


class DSAAttentionBackend(XPUAttentionBackend):
    """``XPUAttentionBackend`` whose MLA layers with indexer inputs attend sparsely (module
    docstring). Needs a ``DSATokenToKVPool`` and ``model_config.index_topk``.

    Raises:
        TypeError: the pool has no index-key cache.
    """

    def __init__(self, model_runner, **kwargs):
        super().__init__(model_runner, **kwargs)
        if not hasattr(self.token_to_kv_pool, "get_index_k_with_scale_buffer"):
            raise TypeError(f"DSAAttentionBackend: token_to_kv_pool is "
                            f"{type(self.token_to_kv_pool).__name__}; expected a "
                            f"DSATokenToKVPool (compile.batch.dsa_pool).")
        self.index_topk = int(self.model_config.index_topk)

    @property
    def fp8_latent(self) -> bool:
        """The pool's latent cache holds FlashMLA fp8 tokens."""
        return bool(getattr(self.token_to_kv_pool, "fp8_latent", False))

    # ----------------------------------------------------------------- plan (host)

    def build_metadata(self, fb, graph: bool = False) -> AttentionMetadata:
        """The parent's metadata as ``DSAMetadata`` with this step's rows and dense choice."""
        mode = fb.forward_mode
        if (mode.is_target_verify() and self.topk > 1) or (
                mode.is_decode() and fb.spec_info is not None) or fb.is_draft_extend():
            raise NotImplementedError(f"DSAAttentionBackend: mode {mode.name} with speculative "
                                      f"topk {self.topk} is not supported; expected EXTEND, "
                                      f"MIXED, DECODE or TARGET_VERIFY with topk 1.")
        meta = super().build_metadata(fb, graph)
        fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(AttentionMetadata)}
        out = DSAMetadata(**fields)
        if mode.is_idle() or mode.is_decode():
            return out
        out.rows = rows_of(meta.main, fb.out_cache_loc.shape[0])
        if mode.is_extend_or_draft_extend_or_mixed() and fb.batch_size:
            out.dense_prefill = (not self.fp8_latent
                                 and int(fb.seq_lens_cpu.max()) <= self.index_topk)
        return out

    def graph_metadata_buffers(self, max_bs: int, max_num_tokens: int) -> dict[str, Tensor]:
        """The parent's buffers plus TARGET_VERIFY's rows (one per query token)."""
        buf = super().graph_metadata_buffers(max_bs, max_num_tokens)
        width = buf["main.page_table"].shape[1]
        i32 = dict(dtype=torch.int32, device=self.device)
        buf["rows.page_table"] = torch.zeros(max_num_tokens, width, **i32)
        buf["rows.cache_seqlens"] = torch.zeros(max_num_tokens, **i32)
        return buf

    # ----------------------------------------------------------------- run (per layer)

    def _forward(self, q, k, v, layer, fb, save_kv_cache: bool, sinks=None,
                 index_q: Optional[Tensor] = None, index_k: Optional[Tensor] = None,
                 index_weights: Optional[Tensor] = None, **kwargs) -> Tensor:
        meta = self._metadata()
        if index_q is None:
            if self.fp8_latent:
                raise NotImplementedError(
                    f"DSAAttentionBackend: layer {layer.layer_id} passes no indexer inputs over "
                    f"an fp8 latent cache; expected every layer of a DSA model to have an "
                    f"indexer (dense MLA reads no fp8 FlashMLA tokens). Use a bfloat16 cache.")
            return super()._forward(q, k, v, layer, fb, save_kv_cache, sinks=sinks, **kwargs)
        pool = self.token_to_kv_pool
        if save_kv_cache and index_k is not None:
            pool.set_index_k_buffer(layer.layer_id, meta.write.loc, index_k)
        if getattr(meta, "dense_prefill", False):
            return mla_attention.forward_absorbed(self, q, k, v, layer, fb, save_kv_cache, meta,
                                                  **kwargs)
        return self._sparse(q, k, layer, fb, save_kv_cache, meta, index_q, index_weights,
                            **kwargs)

    def _sparse(self, q, k, layer, fb, save_kv_cache: bool, meta, index_q: Tensor,
                index_weights: Tensor, q_rope: Optional[Tensor] = None,
                k_rope: Optional[Tensor] = None) -> Tensor:
        """Sparse MLA of one layer (step 3 of the module docstring) -> ``[T, H * R]``."""
        pool, ps = self.token_to_kv_pool, self.page_size
        rank, rope, heads = pool.kv_lora_rank, pool.qk_rope_head_dim, layer.tp_q_head_num
        if k is not None and save_kv_cache:
            pool.set_mla_kv_buffer(layer, meta.write.loc, k.reshape(-1, 1, rank),
                                   k_rope.reshape(-1, 1, rope))
        main = meta.main
        rows = getattr(meta, "rows", None) or DSARows(main.page_table, main.cache_seqlens)
        index_cache = pool.get_index_k_with_scale_buffer(layer.kv_cache_layer_id)
        slots = topk_slots(index_cache, rows, index_q, index_weights, self.index_topk,
                           ps)                                                 # [T, topk]
        q_all = torch.cat((q.reshape(-1, heads, rank), q_rope.reshape(-1, heads, rope)), -1)
        kv = pool.get_key_buffer(layer.kv_cache_layer_id)     # [slots, 1, D] or fp8 tokens
        out = self.output_buffer(fb, q_all, heads, rank)
        mode = fb.forward_mode
        per_request = mode.is_decode() or mode.is_target_verify()
        if per_request or self.fp8_latent:
            b = main.batch_size if per_request else q_all.shape[0]   # extend: a row a request
            res, _ = xpu_ops.flash_mla_with_kvcache(
                q_all.view(b, -1, heads, rank + rope), kv.view(-1, ps, 1, kv.shape[-1]),
                head_dim_v=rank, softmax_scale=layer.scaling, is_fp8_kvcache=self.fp8_latent,
                indices=slots.view(b, -1, slots.shape[1]))
        else:
            res, _, _ = xpu_ops.flash_mla_sparse_fwd(q_all, kv, slots.unsqueeze(1),
                                                     layer.scaling, d_v=rank)
        out.copy_(res.view(out.shape))
        return out.view(-1, heads * rank)


__all__ = ["DSAAttentionBackend", "DSAMetadata"]
