"""``DCPAttentionBackend``: decode context parallelism, the KV cache split by token over ranks.

Layout (vLLM's and sglang 0.5.23's interleaved rule, ``t % dcp_size``). With ``n = dcp_size``
ranks and a physical page size ``page_size``, the engine allocates *virtual* pages of
``page_size * n`` tokens (``req_to_token`` holds virtual slots ``s = page * page_size * n +
t % (page_size * n)``, the same on every rank). Token ``t`` of a request lives on rank
``t % n`` only, in local slot ``page * page_size + (t % (page_size * n)) // n`` of that rank's
pool, which has ``page_size``-token pages. So a rank's local tokens of one request are the
request's tokens ``r, r + n, r + 2n, ...``, in order, paged by the same page ids: the page table
is the virtual one, and the local cache length is ``ceil((L - r) / n)``. Every rank stores
``1 / n`` of every request's KV, so at equal memory per device the servable context is ``n``
times longer.

Per layer and step (every rank holds the whole batch's queries and new K/V; weights are
replicated over the DCP group, or split by the orthogonal TP group):

1. Store: each rank writes only the new tokens it owns (``store_kv_cache`` of those rows).
2. Shard pass: ``flash_attn_with_kvcache(..., return_softmax_lse=True)`` of every query over this
   rank's shard of the keys it may see: the whole shard in decode (the query is the last
   token), the shard of the cached prefix in extend. Non-causal: every such key is visible.
3. Merge: one all-gather of ``(out, lse)`` packed in float32, then ``merge_state_v2`` over the
   ranks' states (an empty shard is ``(0, -inf)`` and contributes nothing).
4. Extend only: causal attention of the step's own tokens (``flash_attn_varlen_func`` with LSE,
   identical on every rank), merged with the result of 3.

Sinks count once: in the rank-0 shard pass in decode, in the new-token pass in extend. Exact
against one rank up to floating-point summation order.

Serves DECODE (no speculative ``spec_info``) and EXTEND/MIXED over an ``MHATokenToKVPool``; other
modes and layer kinds (sliding window, chunked local, cross attention, MLA) raise
``NotImplementedError``. The write rows are chosen on the host (a data-dependent count), so
steps run eagerly or compiled, not captured as device graphs.

Source: sglang 0.5.23 DCP for Intel GPUs (shard attention with LSE, ``merge_state_v2``); vLLM
``dcp_size`` interleaving; FlashAttention's LSE merge (arXiv 2205.14135, section 3.1).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

import xpu_ops

from compile.backend.attention_metadata import cu_seqlens, paged_metadata, uniform_cu_seqlens
from compile.backend.parallel_state import ParallelGroup, all_gather
from compile.batch import ForwardBatch, MHATokenToKVPool


@dataclasses.dataclass
class DCPMetadata:
    """One step's DCP metadata (this rank's view).

    Attributes:
        cu_seqlens_q: [b + 1] int32. max_seqlen_q: longest query run (int).
        page_table: [b, max_pages] int32 virtual page ids (equal on every rank).
        shard_seqlens: [b] int32 keys of this rank's shard the shard pass attends.
        write_rows: [n] int64 rows of the step's K/V this rank stores.
        write_loc: [n] int64 their slots in this rank's pool.
        extend: True when the step's own tokens are attended in a separate causal pass.
    """

    cu_seqlens_q: Tensor
    max_seqlen_q: int
    page_table: Tensor
    shard_seqlens: Tensor
    write_rows: Tensor
    write_loc: Tensor
    extend: bool


def shard_lengths(lengths: Tensor, dcp: ParallelGroup) -> Tensor:
    """Tokens ``t < L`` with ``t % size == rank`` for each length ``L`` ([b] -> [b] int32).

    >>> lens = torch.tensor([0, 1, 4, 5])
    >>> [shard_lengths(lens, ParallelGroup(r, 2, group=object())).tolist() for r in (0, 1)]
    [[0, 1, 2, 3], [0, 0, 2, 2]]
    """
    return ((lengths.to(torch.int32) - dcp.rank + dcp.size - 1) // dcp.size).clamp_(min=0)


def local_slots(virtual: Tensor, page_size: int, dcp: ParallelGroup) -> tuple[Tensor, Tensor]:
    """``(owned [N] bool, local slot [N] int64)`` of virtual slots (see the module docstring):
    owned where ``virtual % size == rank``; the local slot is meaningful only there.

    >>> virtual = torch.arange(8, 16)          # virtual page 2 of 4 tokens: page_size 2, 2 ranks
    >>> owned, local = local_slots(virtual, 2, ParallelGroup(1, 2, group=object()))
    >>> virtual[owned].tolist(), local[owned].tolist()   # tokens 1, 3 of pages 2, 3 on rank 1
    ([9, 11, 13, 15], [4, 5, 6, 7])
    """
    vps = page_size * dcp.size
    local = (virtual // vps) * page_size + (virtual % vps) // dcp.size
    return virtual % dcp.size == dcp.rank, local


class DCPAttentionBackend:
    """sglang's attention-backend interface with the KV cache split by token over ``dcp``.

    Args:
        model_runner: as ``XPUAttentionBackend``'s, plus ``dcp_group`` (a ``ParallelGroup``);
            its ``page_size`` is the virtual page size ``pool.page_size * dcp_group.size``.
            ``server_args.enable_deterministic_inference`` pins ``num_splits=1`` in every
            paged call (the merge over ranks is in rank order either way).
    Raises:
        ValueError: a page size that is not the pool's times the group size.
        NotImplementedError: a pool other than ``MHATokenToKVPool``, or an fp8 KV cache.
    """

    def __init__(self, model_runner):
        mr = model_runner
        self.dcp: ParallelGroup = mr.dcp_group
        self.pool = mr.token_to_kv_pool
        self.req_to_token = mr.req_to_token_pool.req_to_token
        self.device = torch.device(mr.device)
        self.page_size = int(mr.page_size)   # virtual: pool.page_size * dcp.size
        if type(self.pool) is not MHATokenToKVPool:
            raise NotImplementedError(f"DCPAttentionBackend: the KV pool is a "
                                      f"{type(self.pool).__name__}; expected an "
                                      "MHATokenToKVPool (hybrid SWA and MLA pools are not "
                                      "supported with --dcp).")
        if self.pool.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise NotImplementedError(f"DCPAttentionBackend: KV cache dtype {self.pool.dtype} "
                                      "is not supported; expected a float16, bfloat16 or "
                                      "float32 cache with --dcp.")
        if self.page_size != self.pool.page_size * self.dcp.size:
            raise ValueError(f"DCPAttentionBackend: model_runner.page_size is not the virtual "
                             f"page size; expected pool.page_size * dcp_size = "
                             f"{self.pool.page_size * self.dcp.size}, got {self.page_size}.")
        self.forward_metadata: Optional[DCPMetadata] = None
        args = getattr(mr, "server_args", None)
        self.deterministic = bool(getattr(args, "enable_deterministic_inference", False))
        self.num_splits = 1 if self.deterministic else 0

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Build ``self.forward_metadata`` for ``fb`` (host, once per step)."""
        mode = fb.forward_mode
        if fb.spec_info is not None or not (
                mode.is_decode() or mode.is_extend(include_draft_extend_v2=True)):
            raise NotImplementedError(f"DCPAttentionBackend: forward mode {mode.name} is not "
                                      "supported; expected DECODE or EXTEND/MIXED without "
                                      "speculative decoding.")
        b, extend = fb.batch_size, not mode.is_decode()
        if extend:
            q_lens = fb.extend_seq_lens.to(torch.int32)
            cu_q, max_q = cu_seqlens(q_lens), max(fb.extend_seq_lens_cpu, default=0)
            seen = fb.seq_lens.to(torch.int32) - q_lens   # the cached prefix
        else:
            cu_q, max_q, seen = uniform_cu_seqlens(b, 1, self.device), 1, fb.seq_lens
        max_k = int(fb.seq_lens_cpu.max()) if b else 0
        table = paged_metadata(self.req_to_token, fb.req_pool_indices, cu_q, fb.seq_lens, max_q,
                               max_k, self.page_size).page_table
        owned, local = local_slots(fb.out_cache_loc, self.pool.page_size, self.dcp)
        rows = owned.nonzero().squeeze(1)
        self.forward_metadata = DCPMetadata(
            cu_seqlens_q=cu_q, max_seqlen_q=max_q, page_table=table,
            shard_seqlens=shard_lengths(seen, self.dcp), write_rows=rows,
            write_loc=local.index_select(0, rows), extend=extend)

    def forward(self, q: Tensor, k: Optional[Tensor], v: Optional[Tensor], layer,
                forward_batch: ForwardBatch, save_kv_cache: bool = True,
                sinks: Optional[Tensor] = None) -> Tensor:
        """Attention of ``q [T, Hq * D]`` after storing this rank's share of ``k``/``v``
        (``[T, Hkv, D]``/``[T, Hkv, Dv]``); returns ``[T, Hq * Dv]``, equal on every rank."""
        meta = self._metadata(layer)
        hq, d, dv = layer.tp_q_head_num, layer.head_dim, layer.v_head_dim
        q3 = q.reshape(-1, hq, d)
        if k is not None and save_kv_cache:
            self.pool.set_kv_buffer(layer, meta.write_loc, k.index_select(0, meta.write_rows),
                                    v.index_select(0, meta.write_rows), layer.k_scale,
                                    layer.v_scale)
        k_cache, v_cache = self.pool.get_paged_kv(layer.kv_cache_layer_id)
        shard_sinks = sinks if (self.dcp.rank == 0 and not meta.extend) else None
        o, lse = xpu_ops.flash_attn_with_kvcache(
            q3, k_cache, v_cache, cache_seqlens=meta.shard_seqlens, page_table=meta.page_table,
            cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q, causal=False,
            softmax_scale=layer.scaling, softcap=layer.logit_cap, sinks=shard_sinks,
            return_softmax_lse=True, num_splits=self.num_splits)
        out = _output(forward_batch, q3, hq, dv)
        if not meta.extend:
            merge_over_ranks(o, lse, self.dcp, out=out)
            return out.view(-1, hq * dv)
        o_prefix, lse_prefix = merge_over_ranks(o, lse, self.dcp)
        o_new, lse_new = xpu_ops.flash_attn_varlen_func(
            q3, k.reshape(-1, layer.tp_k_head_num, d), v.reshape(-1, layer.tp_v_head_num, dv),
            meta.cu_seqlens_q, meta.cu_seqlens_q, meta.max_seqlen_q, meta.max_seqlen_q,
            causal=True, softmax_scale=layer.scaling, softcap=layer.logit_cap, sinks=sinks,
            return_softmax_lse=True)
        xpu_ops.merge_state_v2(o_prefix, lse_prefix, o_new, lse_new.t().contiguous(),
                               v_merged=out)
        return out.view(-1, hq * dv)

    def _metadata(self, layer) -> DCPMetadata:
        if self.forward_metadata is None:
            raise RuntimeError("DCPAttentionBackend.forward: no metadata; expected "
                               "init_forward_metadata(forward_batch) before the model runs, "
                               "got None.")
        if (layer.sliding_window_size >= 0 or layer.is_cross_attention or layer.use_irope):
            raise NotImplementedError(f"DCPAttentionBackend: layer {layer.layer_id} is a "
                                      "sliding-window, cross or chunked-local attention layer; "
                                      "expected full causal self-attention with --dcp.")
        return self.forward_metadata

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """``seq_lens`` value of padded graph rows (sglang: 1)."""
        return 1


