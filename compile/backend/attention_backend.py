"""``XPUAttentionBackend``: sglang's attention-backend interface over the ``xpu_ops`` operators.

Plan/run split (as FlashInfer): ``init_forward_metadata(forward_batch)`` runs on the host once
per batch and builds ``AttentionMetadata`` (see ``compile.backend.attention_metadata`` for the metadata
of every mode); ``forward`` runs per layer, inside compiled or captured code, and only launches
ops: ``store_kv_cache`` for the new K/V, ``flash_attn_with_kvcache`` (``flash_mla_decode`` for
MLA decode, ``flash_attn_varlen_func`` for MLA's MHA prefill), and ``merge_state_v2`` for the
cascade passes of speculative trees.

Per mode (``main`` call; ``b`` requests):

- DECODE: 1 query/request, ``cache_seqlens = seq_lens``. With ``spec_info`` (a draft step):
  topk 1 adds ``speculative_step_id + 1``; topk > 1 is a cascade (prefix pass, non-causal, plus
  each branch's own draft slots).
- EXTEND / MIXED / DRAFT_EXTEND_V2 (and EXTEND with a draft input): ``extend_seq_lens`` causal
  queries over ``seq_lens`` keys.
- TARGET_VERIFY: D queries; topk 1: causal over ``seq_lens + D``; topk > 1: cascade with the
  tree mask (sliding-window layers: one merged row per draft).
- IDLE: empty output.

Layers pick their variant: sliding-window layers (``window_size = (W - 1, 0)``, SWA-pool table on
hybrid pools), chunked-local layers (virtual batches), cross attention (encoder keys), MLA.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import xpu_ops

from compile.backend import mla_attention, spec_metadata
from compile.backend.base_backend import AttentionBackend, SharedReadEnds
from compile.backend.attention_metadata import (AttentionMetadata, PagedAttnMetadata, cu_seqlens,
                                                paged_metadata, swa_metadata, uniform_cu_seqlens)
from compile.backend.backend_graph import GraphMetadataMixin
from compile.backend.local_attention import (local_chunks_per_request,
                                             make_local_attention_virtual_batches)
from compile.batch import (ForwardBatch, ForwardMode, KVWriteLoc, MHATokenToKVPool,
                           MLATokenToKVPool)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

class XPUAttentionBackend(GraphMetadataMixin, AttentionBackend):
    """Attention backend for every sglang forward mode on XPU, CUDA and CPU.

    It subclasses ``AttentionBackend`` (sglang 0.5.23's interface, ``base_backend.py``): every
    flag and hook sglang's runners read exists with sglang's meaning; the overrides below say
    where this backend's answer differs.

    Args:
        model_runner: sglang ``ModelRunner`` or ``compile.engine.model_runner.ModelRunnerInfo``
            (duck-typed: ``model_config``, ``tp_size``, ``device``, ``page_size``,
            ``req_to_token_pool``, ``token_to_kv_pool``, ``kv_cache_dtype``, ``server_args``,
            ``sliding_window_size``, ``attention_chunk_size``, ``is_hybrid_swa``).
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
        self.forward_metadata: Optional[AttentionMetadata] = None
        # (layer_id, b, Hkv, device, inference mode) -> two [b, Hkv] float32, see descales()
        self._descale_buffers: dict[tuple, tuple[Tensor, Tensor]] = {}

    # ----------------------------------------------------------------- plan (host)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build ``self.forward_metadata`` for this batch (host, once for all layers)."""
        self.forward_metadata = self.build_metadata(forward_batch)

    def _topk(self, fb: ForwardBatch) -> int:
        spec_topk = getattr(fb.spec_info, "topk", 0) if fb.spec_info is not None else 0
        return max(self.topk or spec_topk or 1, 1)

    def _num_steps(self, fb: ForwardBatch) -> int:
        return max(self.speculative_num_steps or getattr(fb.spec_info, "spec_steps", 0) or 1, 1)

    def build_metadata(self, fb: ForwardBatch, graph: bool = False) -> AttentionMetadata:
        """Metadata of ``fb`` (``graph=True`` pads local virtual batches to a fixed count)."""
        mode = fb.forward_mode
        if fb.encoder_lens is not None and not (
                mode.is_decode() or mode.is_extend(include_draft_extend_v2=True)):
            raise NotImplementedError(f"XPUAttentionBackend: encoder-decoder batches in mode "
                                      f"{mode.name} are not supported.")
        plain = False  # main's lengths are the batch's own (host copies in fb)
        if mode.is_idle():
            meta = self._idle_metadata()
        elif mode.is_target_verify():
            meta = self._verify_metadata(fb)
        elif mode.is_decode() and fb.spec_info is not None:
            meta = self._draft_decode_metadata(fb)
        else:
            meta, plain = self._decode_or_extend_metadata(fb), True
        self._add_layer_variants(fb, meta, graph, plain)
        return meta

    def _idle_metadata(self) -> AttentionMetadata:
        z = torch.zeros(0, dtype=torch.int32, device=self.device)
        main = PagedAttnMetadata(cu_seqlens_q=torch.zeros(1, dtype=torch.int32,
                                                          device=self.device),
                                 cache_seqlens=z, page_table=z.view(0, 0), max_seqlen_q=0,
                                 max_seqlen_k=0, page_size=self.page_size)
        return AttentionMetadata(main=main, write=KVWriteLoc(
            loc=torch.zeros(0, dtype=torch.int64, device=self.device)))

    def _decode_or_extend_metadata(self, fb: ForwardBatch) -> AttentionMetadata:
        """DECODE (1 query/request) or EXTEND/MIXED/DRAFT_EXTEND_V2 (``extend_seq_lens``)."""
        b = fb.batch_size
        if fb.forward_mode.is_decode():
            cu_q, max_q = uniform_cu_seqlens(b, 1, self.device), 1
        else:
            cu_q = cu_seqlens(fb.extend_seq_lens.to(torch.int32))
            max_q = max(fb.extend_seq_lens_cpu) if b else 0
        max_k = int(fb.seq_lens_cpu.max()) if b else 0
        main = paged_metadata(self.req_to_token, fb.req_pool_indices, cu_q, fb.seq_lens, max_q,
                              max_k, self.page_size, col_offset=self._decoder_offset(fb))
        return AttentionMetadata(main=main, write=KVWriteLoc(loc=fb.out_cache_loc))

    def _decoder_offset(self, fb: ForwardBatch) -> Optional[Tensor]:
        """Encoder-decoder: decoder tokens follow the ``encoder_lens[r]`` encoder tokens."""
        if fb.encoder_lens is None:
            return None
        if any(n % self.page_size for n in fb.encoder_lens_cpu):
            raise NotImplementedError(
                f"XPUAttentionBackend: encoder lengths {fb.encoder_lens_cpu} that are not "
                f"multiples of page_size {self.page_size} are not supported; pad the encoder "
                f"tokens to whole pages.")
        return fb.encoder_lens

    def _verify_metadata(self, fb: ForwardBatch) -> AttentionMetadata:
        """TARGET_VERIFY: chain (topk 1) or tree cascade (topk > 1)."""
        d = fb.spec_info.draft_token_num or self.speculative_num_draft_tokens
        write = KVWriteLoc(loc=fb.out_cache_loc)
        if self._topk(fb) <= 1:
            main = spec_metadata.verify_chain(fb, self.req_to_token, self.page_size, d)
            return AttentionMetadata(main=main, write=write)
        prefix, expand, mask = spec_metadata.verify_tree(fb, self.req_to_token, self.page_size, d)
        swa_spec = None
        if self.sliding_window_size is not None or self.is_hybrid_swa:
            swa_spec = spec_metadata.verify_tree_swa(fb, self.token_to_kv_pool,
                                                     self.req_to_token, mask, d)
        return AttentionMetadata(main=prefix, write=write, causal=False, cascade=True,
                                 expand=expand, swa_spec=swa_spec)

    def _draft_decode_metadata(self, fb: ForwardBatch) -> AttentionMetadata:
        """DECODE with ``spec_info``: draft step ``speculative_step_id``."""
        topk, steps, step = self._topk(fb), self._num_steps(fb), self.speculative_step_id
        rows = fb.batch_size * topk
        write = KVWriteLoc(loc=spec_metadata.draft_write_loc(fb.out_cache_loc, rows, steps, step))
        if topk <= 1:
            main = spec_metadata.draft_decode_chain(fb, self.req_to_token, self.page_size, step)
            return AttentionMetadata(main=main, write=write)
        prefix, expand = spec_metadata.draft_decode_tree(fb, self.req_to_token, self.page_size,
                                                         topk, step, steps)
        swa_spec = None
        if self.sliding_window_size is not None or self.is_hybrid_swa:
            swa_spec = spec_metadata.draft_decode_tree_swa(fb, self.token_to_kv_pool,
                                                           self.req_to_token, topk, step, steps)
        return AttentionMetadata(main=prefix, write=write, causal=False, cascade=True,
                                 expand=expand, swa_spec=swa_spec)

    def _add_layer_variants(self, fb: ForwardBatch, meta: AttentionMetadata, graph: bool,
                            plain: bool = False) -> None:
        """SWA tables, local virtual batches, encoder metadata and the MLA workspace
        (``plain``: ``meta`` is ``_decode_or_extend_metadata``'s, its lengths are on the host)."""
        pool, main = self.token_to_kv_pool, meta.main
        offset = None if fb.encoder_lens is None else fb.encoder_lens
        if hasattr(pool, "translate_loc_from_full_to_swa"):
            meta.swa = swa_metadata(pool, self.req_to_token, fb.req_pool_indices, main, offset)
            meta.write.swa_loc = pool.translate_loc_from_full_to_swa(meta.write.loc)
        if self.attention_chunk_size and not meta.cascade and main.batch_size:
            meta.local = self._local_metadata(main, graph, fb if plain else None)
        if fb.encoder_lens is not None:
            meta.encoder = self._encoder_metadata(fb, main)
            meta.write.encoder_loc = fb.encoder_out_cache_loc
        if self.use_mla and fb.forward_mode.is_decode() and fb.spec_info is None:
            heads = self.num_heads or 128
            size = xpu_ops.flash_mla_get_workspace_size(
                self.max_context_len if graph else main.max_seqlen_k, main.batch_size, heads)
            meta.mla_workspace = torch.empty(size, dtype=torch.uint8, device=self.device)

    def _local_metadata(self, main: PagedAttnMetadata, graph: bool,
                        fb: Optional[ForwardBatch] = None) -> PagedAttnMetadata:
        """Chunked-local virtual batch of ``main``; its lengths come from ``fb``'s host copies
        when given (DECODE/EXTEND: ``main`` is built from them), else from the device (a sync)."""
        chunk = int(self.attention_chunk_size)
        pad_to = None
        if graph:
            pad_to = main.batch_size * local_chunks_per_request(main.max_seqlen_q, chunk)
        if fb is None:
            cu_q, k_lens = main.cu_seqlens_q.cpu(), main.cache_seqlens.cpu()
        elif fb.forward_mode.is_decode():
            cu_q, k_lens = uniform_cu_seqlens(fb.batch_size, 1, "cpu"), fb.seq_lens_cpu
        else:
            q_lens = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int32)
            cu_q, k_lens = cu_seqlens(q_lens), fb.seq_lens_cpu
        local = make_local_attention_virtual_batches(chunk, cu_q, k_lens, main.page_table,
                                                     self.page_size, pad_to=pad_to)
        max_q = main.max_seqlen_q if graph else local.max_seqlen_q
        return PagedAttnMetadata(cu_seqlens_q=local.cu_seqlens_q,
                                 cache_seqlens=local.cache_seqlens, page_table=local.page_table,
                                 max_seqlen_q=max_q, max_seqlen_k=chunk,
                                 page_size=self.page_size)

    def _encoder_metadata(self, fb: ForwardBatch, main: PagedAttnMetadata) -> PagedAttnMetadata:
        """Cross attention: ``main``'s queries over the encoder tokens (req_to_token columns
        ``0 .. encoder_lens[r] - 1``), non-causal."""
        max_enc = max(fb.encoder_lens_cpu) if fb.encoder_lens_cpu else 0
        return paged_metadata(self.req_to_token, fb.req_pool_indices, main.cu_seqlens_q,
                              fb.encoder_lens, main.max_seqlen_q, max_enc, self.page_size)

    # ----------------------------------------------------------------- run (per layer)

    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs):
        """EXTEND, MIXED, DRAFT_EXTEND_V2 and TARGET_VERIFY (``AttentionBackend.forward``
        routes every mode but DECODE and IDLE here).

        Returns ``[tokens, Hq * Dv]``; the MLA MHA prefill path
        (``forward_batch.attn_attend_prefix_cache is not None``) returns ``(out [tokens, Hq, Dv],
        lse [Hq, tokens] float32)`` when it attends a prefix chunk or ``mha_return_lse``.
        """
        mode = forward_batch.forward_mode
        if (self.use_mla and forward_batch.attn_attend_prefix_cache is not None
                and not mode.is_target_verify() and not forward_batch.is_draft_extend()):
            return mla_attention.mha_prefill(self, q, k, v, layer, forward_batch)
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs) -> Tensor:
        """DECODE (plain or draft step). Returns ``[tokens, Hq * Dv]``."""
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _forward(self, q, k, v, layer, fb: ForwardBatch, save_kv_cache: bool,
                 sinks: Optional[Tensor] = None, **kwargs) -> Tensor:
        meta = self._metadata()
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
                    expand=meta.expand if cascade else None)
        return out.view(-1, hq * dv)

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
        """``(call, causal, cascade)`` of ``layer`` in this batch.

        Raises:
            NotImplementedError: a layer kind this mode cannot serve, naming both.
        """
        windowed = layer.sliding_window_size >= 0
        if layer.is_cross_attention:
            if meta.encoder is None:
                raise NotImplementedError("XPUAttentionBackend: a cross-attention layer in a "
                                          "batch without encoder_lens is not supported.")
            return meta.encoder, False, False
        if meta.cascade:
            if windowed and meta.swa_spec is not None:
                return meta.swa_spec, True, False
            if windowed or (layer.use_irope and self.attention_chunk_size):
                raise NotImplementedError(
                    "XPUAttentionBackend: sliding-window or chunked-local layers with "
                    "speculative topk > 1 are not supported (sliding-window layers need the "
                    "model runner's sliding_window_size set; chunked-local layers are not "
                    "supported).")
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
               expand: Optional[PagedAttnMetadata] = None, qv: Optional[Tensor] = None
               ) -> None:
        """One paged call into ``out``, or a cascade (``expand`` given) merged into ``out``."""
        w = layer.sliding_window_size
        window = (w, 0) if w >= 0 and not layer.is_cross_attention else (-1, -1)
        k_descale, v_descale = self.descales(layer, k_cache, call.batch_size)
        if expand is None:
            xpu_ops.flash_attn_with_kvcache(
                q3, k_cache, v_cache, qv=qv, causal=causal, sinks=sinks, out=out,
                cache_seqlens=call.cache_seqlens, page_table=call.page_table,
                cu_seqlens_q=call.cu_seqlens_q, max_seqlen_q=call.max_seqlen_q,
                k_descale=k_descale, v_descale=v_descale, softmax_scale=layer.scaling,
                softcap=layer.logit_cap, window_size=window)
            return
        kw = dict(softmax_scale=layer.scaling, softcap=layer.logit_cap, window_size=window)
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
        """PRE_REPLAY for the graph-captured modes (DECODE, TARGET_VERIFY, IDLE): every read of
        ``req_to_token``, ``seq_lens`` and the spec input happens on the host in the metadata
        prep, and a replay reads only the runner's step buffers and this backend's metadata
        copies. UNKNOWN for the eager modes, whose layers read ``out_cache_loc`` and the MLA
        prefix-chunk tensors of the batch itself."""
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
