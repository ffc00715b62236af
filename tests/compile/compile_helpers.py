"""Shared setup of the compile tests: a tiny Llama on the real backend, and its batches
(``MLAHarness``: the same over the MLA latent cache of a DeepSeek-V2 model; ``SWAHarness``: over
a hybrid sliding-window pool).

``PagedAttention`` layers attend through the split op when one is installed
(``compile.graphs.split_op.enable_split_op``), which is how the piecewise tests use them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

import torch
from torch import Tensor

from compile.backend import XPUAttentionBackend
from compile.batch import (ForwardBatch, ForwardMode, MHATokenToKVPool, MLATokenToKVPool,
                           PageAllocator, ReqToTokenPool, SWAKVPool, SpecInfo)
from compile.engine.model_runner import ModelRunnerInfo
from compile.models import ModelConfig
from compile.models.llama import LlamaForCausalLM

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=256)


def tiny_model(num_layers: int = 2, device="cpu", dtype=torch.float32, seed: int = 0,
               **overrides) -> LlamaForCausalLM:
    """A zoo Llama with random weights (std 0.15)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**TINY, "num_hidden_layers": num_layers, **overrides})
    model = LlamaForCausalLM(cfg, dtype=dtype, device=device).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    return model


class Harness:
    """Pools, allocator and backend for one model; builds batches over persistent requests.

    Requests are rows of ``req_to_token``; ``extend(rows, lens)`` appends ``lens[i]`` tokens to
    request ``rows[i]`` and ``decode(rows)`` one token each, both returning
    ``(input_ids, positions, forward_batch)`` with metadata already initialised.
    """

    def __init__(self, model, page_size: int = 1, max_reqs: int = 16, context: int = 128,
                 device="cpu", seed: int = 0):
        cfg = model.config
        self.device = torch.device(device)
        self.vocab = cfg.vocab_size
        num_pages = max_reqs * (-(-context // page_size)) + 1
        self.req_pool = ReqToTokenPool(max_reqs, context, self.device)
        self.kv_pool = self._kv_pool(model, num_pages * page_size, page_size)
        gen = torch.Generator().manual_seed(seed)
        self.allocator = PageAllocator(num_pages, page_size, self.device, generator=gen)
        runner = ModelRunnerInfo(
            model_config=SimpleNamespace(context_len=context,
                                         num_attention_heads=cfg.num_attention_heads),
            tp_size=1, device=self.device, page_size=page_size, req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool, kv_cache_dtype=self.kv_pool.dtype,
            is_hybrid_swa=isinstance(self.kv_pool, SWAKVPool))
        self.backend = XPUAttentionBackend(runner)
        self.lens = [0] * max_reqs
        self.gen = torch.Generator().manual_seed(seed + 1)

    def _kv_pool(self, model, size: int, page_size: int):
        """The KV pool of ``size`` tokens for ``model`` (one K and one V buffer per layer)."""
        cfg = model.config
        return MHATokenToKVPool(size, page_size, next(model.parameters()).dtype,
                                cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers,
                                self.device)

    def _alloc(self, row: int, prefix_len: int, num_new: int) -> Tensor:
        """Full-pool slots [num_new] int64 of request ``row``'s next tokens."""
        return self.allocator.alloc_extend(self.req_pool, row, prefix_len, num_new)

    def _batch(self, mode, rows, new_lens, ids, init=True) -> ForwardBatch:
        prefix = [self.lens[r] for r in rows]
        locs = [self._alloc(r, p, n) for r, p, n in zip(rows, prefix, new_lens)]
        for r, n in zip(rows, new_lens):
            self.lens[r] += n
        seq_lens = torch.tensor([self.lens[r] for r in rows], dtype=torch.int32)
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new_lens)])
        extend = {}
        if mode == ForwardMode.EXTEND:
            extend = dict(extend_seq_lens=torch.tensor(new_lens, dtype=torch.int32,
                                                       device=self.device),
                          extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32,
                                                          device=self.device))
        fb = ForwardBatch(forward_mode=mode, batch_size=len(rows),
                          req_pool_indices=torch.tensor(rows, device=self.device),
                          seq_lens=seq_lens.to(self.device), seq_lens_cpu=seq_lens,
                          out_cache_loc=torch.cat(locs).to(self.device),
                          positions=positions.to(self.device), **extend)
        fb.attn_backend, fb.token_to_kv_pool = self.backend, self.kv_pool
        fb.req_to_token_pool = self.req_pool
        if init:
            self.backend.init_forward_metadata(fb)
        return ids.to(self.device), fb.positions, fb

    def extend(self, rows: Sequence[int], lens: Sequence[int], init=True):
        ids = torch.randint(0, self.vocab, (sum(lens),), generator=self.gen)
        return self._batch(ForwardMode.EXTEND, list(rows), list(lens), ids, init)

    def decode(self, rows: Sequence[int], init=True):
        ids = torch.randint(0, self.vocab, (len(rows),), generator=self.gen)
        return self._batch(ForwardMode.DECODE, list(rows), [1] * len(rows), ids, init)

    def verify(self, rows: Sequence[int], d: int, init=False):
        """TARGET_VERIFY over ``d`` drafts per request (``seq_lens`` = the prefix, as sglang):
        ``d`` new slots per request; the drafts do not count as cached until ``accept``."""
        ids, pos, fb = self.extend(rows, [d] * len(rows), init=False)
        for r in rows:
            self.lens[r] -= d
        seq_lens_cpu = torch.tensor([self.lens[r] for r in rows], dtype=torch.int32)
        verify = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=len(rows),
                              req_pool_indices=fb.req_pool_indices,
                              seq_lens=seq_lens_cpu.to(self.device), seq_lens_cpu=seq_lens_cpu,
                              out_cache_loc=fb.out_cache_loc, positions=fb.positions,
                              spec_info=SpecInfo(topk=1, draft_token_num=d))
        verify.attn_backend, verify.token_to_kv_pool = self.backend, self.kv_pool
        verify.req_to_token_pool = self.req_pool
        if init:
            self.backend.init_forward_metadata(verify)
        return ids, pos, verify

    def accept(self, rows: Sequence[int], n: int = 1) -> None:
        """Accept the first ``n`` drafts of each request of a ``verify`` step."""
        for r in rows:
            self.lens[r] += n