def merge_over_ranks(o: Tensor, lse: Tensor, dcp: ParallelGroup,
                     out: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The attention state over all ranks' key shards from each rank's partial state.

    Args:
        o: [T, H, Dv] this rank's output over its shard. lse: [H, T] float32 its LSE
            (``flash_attn_with_kvcache``'s layout). dcp: the group. out: optional
            ``[T, H, Dv]`` result buffer (o's dtype).
    Returns:
        ``(o [T, H, Dv], lse [T, H] float32)``, equal on every rank: one all-gather of
        ``(o, lse)`` packed as float32 ``[T, H, Dv + 1]``, then ``size - 1`` ``merge_state_v2``
        calls in rank order.
    """
    t, h, dv = o.shape
    packed = torch.cat([o.float(), lse.t().unsqueeze(-1)], dim=-1)       # [T, H, Dv + 1]
    states = all_gather(packed.unsqueeze(0), 0, dcp)                       # [n, T, H, Dv + 1]
    acc_o, acc_lse = states[0, ..., :dv].to(o.dtype), states[0, ..., dv].contiguous()
    for r in range(1, dcp.size):
        last = r == dcp.size - 1
        acc_o, acc_lse = xpu_ops.merge_state_v2(
            acc_o, acc_lse, states[r, ..., :dv].to(o.dtype), states[r, ..., dv].contiguous(),
            v_merged=out if last else None)
    if dcp.size == 1 and out is not None:
        acc_o = out.copy_(acc_o)
    return acc_o, acc_lse


def _output(fb: ForwardBatch, q3: Tensor, hq: int, dv: int) -> Tensor:
    """``fb._attn_output`` viewed ``[T, Hq, Dv]`` (piecewise mode), or a new tensor."""
    buf = getattr(fb, "_attn_output", None)
    return q3.new_empty((q3.shape[0], hq, dv)) if buf is None else buf.view(q3.shape[0], hq, dv)


__all__ = ["DCPAttentionBackend", "DCPMetadata", "merge_over_ranks", "shard_lengths",
           "local_slots"]
