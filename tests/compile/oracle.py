"""Float64 dense-attention oracle over logical token sequences, and a random-batch harness.

The oracle knows nothing of pages: it takes each request's keys in logical order (what the
engine believes it cached), builds the visibility mask from positions, and runs a plain float64
softmax. The harness builds pools with pages handed out in shuffled order, fills unused cache
slots with NaN (so reading a wrong page poisons the result), runs the backend and keeps the
logical K/V of every request next to the pool.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Optional, Sequence

import torch
from torch import Tensor

from compile.backend import PagedAttention, XPUAttentionBackend
from compile.batch import (ForwardBatch, ForwardMode, MHATokenToKVPool, MLATokenToKVPool,
                           PageAllocator, ReqToTokenPool, SWAKVPool, SpecInfo)
from compile.engine.model_runner import ModelRunnerInfo

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def attention_oracle(q: Tensor, k: Tensor, v: Tensor, *, scale: float,
                     q_pos: Optional[Sequence[int]] = None, causal: bool = True,
                     window_left: int = -1, chunk: int = 0, softcap: float = 0.0,
                     sinks: Optional[Tensor] = None, qv: Optional[Tensor] = None,
                     block_ids: Optional[Sequence[int]] = None) -> Tensor:
    """Dense attention of one request, float64.

    Args:
        q: [Lq, Hq, D]; k: [Lk, Hkv, D]; v: [Lk, Hkv, Dv] (logical order, position = index).
        q_pos: absolute position of each query (default bottom-right: Lk - Lq + i).
        causal: keys j <= pos. window_left: keys j >= pos - window_left (-1: unbounded).
        chunk: chunked-local attention, keys in the query's chunk only (0: off).
        softcap: s = cap * tanh(s / cap). sinks: [Hq] extra logits in the denominator.
        qv: [Lq, Hq, Dv], adds qv.v to the scores (absorbed MLA).
        block_ids: [Lk] bidirectional block id of each position (-1: none): a query also sees
            the later keys of its own block (Gemma-3 image tokens), within the window.
    Returns:
        [Lq, Hq, Dv] float64; rows with no visible key are 0.
    """
    q, k, v = q.double(), k.double(), v.double()
    lq, hq, _ = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    if lk == 0:                                  # no key at all: every row is empty
        return q.new_zeros(lq, hq, v.shape[-1])
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    pos = torch.tensor(list(q_pos) if q_pos is not None else range(lk - lq, lk))[:, None]
    j = torch.arange(lk)[None, :]
    mask = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        mask &= j <= pos
    if block_ids is not None:
        ids = torch.tensor(list(block_ids))
        mask |= (ids[pos] == ids[j]) & (ids[j] >= 0)
    if window_left >= 0:
        mask &= j >= pos - window_left
    if chunk:
        mask &= (j // chunk) == (pos // chunk)
    # [H, Lq, D] @ [H, D, Lk] (matmul, not einsum: einsum costs ~2 ms a call on the CPU here)
    s = q.transpose(0, 1) @ k.permute(1, 2, 0)
    if qv is not None:
        s = s + qv.double().transpose(0, 1) @ v.permute(1, 2, 0)
    s = s * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask[None], -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(hq, lq, 1)], dim=-1)
    m = s.amax(-1, keepdim=True).clamp(min=-1e300)
    p = torch.exp(s - m)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-300)
    out = (p[..., :lk] @ v.transpose(0, 1)).transpose(0, 1)
    return torch.where(mask.any(-1)[:, None, None], out, 0.0)


@dataclasses.dataclass
class Req:
    """One request: its req_to_token row and the logical K/V of each layer (float64)."""

    row: int
    k: dict
    v: dict

    def length(self, layer_id: int = 0) -> int:
        return self.k[layer_id].shape[0]


class Harness:
    """Pools, allocator, backend and logical K/V for random-batch backend tests.

    Args:
        page_size: tokens per page. hq/hkv/d/dv: head counts and dims.
        num_layers: layers in the pool. dtype: q/k/v dtype. kv_dtype: cache dtype (fp8 ok).
        swa_layers/window: hybrid SWA pool with these layer ids and HF window W.
        chunk: attention_chunk_size. topk/num_steps/draft_tokens: speculative settings.
        mla: an MLA latent pool (``MLATokenToKVPool``, one KV head): the cached row of a token
            is its key ``[d]`` (latent ``dv`` then rope ``d - dv``), its value the latent part.
        device: where pools, tables and batches live (the logical K/V stay on the host).
    """

    def __init__(self, page_size: int, *, hq: int = 4, hkv: int = 2, d: int = 32,
                 dv: Optional[int] = None, num_layers: int = 1, dtype=torch.float32,
                 kv_dtype=None, num_pages: Optional[int] = None, context_len: int = 512,
                 seed: int = 0, swa_layers: Sequence[int] = (), window: Optional[int] = None,
                 chunk: Optional[int] = None, topk: int = 0, num_steps: int = 0,
                 draft_tokens: int = 0, step_id: int = 0, mla: bool = False,
                 device="cpu"):
        self.gen = torch.Generator().manual_seed(seed)
        self.ps, self.hq, self.hkv, self.d = page_size, hq, hkv, d
        self.dv = d if dv is None else dv
        self.dtype, self.kv_dtype = dtype, kv_dtype or dtype
        self.chunk, self.device = chunk, torch.device(device)
        num_pages = num_pages or max(2 + 2048 // page_size, 48)
        self.req_pool = ReqToTokenPool(16, context_len, self.device)
        self.alloc = PageAllocator(num_pages, page_size, self.device, generator=self.gen)
        self.swa_layers = tuple(swa_layers)
        kw = dict(page_size=page_size, dtype=self.kv_dtype, head_num=hkv, head_dim=d,
                  device=self.device, v_head_dim=self.dv)
        self.mla = mla
        if mla:
            if hkv != 1 or self.dv >= d:
                raise ValueError(f"Harness: an MLA pool has one KV head and dv < d; expected "
                                 f"hkv 1 and dv < {d}, got hkv {hkv}, dv {self.dv}.")
            self.pool = MLATokenToKVPool(num_pages * page_size, page_size, self.kv_dtype,
                                         self.dv, d - self.dv, num_layers, self.device)
        elif self.swa_layers:
            full = [i for i in range(num_layers) if i not in self.swa_layers]
            self.pool = SWAKVPool(num_pages * page_size, num_pages * page_size,
                                  self.swa_layers, full, **kw)
            self.swa_alloc = PageAllocator(num_pages, page_size, self.device,
                                           generator=self.gen)
        else:
            self.pool = MHATokenToKVPool(num_pages * page_size, layer_num=num_layers, **kw)
        self._poison()
        args = SimpleNamespace(speculative_eagle_topk=topk, speculative_num_steps=num_steps,
                               speculative_num_draft_tokens=draft_tokens)
        self.runner = ModelRunnerInfo(
            model_config=SimpleNamespace(context_len=context_len, num_attention_heads=hq),
            tp_size=1, device=self.device, page_size=page_size,
            req_to_token_pool=self.req_pool, token_to_kv_pool=self.pool,
            kv_cache_dtype=self.kv_dtype, server_args=args, sliding_window_size=window,
            attention_chunk_size=chunk, is_hybrid_swa=bool(self.swa_layers))
        self.backend = XPUAttentionBackend(self.runner, speculative_step_id=step_id, topk=topk,
                                           speculative_num_steps=num_steps)

    def _buffers(self):
        if self.mla:
            yield from self.pool.kv_buffer
            return
        if self.swa_layers:
            pools = [self.pool.full_kv_pool, self.pool.swa_kv_pool]
        else:
            pools = [self.pool]
        for p in pools:
            yield from p.k_buffer
            yield from p.v_buffer

    def _poison(self) -> None:
        """NaN everywhere except the padding page 0 (finite random data)."""
        for buf in self._buffers():
            buf.copy_(torch.full(buf.shape, math.nan).to(buf.dtype))
            buf[:self.ps] = self.rand(self.ps, *buf.shape[1:]).to(buf)

    def rand(self, *shape) -> Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64)

    def layer(self, layer_id: int = 0, **kw) -> PagedAttention:
        return PagedAttention(self.hq, self.d, self.d ** -0.5, self.hkv, layer_id,
                              v_head_dim=self.dv, **kw)

    # ------------------------------------------------------------ cache contents

    def _buffer_of(self, layer_id: int):
        return self.pool.get_key_buffer(layer_id), self.pool.get_value_buffer(layer_id)

    def quantize(self, x: Tensor, scale: float = 1.0) -> Tensor:
        """What the cache will hold for ``x``, read back as float64 (the oracle's keys)."""
        if self.kv_dtype in FP8:
            return (x.to(self.dtype).float() / scale).to(self.kv_dtype).double() * scale
        return x.to(self.dtype).to(self.kv_dtype).double()

    def write_direct(self, layer_id: int, slots: Tensor, k: Tensor, v: Tensor,
                     scale: float = 1.0) -> None:
        """Write cache contents without the backend (prefixes), SWA translation included."""
        if self.swa_layers and self.pool.is_swa_layer(layer_id):
            slots = self.pool.translate_loc_from_full_to_swa(slots)
        kb, vb = self._buffer_of(layer_id)
        if self.mla:  # the latent row is the key; the value is its first dv entries
            kb[slots] = k.to(kb)
            return
        if self.kv_dtype in FP8:
            kb[slots] = (k.float() / scale).to(kb)
            vb[slots] = (v.float() / scale).to(vb)
        else:
            kb[slots], vb[slots] = k.to(kb), v.to(vb)

    def alloc_slots(self, req: Req, start: int, n: int) -> Tensor:
        slots = self.alloc.alloc_extend(self.req_pool, req.row, start, n)
        if self.swa_layers and n:
            pages = torch.unique(slots // self.ps)
            new = pages[self.pool.full_to_swa_index_mapping[pages * self.ps] == 0]
            if new.numel():
                self.pool.map_pages(new.tolist(), self.swa_alloc.alloc_pages(new.numel()))
        return slots

    def add_request(self, prefix_len: int, layers: Sequence[int] = (0,),
                    scale: float = 1.0) -> Req:
        """A request with ``prefix_len`` random cached tokens in each of ``layers``."""
        req = Req(row=self.req_pool.alloc(1)[0], k={}, v={})
        slots = self.alloc_slots(req, 0, prefix_len)
        for lid in layers:
            k = self.rand(prefix_len, self.hkv, self.d)
            v = k[..., :self.dv] if self.mla else self.rand(prefix_len, self.hkv, self.dv)
            self.write_direct(lid, slots, k, v, scale)
            req.k[lid], req.v[lid] = self.quantize(k, scale), self.quantize(v, scale)
        return req

    # ------------------------------------------------------------ batches

    def batch(self, mode: ForwardMode, reqs: Sequence[Req], new_lens: Sequence[int],
              out_cache_loc: Tensor, seq_lens: Sequence[int], spec_info=None,
              **kw) -> ForwardBatch:
        i64 = dict(dtype=torch.int64, device=self.device)
        fb = ForwardBatch(
            forward_mode=mode, batch_size=len(reqs),
            req_pool_indices=torch.tensor([r.row for r in reqs], **i64),
            seq_lens=torch.tensor(list(seq_lens), **i64), out_cache_loc=out_cache_loc,
            spec_info=spec_info, **kw)
        if mode.is_extend_or_draft_extend_or_mixed(include_draft_extend_v2=True):
            prefix = [s - n for s, n in zip(seq_lens, new_lens)]
            fb.extend_seq_lens = torch.tensor(list(new_lens), dtype=torch.int32,
                                              device=self.device)
            fb.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32, device=self.device)
            fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = list(new_lens), prefix
            fb.extend_num_tokens = sum(new_lens)
        fb.attn_backend = self.backend
        return fb

    def poisoned_output(self, fb: ForwardBatch, tokens: int, layer: PagedAttention) -> Tensor:
        fb._attn_output = torch.full((tokens, layer.tp_q_head_num * layer.v_head_dim),
                                     math.nan, dtype=self.dtype, device=self.device)
        return fb._attn_output

    def step(self, mode: ForwardMode, reqs: Sequence[Req], new_lens: Sequence[int],
             layers: Sequence[PagedAttention], scale: float = 1.0, write: bool = True,
             sinks=None, block_ids: Optional[Tensor] = None
             ) -> tuple[list[Tensor], list[Tensor]]:
        """Append ``new_lens[r]`` tokens to each request and run every layer once
        (``block_ids``: the backend's Gemma-3 ids over whole sequences, set after the metadata
        as the model does).

        Returns ``(outputs, queries)`` per layer, outputs ``[T, Hq * Dv]`` (float64 copies).
        """
        starts = [r.length(layers[0].kv_cache_layer_id) for r in reqs]
        loc = torch.cat([self.alloc_slots(r, s, n) for r, s, n in zip(reqs, starts, new_lens)])
        seq_lens = [s + n for s, n in zip(starts, new_lens)]
        fb = self.batch(mode, reqs, new_lens, loc, seq_lens)
        self.backend.init_forward_metadata(fb)
        self.backend.bidirectional_block_ids = block_ids
        outs, qs = [], []
        for layer in layers:
            t = sum(new_lens)
            q = self.rand(t, self.hq * self.d)
            k, v = self.rand(t, self.hkv, self.d), self.rand(t, self.hkv, self.dv)
            out = self.poisoned_output(fb, t, layer)
            writes = write and layer.kv_sharing_target_layer_id is None
            dev = dict(dtype=self.dtype, device=self.device)
            kk, vv = (k.to(**dev), v.to(**dev)) if writes else (None, None)
            res = layer(q.to(**dev), kk, vv, fb, sinks=sinks)
            assert res.data_ptr() == out.data_ptr()
            if writes:
                self._append(reqs, new_lens, layer.layer_id, k, v, scale)
            outs.append(res.to("cpu", torch.float64, copy=True))
            qs.append(q.to(self.dtype).double())
        return outs, qs

    def _append(self, reqs, new_lens, layer_id, k, v, scale) -> None:
        off = 0
        for r, n in zip(reqs, new_lens):
            kq, vq = self.quantize(k[off:off + n], scale), self.quantize(v[off:off + n], scale)
            r.k[layer_id] = torch.cat([r.k[layer_id], kq])
            r.v[layer_id] = torch.cat([r.v[layer_id], vq])
            off += n

    def expected(self, reqs, new_lens, layer: PagedAttention, q: Tensor, sinks=None,
                 block_ids=None) -> Tensor:
        """Oracle output ``[T, Hq * Dv]`` for a step of ``layer`` (causal unless the layer's
        ``attn_type`` is not; ``block_ids``: per request, ids over its whole sequence)."""
        outs, off = [], 0
        w = layer.sliding_window_size
        lid = layer.kv_cache_layer_id
        for i, (r, n) in enumerate(zip(reqs, new_lens)):
            qr = q[off:off + n].view(n, self.hq, self.d)
            o = attention_oracle(qr, r.k[lid], r.v[lid], scale=layer.scaling,
                                 causal=layer.causal, window_left=w if w >= 0 else -1,
                                 chunk=(self.chunk or 0) if layer.use_irope else 0,
                                 softcap=layer.logit_cap, sinks=sinks,
                                 block_ids=None if block_ids is None else block_ids[i])
            outs.append(o.reshape(n, -1))
            off += n
        return torch.cat(outs)


def random_tree(gen: torch.Generator, d: int) -> Tensor:
    """A random draft tree as sglang's per-request mask ``[d, d]`` bool: draft ``i`` sees itself
    and its ancestors, its parent drawn uniformly from the drafts before it (draft 0 the root)."""
    mask = torch.eye(d, dtype=torch.bool)
    for i in range(1, d):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        mask[i] |= mask[parent]
    return mask


def assert_close(actual: Tensor, expected: Tensor, dtype=torch.float32) -> None:
    tol = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    assert not torch.isnan(actual).any(), "output has NaN (a wrong page or an unwritten row)"
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol)


__all__ = ["attention_oracle", "Harness", "Req", "assert_close", "random_tree", "ForwardMode",
           "SpecInfo"]