class MLAHarness(Harness):
    """``Harness`` over an ``MLATokenToKVPool`` for a DeepSeek-V2 model (R + r per token, one
    buffer per layer)."""

    def _kv_pool(self, model, size: int, page_size: int):
        cfg = model.config
        return MLATokenToKVPool(size, page_size, next(model.parameters()).dtype,
                                cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_hidden_layers,
                                self.device)


class SWAHarness(Harness):
    """``Harness`` over a hybrid ``SWAKVPool`` (the model's ``sliding_attention`` layers in a
    half-size SWA pool, the others in the full pool), as an engine builds it: every new full
    page is mapped onto a free SWA page, both allocators hand pages out in random order, so SWA
    slots differ from full slots (nothing is evicted)."""

    def _kv_pool(self, model, size: int, page_size: int):
        cfg = model.config
        swa = [i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention"]
        full = [i for i in range(cfg.num_hidden_layers) if i not in swa]
        swa_pages = size // page_size // 2
        self.swa_allocator = PageAllocator(swa_pages, page_size, self.device,
                                           generator=torch.Generator().manual_seed(7))
        return SWAKVPool(size, swa_pages * page_size, swa, full, page_size,
                         next(model.parameters()).dtype, cfg.num_key_value_heads, cfg.head_dim,
                         self.device)

    def _alloc(self, row: int, prefix_len: int, num_new: int) -> Tensor:
        slots = super()._alloc(row, prefix_len, num_new)
        ps, mapping = self.kv_pool.page_size, self.kv_pool.full_to_swa_index_mapping
        pages = torch.unique(slots // ps)
        new = pages[mapping[pages * ps] == 0]  # full pages without an SWA page yet
        if new.numel():
            self.kv_pool.map_pages(new.tolist(), self.swa_allocator.alloc_pages(new.numel()))
        return slots


def eager_without_split_op(model, layers, ids: Tensor, pos: Tensor, fb: ForwardBatch):
    """``model(ids, pos, fb)`` under ``no_grad`` with its split-op ``layers`` (``layer_id ->
    PagedAttention``) back on the backend directly for the call: the eager reference of a
    piecewise step."""
    ops = {i: layer.split_op for i, layer in layers.items()}
    for layer in layers.values():
        layer.split_op = None
    try:
        with torch.no_grad():
            return model(ids, pos, fb)
    finally:
        for i, layer in layers.items():
            layer.split_op = ops[i]


def fx_op_sequence(gm: torch.fx.GraphModule) -> str:
    """One line per call node: ``op target`` (placeholder/output/getitem-free), for snapshots."""
    lines = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            target = node.target
            name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
            if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
                name = str(target)
            lines.append(f"{node.op} {name}")
    return "\n".join(lines)


def pool_buffers(pool) -> list[torch.Tensor]:
    """Every KV buffer of ``pool``: K and V per layer (hybrid SWA: of both inner pools), or the
    latent cache per layer (MLA)."""
    if isinstance(pool, SWAKVPool):
        return pool_buffers(pool.full_kv_pool) + pool_buffers(pool.swa_kv_pool)
    if isinstance(pool, MLATokenToKVPool):
        return list(pool.kv_buffer)
    return pool.k_buffer + pool.v_buffer
