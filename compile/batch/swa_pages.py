"""Sliding-window pages of a hybrid KV pool: local layers keep only their window.

A hybrid ``SWAKVPool`` stores full-attention layers in a pool with a slot for every token and
sliding-window layers in a smaller one. ``SWAPageAllocator`` does the engine's side of it, as
sglang's ``SWATokenToKVPoolAllocator`` and its SWA eviction do: every full page a request takes
is mapped onto a free SWA page, and once the request's next query is far enough that no later
query can see a page (window ``W``: a query at position ``p`` sees keys ``p - W + 1 .. p``), that
SWA page is freed and the full page is mapped back onto the padding page 0. Translated page
tables then point evicted pages at page 0, which the window mask never reads.

Sizing: a step that appends ``n`` tokens at position ``s`` keeps the keys from ``s - W + 1`` on,
so a request never holds more than ``ceil((W + n + page_size - 2) / page_size)`` SWA pages
(``swa_pages_per_request``); a pool of that many per running request (plus page 0) cannot run
out, so admission only has to check the full pool.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from compile.batch.kv_layout import KVLayout, check_layout
from compile.batch.memory_pool import PageAllocator, SWAKVPool


def swa_pages_per_request(window: int, max_new_tokens_per_step: int, page_size: int,
                          max_context_len: int) -> int:
    """SWA pages one request holds at most (see the module docstring), in pages.

    Args:
        window: W, the Hugging Face ``sliding_window`` (the query and W - 1 keys before it).
        max_new_tokens_per_step: most tokens one request appends in a step (the prefill chunk).
        page_size: tokens per page. max_context_len: tokens per request at most.
    """
    live = window + min(max_new_tokens_per_step, max_context_len) + page_size - 2
    return min(-(-live // page_size), -(-max_context_len // page_size))


class SWAPageAllocator:
    """Hands out and takes back the SWA pages of ``pool`` for each request's full pages.

    Args:
        pool: the hybrid pool; its ``full_to_swa_index_mapping`` is kept up to date.
        window: W (Hugging Face ``sliding_window``) of the sliding-window layers, in tokens.
        device: of the slot tensors (the pool's).
    """

    def __init__(self, pool: SWAKVPool, window: int, device):
        if window < 1:
            raise ValueError(f"SWAPageAllocator: window must be >= 1 token; expected the "
                             f"model's sliding_window, got {window}.")
        self.pool, self.window, self.page_size = pool, window, pool.page_size
        self.allocator = PageAllocator(pool.swa_kv_pool.num_pages, pool.page_size, device)
        self.held: dict[int, dict[int, int]] = {}  # req row -> {logical page: SWA page}
        self.mapped: dict[int, int] = {}  # req row -> logical pages mapped so far

    def available_pages(self) -> int:
        """Free SWA pages."""
        return len(self.allocator.free_pages)

    def evict(self, row: int, full_pages: Sequence[int], next_position: int) -> int:
        """Free the SWA pages of request ``row`` that no query at ``next_position`` or later
        sees; ``full_pages[j]`` is its ``j``-th full page. Returns how many were freed."""
        first_live = max(next_position - self.window + 1, 0) // self.page_size
        held = self.held.get(row, {})
        dead = [j for j in held if j < first_live]
        self._unmap(row, [full_pages[j] for j in dead], dead)
        return len(dead)

    def map_new(self, row: int, full_pages: Sequence[int]) -> None:
        """Give each full page of request ``row`` past the ones mapped before a free SWA page
        (``full_pages`` only grows while the request runs)."""
        new = list(range(self.mapped.get(row, 0), len(full_pages)))
        if not new:
            return
        swa = self.allocator.alloc_pages(len(new))
        self.pool.map_pages([full_pages[j] for j in new], swa)
        self.held.setdefault(row, {}).update(zip(new, swa))
        self.mapped[row] = len(full_pages)

    def release(self, row: int, full_pages: Sequence[int]) -> None:
        """Free every SWA page request ``row`` still holds (it finished)."""
        held = list(self.held.get(row, {}))
        self._unmap(row, [full_pages[j] for j in held], held)
        self.held.pop(row, None)
        self.mapped.pop(row, None)

    def _unmap(self, row: int, full_pages: list[int], logical: list[int]) -> None:
        if not logical:
            return
        held = self.held[row]
        self.allocator.free([held.pop(j) for j in logical])
        self.pool.map_pages(full_pages, [0] * len(full_pages))  # onto the padding page


def hybrid_kv_pool(layout: KVLayout, *, size: int, page_size: int, dtype: torch.dtype, device,
                   max_running: int, prefill_chunk: int, max_context_len: int
                   ) -> tuple[SWAKVPool, SWAPageAllocator]:
    """The engine's hybrid pool for ``layout`` (a ``KVLayout`` with sliding-window layers) and
    its ``SWAPageAllocator``.

    Args:
        size: slots of the full pool (page 0 included). page_size, dtype, device: the pools'.
        max_running: requests at once. prefill_chunk: most new tokens per request and step.
        max_context_len: tokens per request at most.
    The SWA pool holds ``max_running * swa_pages_per_request(...)`` pages plus page 0.
    Raises:
        TypeError: ``layout`` is not a ``KVLayout``.
    """
    check_layout("hybrid_kv_pool", layout)
    per_request = swa_pages_per_request(layout.sliding_window, prefill_chunk, page_size,
                                        max_context_len)
    pool = SWAKVPool(size, (max_running * per_request + 1) * page_size, layout.swa_layer_ids,
                     layout.full_layer_ids, page_size, dtype, layout.head_num, layout.head_dim,
                     device, v_head_dim=layout.v_head_dim, kv_sharing=layout.kv_sharing)
    return pool, SWAPageAllocator(pool, layout.sliding_window, device)


@dataclasses.dataclass
class KVCacheBytes:
    """KV-cache sizes of one model, in bytes: ``full`` with every layer in a full pool,
    ``hybrid`` with the sliding-window layers in an SWA pool."""

    full: int
    hybrid: int

    @property
    def saved_fraction(self) -> float:
        """``1 - hybrid / full``."""
        return 1.0 - self.hybrid / self.full if self.full else 0.0


def kv_cache_bytes(layout: KVLayout, context_len: int, *, page_size: int = 16,
                   prefill_chunk: int = 512, num_requests: int = 1,
                   dtype: torch.dtype = torch.bfloat16) -> KVCacheBytes:
    """Bytes of the K and V buffers ``compile.engine.engine.Engine`` allocates for ``num_requests``
    requests of ``context_len`` tokens, with and without the hybrid SWA pool.

    Args:
        layout: the model's ``KVLayout`` (``compile.backend.layer.kv_layout(model)``).
        context_len: tokens per request. page_size: tokens per page.
        prefill_chunk: the engine's ``chunked_prefill_size`` (new tokens per request and step).
        dtype: cache dtype.
    Raises:
        TypeError: ``layout`` is not a ``KVLayout``.
    """
    check_layout("kv_cache_bytes", layout)
    # per token and layer: K and V rows, or one latent row [R + r] (MLA)
    width = layout.head_dim if layout.kv_lora_rank else layout.head_num * (
        layout.head_dim + layout.v_head_dim)
    per_slot = width * dtype.itemsize + (layout.index_head_dim + 4 if layout.index_head_dim
                                          else 0)  # DSA index key (fp8) and its float32 scale
    full_slots = (-(-num_requests * context_len // page_size) + 1) * page_size  # + page 0
    owners = layout.cache_layer_ids  # KV-sharing layers have no buffers
    n_swa = len(set(layout.swa_layer_ids) & set(owners))
    full = len(owners) * full_slots * per_slot
    if not layout.swa_layer_ids:
        return KVCacheBytes(full=full, hybrid=full)
    swa_pages = swa_pages_per_request(layout.sliding_window, prefill_chunk, page_size,
                                      context_len)
    swa_slots = (num_requests * swa_pages + 1) * page_size
    n_full = len(owners) - n_swa
    return KVCacheBytes(full=full, hybrid=(n_full * full_slots + n_swa * swa_slots) * per_slot)


__all__ = ["SWAPageAllocator", "swa_pages_per_request", "hybrid_kv_pool", "KVCacheBytes",
           "kv_cache_bytes"]
