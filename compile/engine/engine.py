"""A minimal batch engine: request slots, page-aligned KV allocation, chunked prefill, decode.

Each step is one ``ForwardBatch`` built exactly as an sglang scheduler would: the engine picks
the requests, gives each new token a KV slot (``PageAllocator.alloc_extend`` keeps a request's
slots page aligned), has the attention metadata built once on the host
(``attn_backend.init_forward_metadata(batch)``, or the graph runner's own build), then runs
the model once. Policy (sglang's default, simplified):

1. If some request still has prompt tokens to prefill, run an EXTEND step over the oldest such
   requests, admitting waiting requests while a ``req_to_token`` row and pages are free, with at
   most ``chunked_prefill_size`` new tokens in the step (a long prompt is split across steps;
   only its last chunk samples a token).
2. Otherwise run a DECODE step over every running request (one new token each).
3. A request that samples a stop token or reaches ``max_new_tokens`` frees its row and pages at
   once; requests added with ``add_request`` join at the next step.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from compile.backend import HybridLinearAttnBackend, XPUAttentionBackend, kv_layout, linear_layout
from compile.backend.parallel_state import ParallelConfig
from compile.batch import (ForwardBatch, ForwardMode, KVLayout, LinearStatePool, PageAllocator,
                           ReqToTokenPool, SWAPageAllocator, hybrid_kv_pool, make_kv_pool)
from compile.engine import disaggregation as disagg
from compile.engine.model_runner import ModelRunnerInfo
from compile.engine.request import Req
from compile.engine.sampling import SamplingParams, check_positive_int, is_integer, sample


@dataclasses.dataclass
class DecodeTotals:
    """Tokens, wall seconds and steps of a set of decode steps."""

    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens, self.seconds, self.steps = (self.tokens + tokens, self.seconds + seconds,
                                                 self.steps + 1)


@dataclasses.dataclass
class EngineStats:
    """Token counts and wall seconds of prefill and decode steps (for tokens/s).

    ``steps`` counts every engine step, prefill (EXTEND) steps included; ``decode_steps`` the
    decode steps only. ``decode_step_log`` holds ``(batch size, seconds)`` of every decode step
    in order, and ``compiled_decode_steps`` the indices into it of the steps in which something
    was compiled or captured (``compile_events``), so ``decode_split`` can set the warm-up
    steps (compilation, recompiles, graph capture) apart.
    """

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    steps: int = 0
    decode_step_log: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    compiled_decode_steps: set[int] = dataclasses.field(default_factory=set)

    @property
    def decode_steps(self) -> int:
        """Decode steps run (``steps`` without the prefill steps)."""
        return len(self.decode_step_log)

    def decode_split(self, warmup_steps: int = 2) -> tuple[DecodeTotals, DecodeTotals]:
        """``(warm-up, steady state)`` totals of the decode steps: warm-up are the first
        ``warmup_steps`` steps of each batch size (where a compiled mode compiles or recompiles
        and a graph mode captures) and every later step in ``compiled_decode_steps``, steady
        state all the others."""
        seen: dict[int, int] = {}
        warm, steady = DecodeTotals(), DecodeTotals()
        for i, (b, seconds) in enumerate(self.decode_step_log):
            seen[b] = seen.get(b, 0) + 1
            late = seen[b] > warmup_steps and i not in self.compiled_decode_steps
            (steady if late else warm).add(b, seconds)
        return warm, steady

    def late_compiled_steps(self, warmup_steps: int = 2) -> int:
        """Decode steps past the first ``warmup_steps`` of their batch size in which something
        was compiled or captured (``decode_split`` counts them as warm-up)."""
        seen: dict[int, int] = {}
        late = 0
        for i, (b, _) in enumerate(self.decode_step_log):
            seen[b] = seen.get(b, 0) + 1
            late += seen[b] > warmup_steps and i in self.compiled_decode_steps
        return late


def compile_events(forward) -> int:
    """How many compilations and captures have happened so far: Dynamo's graph count in this
    process (0 when Dynamo was never imported) plus the ``captures`` of a graph runner and the
    piece ``compiles``/``captures`` of a piecewise backend, on ``forward`` or the forward it
    wraps. Cheap (a few attribute reads): the engine reads it around every decode step."""
    utils = sys.modules.get("torch._dynamo.utils")
    n = utils.counters["stats"]["unique_graphs"] if utils is not None else 0
    for f in (forward, getattr(forward, "forward", None)):
        captures = getattr(f, "captures", 0)
        n += captures if isinstance(captures, int) else 0
        stats = getattr(getattr(f, "backend", None), "stats", None)
        if isinstance(stats, dict):
            n += int(stats.get("compiles", 0)) + int(stats.get("captures", 0))
    return n


class Engine:
    """Runs ``model`` over a paged KV cache for many requests at once.

    Args:
        model: a zoo model (``model.config`` is a ``ModelConfig``); called as
            ``forward(input_ids [T], positions [T], forward_batch) -> logits [b, vocab]``.
        forward: the callable actually run (default ``model``; e.g. ``compile_model(model)``).
            The engine builds each step's attention metadata first, once, unless ``forward``
            has ``builds_metadata = True`` (``compile.graphs.graph_runner.GraphRunner``: it
            writes captured steps' metadata into its step buffers and builds the others').
        page_size: tokens per KV page. max_running: ``req_to_token`` rows (concurrent requests).
        max_context_len: tokens per request at most (prompt + output); requests are also held
            to the model's ``max_position_embeddings`` (``max_request_tokens``, the smaller).
        max_total_tokens: KV slots in the pool (page 0 is reserved as padding on top of these).
            A model with linear-attention layers (``compile.backend.LinearAttention``) also gets
            a ``LinearStatePool`` of ``max_running`` state slots (``state_pool``) and, by
            default, a ``HybridLinearAttnBackend``.
        chunked_prefill_size: most new tokens in one EXTEND step.
        kv_dtype: cache dtype (default: the model's). seed: for temperature sampling.
        backend_cls: attention backend class (default ``XPUAttentionBackend``).
        swa_pool: keep the ``sliding_attention`` layers' KV in a hybrid pool that holds only
            their window (``compile.batch.swa_pages``); None: whenever the model has such layers.
        parallel: this process's ``ParallelConfig`` (default: one process). With tensor
            parallelism ``model`` is already sharded (``tensor_parallel``) and the pool holds
            this rank's KV heads; with decode context parallelism every rank runs the same
            schedule, pages are ``page_size * dcp`` tokens and each rank stores its
            ``page_size`` of them (``compile.backend.dcp_attention``), so ``max_total_tokens``
            costs ``1 / dcp`` of the memory per rank.
        enable_deterministic_inference: sglang's ``--enable-deterministic-inference``: the
            backend passes ``num_splits=1`` (MLA: ``num_kv_splits=1``) in every attention call,
            one pass over the keys, so a request's attention output does not depend on the
            rest of its batch (``XPUAttentionBackend``). It reaches the backend as
            ``model_runner.server_args.enable_deterministic_inference``.
        disaggregation: ``"prefill"`` or ``"decode"`` (sglang's ``--disaggregation-mode``):
            this engine runs one phase and exchanges requests with ``disaggregation_peer``
            (default ``disagg.paired_rank``) over torch.distributed
            (``compile.engine.disaggregation``; its role object is ``self.disagg``).
    Attributes:
        max_request_tokens: prompt + new tokens one request may hold at most, the smaller of
            ``max_context_len`` and the model's ``max_position_embeddings``.
    Raises:
        TypeError, ValueError: a size argument that is not an integer >= 1; ``kv_dtype`` that
            is not None or a floating-point ``torch.dtype``; a ``disaggregation`` role or
            ``disaggregation_peer`` that ``disaggregation.check_role`` refuses.
        ValueError: ``swa_pool=True`` for a model without sliding-window layers.
    """

    def __init__(self, model, *, forward: Optional[Callable] = None, page_size: int = 1,
                 max_running: int = 8, max_context_len: int = 2048,
                 max_total_tokens: int = 8192, chunked_prefill_size: int = 512,
                 kv_dtype: Optional[torch.dtype] = None, seed: int = 0, backend_cls=None,
                 swa_pool: Optional[bool] = None, parallel: Optional[ParallelConfig] = None,
                 enable_deterministic_inference: bool = False,
                 disaggregation: Optional[str] = None, disaggregation_peer: Optional[int] = None):
        disagg.check_role(disaggregation, disaggregation_peer)
        _check_sizes(page_size=page_size, max_running=max_running,
                     max_context_len=max_context_len, max_total_tokens=max_total_tokens,
                     chunked_prefill_size=chunked_prefill_size)
        if not isinstance(enable_deterministic_inference, bool):
            raise TypeError(f"Engine: enable_deterministic_inference has type "
                            f"{type(enable_deterministic_inference).__name__}; expected a bool, "
                            f"got {enable_deterministic_inference!r}.")
        _check_kv_dtype(kv_dtype)
        cfg = model.config
        weight = next(model.parameters())
        self.device, self.model = weight.device, model
        self.forward = model if forward is None else forward
        self.parallel = ParallelConfig() if parallel is None else parallel
        dcp = self.parallel.dcp.size
        # With DCP the engine hands out virtual pages of page_size * dcp tokens, each rank
        # storing page_size of them (compile.backend.dcp_attention).
        self.page_size, self.chunked_prefill_size = page_size * dcp, chunked_prefill_size
        self.max_request_tokens = min(max_context_len, cfg.max_position_embeddings)
        num_pages = -(-max_total_tokens // self.page_size) + 1  # + reserved page 0
        self.req_to_token_pool = ReqToTokenPool(max_running, max_context_len, self.device)
        self.swa_pages: Optional[SWAPageAllocator] = None
        layout = kv_layout(model)  # this rank's KV heads: a sharded model's layers hold them
        self.token_to_kv_pool = self._kv_pool(layout, swa_pool, num_pages, page_size,
                                              kv_dtype or weight.dtype, max_running,
                                              max_context_len)
        window = layout.sliding_window
        # linear-attention layers (Qwen3-Next): one state slot per request row
        linear = linear_layout(model)
        self.state_pool = None if linear is None else LinearStatePool(
            linear, max_running, max_running, weight.dtype, self.device)
        self.allocator = PageAllocator(num_pages, self.page_size, self.device)
        self.model_runner = ModelRunnerInfo(
            model_config=SimpleNamespace(context_len=max_context_len,
                                         num_attention_heads=cfg.num_attention_heads,
                                         index_topk=getattr(cfg, "index_topk", None)),
            tp_size=self.parallel.tp.size, device=self.device, page_size=self.page_size,
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool,
            kv_cache_dtype=self.token_to_kv_pool.dtype, sliding_window_size=(
                None if window is None else window - 1),
            attention_chunk_size=getattr(cfg, "attention_chunk_size", None),
            is_hybrid_swa=self.swa_pages is not None,
            dcp_group=self.parallel.dcp if dcp > 1 else None,
            server_args=SimpleNamespace(
                enable_deterministic_inference=enable_deterministic_inference),
            state_pool=self.state_pool)
        if backend_cls is None and self.state_pool is not None:
            backend_cls = HybridLinearAttnBackend
        if backend_cls is None and dcp > 1:
            from compile.backend.dcp_attention import DCPAttentionBackend as backend_cls
        if backend_cls is None and layout.index_head_dim:  # DeepSeek-V3.2: sparse MLA
            from compile.backend.dsa_backend import DSAAttentionBackend as backend_cls
        self.attn_backend = (backend_cls or XPUAttentionBackend)(self.model_runner)
        if getattr(self.forward, "fixed_table_width", False):
            # a compiled forward gets one page-table width in every step: no recompile when a
            # request crosses a page boundary (MetadataBuilderMixin.fixed_table_width)
            self.attn_backend.fixed_table_width = True
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # admitted: prefilling or decoding
        self.stats = EngineStats()
        self.last_batch: Optional[ForwardBatch] = None
        self.last_batch_reqs: list[Req] = []
        self._next_rid = 0
        self.disagg = disagg.make_role(self, disaggregation, disaggregation_peer)

    def _kv_pool(self, layout: KVLayout, swa_pool: Optional[bool], num_pages: int,
                 page_size: int, dtype: torch.dtype, max_running: int, max_context_len: int):
        """The KV pool of one rank: ``num_pages`` pages of ``page_size`` tokens shaped by
        ``layout`` (this rank's heads); hybrid SWA (sets ``self.swa_pages``), MLA or MHA."""
        if _use_swa_pool(layout, swa_pool):
            pool, self.swa_pages = hybrid_kv_pool(
                layout, size=num_pages * page_size, page_size=page_size, dtype=dtype,
                device=self.device, max_running=max_running,
                prefill_chunk=self.chunked_prefill_size, max_context_len=max_context_len)
            return pool
        return make_kv_pool(layout, num_pages * page_size, page_size, dtype, self.device)

    # ----------------------------------------------------------------- requests
    def add_request(self, prompt_ids: Sequence[int],
                    sampling: Optional[SamplingParams] = None) -> Req:
        """Queue one request; it joins the batch at the next ``step`` (see ``add_requests``)."""
        return self._queue([prompt_ids], sampling, "Engine.add_request", "prompt_ids")[0]

    def add_requests(self, prompts: Sequence[Sequence[int]],
                     sampling: Optional[SamplingParams] = None) -> list[Req]:
        """Queue one request per prompt, in order. Every prompt is checked before any is queued,
        so after an error nothing new is waiting.

        Args:
            prompts: token ids per request (lists of ints or 1-D integer tensors).
            sampling: for every request (default ``SamplingParams()``).
        Raises:
            TypeError: ``sampling`` is not a ``SamplingParams``, a token id is not an integer.
            ValueError: an empty prompt, a token id outside ``[0, vocab_size)``, prompt +
                ``max_new_tokens`` over ``max_request_tokens`` or over the whole KV pool, or a
                ``sampling`` field out of range (``SamplingParams.validate``).
        """
        return self._queue(prompts, sampling, "Engine.add_requests", "prompts[{}]")

    def _queue(self, prompts, sampling: Optional[SamplingParams], where: str,
               name: str) -> list[Req]:
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"{where}: sampling has type {type(sampling).__name__}; "
                            f"expected a SamplingParams, got {sampling!r}. Build one with "
                            "compile.engine.engine.SamplingParams(...).")
        sampling.validate(where)
        # A private copy: the caller may change or reuse its object after this call.
        sampling = dataclasses.replace(sampling, stop_token_ids=tuple(sampling.stop_token_ids))
        checked = [self._check_prompt(p, sampling, where, name.format(i))
                   for i, p in enumerate(prompts)]
        reqs = [Req(self._next_rid + i, ids, sampling) for i, ids in enumerate(checked)]
        self._next_rid += len(reqs)
        self.waiting.extend(reqs)
        return reqs

    def _check_prompt(self, prompt, sampling: SamplingParams, where: str,
                      name: str) -> list[int]:
        """``prompt`` as a list of token ids, or the error that makes it unservable."""
        ids = prompt.tolist() if isinstance(prompt, Tensor) else list(prompt)
        vocab = self.model.config.vocab_size
        bad = next((t for t in ids if not is_integer(t)), None)
        if bad is not None:
            raise TypeError(f"{where}: {name} holds a {type(bad).__name__}; expected integer "
                            f"token ids, got {bad!r}. Tokenize the prompt first.")
        if not ids or min(ids) < 0 or max(ids) >= vocab:
            got = "an empty prompt" if not ids else f"ids from {min(ids)} to {max(ids)}"
            raise ValueError(f"{where}: {name} is empty or outside the vocabulary; expected 1 "
                             f"or more token ids in [0, {vocab}), got {got}.")
        total, limit = len(ids) + sampling.max_new_tokens, self.max_request_tokens
        pages, pool = -(-total // self.page_size), self.allocator.num_pages - 1
        if total > limit or pages > pool:
            raise ValueError(f"{where}: {name} needs {len(ids)} prompt + {sampling.max_new_tokens} "
                             f"new tokens = {total} ({pages} pages); expected at most "
                             f"max_request_tokens={limit} and the pool's {pool} pages. Shorten "
                             "the prompt, lower max_new_tokens or build a larger Engine.")
        return ids

    def has_work(self) -> bool:
        """True while any request is waiting or running (or, decoding disaggregated, may
        still arrive)."""
        return bool(self.waiting or self.running) or bool(self.disagg and self.disagg.has_work())

    def _pages_needed(self, req: Req) -> int:
        """Pages ``req`` may still take before it finishes (prompt + max_new_tokens)."""
        total = len(req.prompt_ids) + req.sampling.max_new_tokens
        return -(-total // self.page_size) - len(req.pages)

    def _admit(self) -> None:
        """Move waiting requests (oldest first) to running while a ``req_to_token`` row is free
        and the pool can hold every running request at its longest, so decode never runs out."""
        promised = sum(self._pages_needed(r) for r in self.running)
        while self.waiting and self.req_to_token_pool.available_size():
            need = self._pages_needed(self.waiting[0])
            if promised + need > len(self.allocator.free_pages):
                break
            self._take_row(self.waiting.pop(0))
            promised += need

    def _take_row(self, req: Req) -> None:
        """Give ``req`` a ``req_to_token`` row (and a linear-attention state slot) and run it."""
        req.row = self.req_to_token_pool.alloc(1)[0]
        if self.state_pool is not None:
            self.state_pool.alloc([req.row])
        self.running.append(req)

    def has_room(self, total_tokens: int) -> bool:
        """Whether a request of ``total_tokens`` (prompt + max new tokens) can start now: a free
        row, at most ``max_request_tokens``, and pages for it beside every running request at
        its longest (``_admit``'s rule)."""
        promised = sum(self._pages_needed(r) for r in self.running)
        pages = -(-total_tokens // self.page_size)
        return (self.req_to_token_pool.available_size() > 0
                and total_tokens <= self.max_request_tokens
                and promised + pages <= len(self.allocator.free_pages))

    def admit_prefilled(self, req: Req) -> None:
        """Run ``req``, whose prompt another engine prefilled (a disaggregated prefill), from its
        next decode step: a row, a state slot and slots for the whole prompt, taken in
        ``chunked_prefill_size`` chunks as a local prefill takes them (a hybrid pool evicts
        window pages the same way). The caller writes the prompt's state into those slots
        (``compile.engine.kv_transfer``) and checks ``has_room`` first.

        Raises:
            ValueError: ``req`` holds a row already, or does not fit (``has_room`` of its prompt
                plus ``max_new_tokens``); nothing changes then.
        """
        total = len(req.prompt_ids) + req.sampling.max_new_tokens
        if req.row is not None or not self.has_room(total):
            why = "holds a row already" if req.row is not None else "does not fit"
            raise ValueError(
                f"Engine.admit_prefilled: req {why}; expected a request without a row that "
                f"has_room({total}) accepts (a free row, at most max_request_tokens="
                f"{self.max_request_tokens} tokens, pages beside the running requests), got "
                f"request {req.rid} (row {req.row}) with {len(self.allocator.free_pages)} free "
                "pages. Check has_room first.")
        self._take_row(req)
        n = len(req.prompt_ids)
        while req.num_cached < n:
            self._alloc(req, min(self.chunked_prefill_size, n - req.num_cached))

    def release(self, req: Req, reason: str) -> None:
        """Finish running ``req`` with ``reason``: free its row, pages (and SWA pages, state
        slot) and drop it from ``running``.

        Raises:
            ValueError: ``req`` is not one of ``running`` (waiting, released already, or
                another engine's); nothing changes then.
        """
        if not any(r is req for r in self.running):
            state = ("released" if req.finish_reason is not None else
                     "waiting" if any(r is req for r in self.waiting) else "not this engine's")
            raise ValueError(f"Engine.release: req is not running; expected a request of "
                             f"Engine.running, got request {req.rid} ({state}). Release a "
                             "request once, after it was admitted.")
        req.finish_reason = reason
        if self.swa_pages is not None:
            self.swa_pages.release(req.row, req.pages)
        self.allocator.free(req.pages)
        if self.state_pool is not None:
            self.state_pool.free([req.row])
        self.req_to_token_pool.free(req.row)
        req.pages, req.row = [], None
        self.running.remove(req)

    def _alloc(self, req: Req, num_new: int) -> Tensor:
        """Slots [num_new] int64 for the request's next ``num_new`` tokens (page aligned); with
        a hybrid pool, SWA pages past the window are freed first and new pages mapped after."""
        if self.swa_pages is not None:
            self.swa_pages.evict(req.row, req.pages, req.num_cached)
        loc = self.allocator.alloc_extend(self.req_to_token_pool, req.row, req.num_cached,
                                          num_new)
        end = req.num_cached + num_new
        owned = -(-end // self.page_size)
        if owned > len(req.pages):  # record the pages the allocator just handed out
            table = self.req_to_token_pool.req_to_token[req.row]
            firsts = table[len(req.pages) * self.page_size:end:self.page_size]
            req.pages.extend((firsts.long() // self.page_size).tolist())
        req.num_cached = end
        if self.swa_pages is not None:
            self.swa_pages.map_new(req.row, req.pages)
        return loc

    # ----------------------------------------------------------------- steps
    def step(self) -> list[Req]:
        """Run one EXTEND or DECODE step; returns the requests that finished in it."""
        if self.disagg is not None:
            self.disagg.poll()  # sends done / requests arrived
        self._admit()
        prefilling = [r for r in self.running if r.num_cached < len(r.prompt_ids)]
        if prefilling:
            return self._extend_step(prefilling)
        if not self.running:
            if self.waiting:
                raise RuntimeError("Engine.step: the oldest waiting request does not fit in the "
                                   "KV pool; raise max_total_tokens or max_running.")
            return []
        return self._decode_step(list(self.running))

    def _extend_step(self, reqs: list[Req]) -> list[Req]:
        budget, chunks = self.chunked_prefill_size, []
        for req in reqs:
            n = min(len(req.prompt_ids) - req.num_cached, budget)
            if n <= 0:
                break
            chunks.append((req, req.num_cached, n))
            budget -= n
        ids = [t for req, start, n in chunks for t in req.prompt_ids[start:start + n]]
        positions = [p for _, start, n in chunks for p in range(start, start + n)]
        locs = [self._alloc(req, n) for req, _, n in chunks]
        batch = self._batch(ForwardMode.EXTEND, [c[0] for c in chunks], torch.cat(locs),
                            positions,
                            extend_seq_lens=torch.tensor([n for *_, n in chunks]),
                            extend_prefix_lens=torch.tensor([s for _, s, _ in chunks]))
        t0 = time.perf_counter()
        logits = self._run(batch, ids, positions)
        done = [req.num_cached == len(req.prompt_ids) for req, *_ in chunks]
        finish = getattr(self.disagg, "finish_prefill", self._sample_and_finish)
        finished = finish(
            [c[0] for c, d in zip(chunks, done) if d], logits[torch.tensor(done)])
        self.stats.prefill_tokens += len(ids)
        self.stats.prefill_seconds += time.perf_counter() - t0
        return finished

    def _decode_step(self, reqs: list[Req]) -> list[Req]:
        ids = [req.output_ids[-1] for req in reqs]
        positions = [req.seq_len - 1 for req in reqs]
        loc = torch.cat([self._alloc(req, 1) for req in reqs])
        batch = self._batch(ForwardMode.DECODE, reqs, loc, positions)
        events = compile_events(self.forward)
        t0 = time.perf_counter()
        logits = self._run(batch, ids, positions)
        finished = self._sample_and_finish(reqs, logits)
        seconds = time.perf_counter() - t0
        if compile_events(self.forward) != events:
            self.stats.compiled_decode_steps.add(len(self.stats.decode_step_log))
        self.stats.decode_tokens += len(reqs)
        self.stats.decode_seconds += seconds
        self.stats.decode_step_log.append((len(reqs), seconds))
        return finished

    def _batch(self, mode: ForwardMode, reqs: list[Req], out_cache_loc: Tensor,
               positions: list[int], **extend) -> ForwardBatch:
        dev = self.device
        seq_lens_cpu = torch.tensor([r.num_cached for r in reqs], dtype=torch.int32)
        extend = {k: v.to(dev, torch.int32) for k, v in extend.items()}
        batch = ForwardBatch(
            forward_mode=mode, batch_size=len(reqs),
            req_pool_indices=torch.tensor([r.row for r in reqs], dtype=torch.int64, device=dev),
            seq_lens=seq_lens_cpu.to(dev), seq_lens_cpu=seq_lens_cpu,
            out_cache_loc=out_cache_loc.to(dev, torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev), **extend)
        batch.attn_backend = self.attn_backend
        batch.token_to_kv_pool = self.token_to_kv_pool
        batch.req_to_token_pool = self.req_to_token_pool
        self.last_batch, self.last_batch_reqs = batch, list(reqs)
        return batch

    def _run(self, batch: ForwardBatch, ids: list[int], positions: list[int]) -> Tensor:
        self.stats.steps += 1
        if not getattr(self.forward, "builds_metadata", False):
            self.attn_backend.init_forward_metadata(batch)  # host side, outside the model
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            return self.forward(input_ids, batch.positions, batch)

    def _sample_and_finish(self, reqs: list[Req], logits: Tensor) -> list[Req]:
        if not reqs:
            return []
        temps = torch.tensor([r.sampling.temperature for r in reqs], device=logits.device)
        tokens = sample(logits, temps, self.generator).tolist()  # the step's one host sync
        finished = []
        for req, tok in zip(reqs, tokens):
            req.output_ids.append(tok)
            if tok in req.sampling.stop_token_ids:
                self.release(req, "stop")
            elif len(req.output_ids) >= req.sampling.max_new_tokens:
                self.release(req, "length")
            else:
                continue
            finished.append(req)
        return finished

    # ----------------------------------------------------------------- driver
    def generate(self, prompts: Sequence[Sequence[int]], sampling: Optional[SamplingParams] = None,
                 on_step: Optional[Callable[[list[Req]], None]] = None) -> list[list[int]]:
        """Run ``prompts`` (and any request queued before) to completion; returns the generated
        token ids of each prompt, in order. Every prompt is checked before any is queued
        (``add_requests``)."""
        reqs = self.add_requests(prompts, sampling)
        while self.has_work():
            finished = self.step()
            if on_step is not None:
                on_step(finished)
        return [r.output_ids for r in reqs]


def _use_swa_pool(layout: KVLayout, swa_pool: Optional[bool]) -> bool:
    """Whether the engine builds a hybrid SWA pool for ``layout`` (see ``Engine``'s
    ``swa_pool``)."""
    has_swa = bool(layout.swa_layer_ids)
    if swa_pool and not has_swa:
        raise ValueError(f"Engine: swa_pool=True needs sliding_attention layers; expected a "
                         f"model with some, got none of its {layout.num_layers} layers with a "
                         "sliding window. Leave swa_pool=None.")
    return has_swa if swa_pool is None else swa_pool


def _check_kv_dtype(kv_dtype) -> None:
    """``TypeError`` unless ``kv_dtype`` is None or a ``torch.dtype``; ``ValueError`` unless a
    floating-point one (the model's dtype, float32/16, bfloat16 or an fp8 format)."""
    if kv_dtype is None:
        return
    if not isinstance(kv_dtype, torch.dtype):
        raise TypeError(f"Engine: kv_dtype has type {type(kv_dtype).__name__}; expected None or "
                        f"a torch.dtype (e.g. torch.float8_e4m3fn), got {kv_dtype!r}.")
    if not kv_dtype.is_floating_point:
        raise ValueError(f"Engine: kv_dtype is not a floating-point dtype; expected None or a "
                         f"float, bfloat16 or fp8 torch.dtype, got {kv_dtype}.")


def _check_sizes(**sizes: int) -> None:
    """Raise unless every keyword (an ``Engine`` size argument) is an integer >= 1."""
    for name, value in sizes.items():
        check_positive_int("Engine", name, value)


__all__ = ["Engine", "Req", "SamplingParams", "EngineStats", "DecodeTotals", "compile_events",
           "sample"]
