"""``XPUAttentionBackend``: sglang's attention-backend interface over the ``xpu_ops`` operators.

Plan/run split (as FlashInfer): ``init_forward_metadata(forward_batch)`` runs on the host once
per batch and builds ``AttentionMetadata`` (``compile.backend.metadata_builder`` per mode,
``compile.backend.attention_metadata`` for its fields); ``forward`` runs per layer, inside
compiled or captured code, and only launches ops: ``store_kv_cache`` for the new K/V,
``flash_attn_with_kvcache`` (``flash_mla_decode`` / ``flash_mla_prefill`` for absorbed MLA,
``flash_attn_varlen_func`` for MLA's MHA prefill), and ``merge_state_v2`` for the cascade
passes of speculative trees.

Layers pick their variant: sliding-window layers (``window_size = (W - 1, 0)``, SWA-pool table on
hybrid pools), chunked-local layers (virtual batches), cross attention (encoder keys), MLA.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import xpu_ops
from xpu_ops._value_checks import debug_checks_enabled

from compile.backend import mla_attention
from compile.backend.attention_metadata import (AttentionMetadata, PagedAttnMetadata,
                                                query_block_ids)
from compile.backend.backend_graph import GraphMetadataMixin
from compile.backend.base_backend import AttentionBackend, SharedReadEnds
from compile.backend.layer import is_causal
from compile.backend.metadata_builder import MetadataBuilderMixin
from compile.batch import ForwardBatch, ForwardMode, MLATokenToKVPool, is_draft_extend

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

class XPUAttentionBackend(MetadataBuilderMixin, GraphMetadataMixin, AttentionBackend):
    """Attention backend for every sglang forward mode on XPU, CUDA and CPU.

    It subclasses ``AttentionBackend`` (sglang 0.5.23's interface, ``base_backend.py``): every
    flag and hook sglang's runners read exists with sglang's meaning; the overrides below say
    where this backend's answer differs.

    Args:
        model_runner: sglang ``ModelRunner`` or ``compile.engine.model_runner.ModelRunnerInfo``
            (duck-typed: ``model_config``, ``tp_size``, ``device``, ``page_size``,
            ``req_to_token_pool``, ``token_to_kv_pool``, ``kv_cache_dtype``, ``server_args``,
            ``sliding_window_size``, ``attention_chunk_size``, ``is_hybrid_swa``;
            ``model_config.is_encoder_decoder`` when present).
            ``server_args.enable_deterministic_inference`` pins ``num_splits=1`` (and MLA's
            ``num_kv_splits=1``) in every call, as sglang 0.5.23.
        skip_prefill: accepted for sglang compatibility (draft-decode backends).
        speculative_step_id: which draft step this backend runs (draft decode).
        topk: draft branches per request (0: take ``server_args.speculative_eagle_topk``).
        speculative_num_steps: draft steps per round (0: from ``server_args``).
    """

    def __init__(self, model_runner, skip_prefill: bool = False, speculative_step_id: int = 0,
                 topk: int = 0, speculative_num_steps: int = 0):
        mr = model_runner
        self.device = torch.device(mr.device)
        self.page_size = int(mr.page_size)
        self.req_to_token = mr.req_to_token_pool.req_to_token
        self.token_to_kv_pool = mr.token_to_kv_pool
        self.kv_cache_dtype = mr.kv_cache_dtype
        self.is_hybrid_swa = bool(getattr(mr, "is_hybrid_swa", False))
        self.sliding_window_size = getattr(mr, "sliding_window_size", None)
        self.attention_chunk_size = getattr(mr, "attention_chunk_size", None)
        use_mla = getattr(mr, "use_mla_backend", None)
        self.use_mla = (isinstance(mr.token_to_kv_pool, MLATokenToKVPool) if use_mla is None
                        else bool(use_mla))
        self.model_config = mr.model_config
        # sglang's flag; sizes the encoder graph buffers (cross attention, decoder slot table)
        self.is_encoder_decoder = bool(getattr(mr.model_config, "is_encoder_decoder", False))
        self.max_context_len = int(getattr(mr.model_config, "context_len", 0)
                                   or self.req_to_token.shape[1])
        self.num_heads = int(getattr(mr.model_config, "num_attention_heads", 0)) // max(
            int(getattr(mr, "tp_size", 1)), 1)
        args = getattr(mr, "server_args", None)
        self.skip_prefill = skip_prefill
        self.speculative_step_id = speculative_step_id
        self.topk = topk or int(getattr(args, "speculative_eagle_topk", 0) or 0)
        self.speculative_num_steps = speculative_num_steps or int(
            getattr(args, "speculative_num_steps", 0) or 0)
        self.speculative_num_draft_tokens = int(
            getattr(args, "speculative_num_draft_tokens", 0) or 0)
        # sglang's --enable-deterministic-inference: one pass over the keys in every call, so
        # a request's result does not depend on the rest of its batch.
        self.deterministic = bool(getattr(args, "enable_deterministic_inference", False))
        self.num_splits = 1 if self.deterministic else 0
        self.num_kv_splits = 1 if self.deterministic else -1
        # Gemma-3 image blocks of an EXTEND step, set by the model after the metadata (sglang
        # 0.5.23): int32 ids over whole sequences (prefix then new tokens), -1 for text.
        self.bidirectional_block_ids: Optional[Tensor] = None
        self.forward_metadata: Optional[AttentionMetadata] = None
        # (layer_id, b, Hkv, device, inference mode) -> two [b, Hkv] float32, see descales()
        self._descale_buffers: dict[tuple, tuple[Tensor, Tensor]] = {}

    # ----------------------------------------------------------------- plan (host)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build ``self.forward_metadata`` for this batch (host, once for all layers)."""
        self.forward_metadata = self.build_metadata(forward_batch)

    # ----------------------------------------------------------------- run (per layer)

    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs):
        """EXTEND, MIXED, DRAFT_EXTEND_V2 and TARGET_VERIFY (``AttentionBackend.forward``
        routes every mode but DECODE and IDLE here).

        Returns ``[tokens, Hq * Dv]``; the MLA MHA prefill path
        (``forward_batch.attn_attend_prefix_cache is not None``) returns ``(out [tokens, Hq, Dv],
        lse [tokens, Hq] float32)`` when it attends a prefix chunk or ``mha_return_lse``.
        """
        mode = forward_batch.forward_mode
        if (self.use_mla and forward_batch.attn_attend_prefix_cache is not None
                and not mode.is_target_verify() and not is_draft_extend(forward_batch)):
            return mla_attention.mha_prefill(self, q, k, v, layer, forward_batch)
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs) -> Tensor:
        """DECODE (plain or draft step). Returns ``[tokens, Hq * Dv]``."""
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _forward(self, q, k, v, layer, fb: ForwardBatch, save_kv_cache: bool,
                 sinks: Optional[Tensor] = None, **kwargs) -> Tensor:
        meta = self._metadata()
        if kwargs.get("index_q") is not None:
            raise NotImplementedError(f"XPUAttentionBackend: layer {layer.layer_id} passes DSA "
                                      "indexer inputs (index_q); expected a DSAAttentionBackend "
                                      "(compile.backend.dsa_backend), got XPUAttentionBackend.")
        if self.use_mla:
            return mla_attention.forward_absorbed(self, q, k, v, layer, fb, save_kv_cache,
                                                  meta, sinks=sinks, **kwargs)
        if k is not None and save_kv_cache:
            self.save_kv(layer, k, v, meta)
        hq, dv = layer.tp_q_head_num, layer.v_head_dim
        q3 = q.reshape(-1, hq, layer.head_dim)
        out = self.output_buffer(fb, q3, hq, dv)
        call, causal, cascade = self.select_call(meta, layer)
        k_cache, v_cache = self.paged_kv(layer, call.page_size)
        self.attend(q3, k_cache, v_cache, call, layer, out, causal=causal, sinks=sinks,
                    expand=meta.expand if cascade else None,
                    block_ids=self._query_block_ids(fb, meta, call, causal, q3.shape[0]))
        return out.view(-1, hq * dv)

    def _query_block_ids(self, fb: ForwardBatch, meta: AttentionMetadata,
                         call: PagedAttnMetadata, causal: bool, total_q: int
                         ) -> Optional[Tensor]:
        """Gemma-3 image blocks of this call as the op takes them (``[total_q]``, new tokens
        only), or None: only causal EXTEND/MIXED calls over ``meta.main`` or its SWA twin
        carry them (never cross attention, cascades or local virtual batches; a non-causal
        layer sees every key already, and the op makes any call with block ids causal).

        Raises:
            ValueError: ``bidirectional_block_ids`` does not cover the batch's whole sequences.
        """
        ids = self.bidirectional_block_ids
        if ids is None or not causal or not fb.forward_mode.is_extend_or_draft_extend_or_mixed():
            return None
        if call is not meta.main and call is not meta.swa:
            return None
        if fb.seq_lens_sum is not None and ids.shape[0] != fb.seq_lens_sum:
            raise ValueError(
                f"XPUAttentionBackend: bidirectional_block_ids has {ids.shape[0]} entries; "
                f"expected one per token of the batch's whole sequences (sum(seq_lens) = "
                f"{fb.seq_lens_sum}), got {ids.shape[0]}. Build it with "
                f"xpu_ops.build_bidirectional_block_ids(seq_lens, spans).")
        return query_block_ids(ids, meta.main, total_q)

    def _metadata(self) -> AttentionMetadata:
        if self.forward_metadata is None:
            raise RuntimeError("XPUAttentionBackend.forward: no metadata; expected "
                               "init_forward_metadata(forward_batch) before the model runs, "
                               "got None.")
        return self.forward_metadata

    def paged_kv(self, layer, page_size: int) -> tuple[Tensor, Tensor]:
        """K/V cache of ``layer`` viewed ``[num_pages, page_size, Hkv, D]``: the pool's buffers
        of ``layer.kv_cache_layer_id`` (for hybrid SWA pools, of the pool that holds it)."""
        return self.token_to_kv_pool.get_paged_kv(layer.kv_cache_layer_id, page_size)

    def is_swa_layer(self, layer) -> bool:
        """Whether ``layer``'s KV lives in the sliding-window pool of a hybrid SWA pool (the
        pool's look-up by ``layer.layer_id``). Only asked when the pool is hybrid (``meta.swa``
        or ``meta.write.swa_loc`` set)."""
        return self.token_to_kv_pool.is_swa_layer(layer.layer_id)

    def save_kv(self, layer, k: Tensor, v: Tensor, meta: AttentionMetadata) -> None:
        """Write this batch's new K/V of ``layer`` through the pool's ``set_kv_buffer`` (one
        ``store_kv_cache`` call; SWA layers into the SWA pool at ``meta.write.swa_loc``)."""
        pool = self.token_to_kv_pool
        if layer.is_cross_attention:
            pool.set_kv_buffer(layer, meta.write.encoder_loc, k, v, layer.k_scale, layer.v_scale)
        elif meta.write.swa_loc is not None and pool.is_swa_layer(layer.layer_id):
            pool.set_kv_buffer(layer, meta.write.swa_loc, k, v, layer.k_scale, layer.v_scale,
                               loc_is_swa=True)
        else:
            pool.set_kv_buffer(layer, meta.write.loc, k, v, layer.k_scale, layer.v_scale)

    def output_buffer(self, fb: ForwardBatch, q3: Tensor, hq: int, dv: int) -> Tensor:
        """``forward_batch._attn_output`` viewed ``[tokens, Hq, Dv]``, or a new tensor."""
        out = getattr(fb, "_attn_output", None)
        if out is None:
            return q3.new_empty((q3.shape[0], hq, dv))
        return out.view(q3.shape[0], hq, dv)

    def select_call(self, meta: AttentionMetadata, layer
                    ) -> tuple[PagedAttnMetadata, bool, bool]:
        """``(call, causal, cascade)`` of ``layer`` in this batch (never causal for a
        non-causal ``layer.attn_type``).

        Raises:
            NotImplementedError: a layer kind this mode cannot serve, naming both.
        """
        windowed = layer.sliding_window_size >= 0
        if layer.is_cross_attention:
            if meta.encoder is None:
                raise NotImplementedError("XPUAttentionBackend: a cross-attention layer in a "
                                          "batch without encoder_lens is not supported.")
            return meta.encoder, False, False
        call, causal, cascade = self._select_self_call(meta, layer, windowed)
        return call, causal and is_causal(layer), cascade

    def _select_self_call(self, meta: AttentionMetadata, layer, windowed: bool
                          ) -> tuple[PagedAttnMetadata, bool, bool]:
        if meta.cascade:
            if windowed and meta.swa_spec is not None:
                return meta.swa_spec, True, False
            if layer.use_irope and meta.local_spec is not None:
                return meta.local_spec, True, False
            if windowed:
                raise NotImplementedError(
                    "XPUAttentionBackend: a sliding-window layer with speculative topk > 1 "
                    "needs the model runner's sliding_window_size set (the per-draft rows are "
                    "built only then); got none.")
            return meta.main, meta.causal, True
        if layer.use_irope and meta.local is not None:
            return meta.local, True, False
        if meta.swa is not None and self.is_swa_layer(layer):
            return meta.swa, meta.causal, False
        return meta.main, meta.causal, False

    def descales(self, layer, cache: Tensor, batch: int):
        """``(k_descale, v_descale)`` ``[batch, Hkv]`` float32 for fp8 caches (None otherwise).

        Eager calls refill two buffers kept per (layer, batch) with one broadcasting ``copy_``
        each, so the values always follow ``layer.k_scale``/``v_scale`` (also in a captured
        graph, which replays the copies); traced calls build them from the scales.
        """
        if cache.dtype not in FP8_DTYPES:  # first: reading a module buffer costs ~1 us
            return None, None
        k_scale = layer.k_scale
        if k_scale is None:
            return None, None
        hkv, v_scale = layer.tp_k_head_num, layer.v_scale
        if torch.compiler.is_compiling():
            return (k_scale.float().view(1, 1).expand(batch, hkv).contiguous(),
                    v_scale.float().view(1, 1).expand(batch, hkv).contiguous())
        key = (layer.layer_id, batch, hkv, k_scale.device, torch.is_inference_mode_enabled())
        bufs = self._descale_buffers.get(key)
        if bufs is None:
            bufs = tuple(torch.empty((batch, hkv), dtype=torch.float32, device=k_scale.device)
                         for _ in range(2))
            self._descale_buffers[key] = bufs
        return bufs[0].copy_(k_scale), bufs[1].copy_(v_scale)

    def attend(self, q3: Tensor, k_cache: Tensor, v_cache: Tensor, call: PagedAttnMetadata,
               layer, out: Tensor, *, causal: bool, sinks: Optional[Tensor] = None,
               expand: Optional[PagedAttnMetadata] = None, qv: Optional[Tensor] = None,
               block_ids: Optional[Tensor] = None) -> None:
        """One paged call into ``out``, or a cascade (``expand`` given) merged into ``out``;
        ``block_ids`` (``[total_q]``, no cascade): Gemma-3 image blocks inside the causal pass.
        Every call passes ``num_splits`` (1 under deterministic inference)."""
        w = layer.sliding_window_size
        windowed = w >= 0 and not layer.is_cross_attention
        k_descale, v_descale = self.descales(layer, k_cache, call.batch_size)
        scale, cap = layer.scaling, layer.logit_cap
        if (expand is None and qv is None and sinks is None and block_ids is None
                and k_descale is None and type(scale) is float and type(cap) is float
                and type(w) is int and w >= -1 and type(call.max_seqlen_q) is int
                and not torch.compiler.is_compiling()
                and not debug_checks_enabled()):
            # The plain eager call (every layer of a plain model, piecewise attention): the op
            # itself, positional, with what the wrapper would pass (window (w, 0) or unbounded,
            # right bound 0 when causal; no LSE). Traced calls and calls under the debug switch
            # (its value checks live in the wrapper) take the wrapper below.
            torch.ops.xpu_ops.flash_attn_with_kvcache.default(
                q3, k_cache, v_cache, call.cache_seqlens, call.page_table, call.cu_seqlens_q,
                out, None, None, None, None, None, None, None, call.max_seqlen_q, scale,
                bool(causal), w if windowed else -1, 0 if causal or windowed else -1, cap,
                self.num_splits, False)
            return
        window = (w, 0) if windowed else (-1, -1)
        kw = dict(softmax_scale=scale, softcap=cap, window_size=window,
                  num_splits=self.num_splits)
        if expand is None:
            xpu_ops.flash_attn_with_kvcache(
                q3, k_cache, v_cache, qv=qv, causal=causal, sinks=sinks, out=out,
                cache_seqlens=call.cache_seqlens, page_table=call.page_table,
                cu_seqlens_q=call.cu_seqlens_q, max_seqlen_q=call.max_seqlen_q,
                k_descale=k_descale, v_descale=v_descale, bidirectional_block_ids=block_ids,
                **kw)
            return
        args = dict(cache_seqlens=call.cache_seqlens, page_table=call.page_table,
                    cu_seqlens_q=call.cu_seqlens_q, max_seqlen_q=call.max_seqlen_q,
                    k_descale=k_descale, v_descale=v_descale)
        # Cascade: prefix pass (sinks counted once, here) + expand pass, merged by LSE.
        o_a, lse_a = xpu_ops.flash_attn_with_kvcache(q3, k_cache, v_cache, qv=qv, causal=False,
                                                     sinks=sinks, return_softmax_lse=True,
                                                     **args, **kw)
        k1 = k_cache.view(-1, 1, *k_cache.shape[2:])
        v1 = v_cache.view(-1, 1, *v_cache.shape[2:])
        kd, vd = self.descales(layer, k_cache, expand.batch_size)
        o_b, lse_b = xpu_ops.flash_attn_with_kvcache(
            q3, k1, v1, qv=qv, causal=False, return_softmax_lse=True,
            cache_seqlens=expand.cache_seqlens, page_table=expand.page_table,
            cu_seqlens_q=expand.cu_seqlens_q, max_seqlen_q=1, k_descale=kd, v_descale=vd, **kw)
        xpu_ops.merge_state_v2(o_a, lse_a.transpose(0, 1).contiguous(), o_b,
                               lse_b.transpose(0, 1).contiguous(), v_merged=out)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """``seq_lens`` value of padded graph rows (sglang: 1, so no request is empty)."""
        return 1

    def get_cpu_graph_seq_len_fill_value(self) -> int:
        """The same for sglang's CPU graph runner (which asks this name on a CPU)."""
        return 1

    # ----------------------------------------------------------------- declarations

    def shared_read_ends(self, fm: ForwardMode) -> SharedReadEnds:
        """PRE_REPLAY for the graph-captured modes (DECODE, TARGET_VERIFY, IDLE): under
        sglang's runners (``init_forward_metadata_out_graph``, always host-filled) every read of
        ``req_to_token``, ``seq_lens`` and the spec input happens on the host in the metadata
        prep, and a replay reads only the runner's step buffers and this backend's metadata
        copies. (This project's ``GraphRunner`` computes plain decode metadata inside its graph,
        so those replays read ``req_to_token`` too; it asks no declaration: the engine's next
        writes follow the replay on the same stream.) UNKNOWN for the eager modes, whose layers
        read ``out_cache_loc`` and the MLA prefix-chunk tensors of the batch itself."""
        if fm.is_cuda_graph():
            return SharedReadEnds.PRE_REPLAY
        return SharedReadEnds.UNKNOWN

    def glue_target_verify_metadata(self) -> str:
        """Why target-verify metadata cannot go into sglang's glue graph: it is built on the
        host (``seq_lens_cpu`` bounds the page-table gather)."""
        return ("XPUAttentionBackend builds target-verify metadata on the host from seq_lens_cpu; "
                "it has no in-graph metadata prep")

    def glue_draft_metadata(self) -> str:
        """Why draft metadata cannot go into sglang's glue graph (host-built, as above)."""
        return ("XPUAttentionBackend builds draft metadata on the host from seq_lens_cpu; it has "
                "no in-graph metadata prep")


__all__ = ["XPUAttentionBackend"]
