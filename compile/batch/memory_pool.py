"""Request-to-token table, token KV pools (MHA, hybrid sliding-window, MLA) and a page allocator.

Layout (sglang's): ``req_to_token[row, i]`` is the token slot of request ``row``'s ``i``-th token.
A KV pool keeps one flat buffer per layer, ``[num_slots, Hkv, D]``; slot ``s`` lives in page
``s // page_size`` at offset ``s % page_size``, so the same storage viewed as
``[num_pages, page_size, Hkv, D]`` is the paged cache the attention ops read. Page 0 (slots
``0 .. page_size - 1``) is reserved as padding: allocators never hand it out, so index tensors
padded with 0 point at harmless memory.

Every write goes through ``xpu_ops.store_kv_cache`` / ``xpu_ops.store_mla_kv_cache`` (an
eager unscaled MHA write through the ``torch.ops.xpu_ops.store_kv_cache`` op directly, outside
the debug switch); the caller's K/V tensors are never modified.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch import Tensor

import xpu_ops
from xpu_ops._value_checks import debug_checks_enabled


class ReqToTokenPool:
    """Token-granular table ``req_to_token [size, max_context_len]`` int32 of token slots.

    Args:
        size: number of request rows. max_context_len: tokens per row.
        device: where the table lives.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str):
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32,
                                        device=self.device)
        self.free_slots = list(range(size))

    def available_size(self) -> int:
        """Free request rows."""
        return len(self.free_slots)

    def alloc(self, need_size: int) -> Optional[list[int]]:
        """Take ``need_size`` free rows (None when not enough are free, as sglang)."""
        if need_size > len(self.free_slots):
            return None
        rows, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return rows

    def free(self, rows: int | Sequence[int]) -> None:
        """Return request rows (one int or several) to the free list."""
        self.free_slots.extend([rows] if isinstance(rows, int) else list(rows))

    def write(self, index, values: Tensor) -> None:
        """``req_to_token[index] = values`` (index as numpy/torch basic or advanced indexing)."""
        self.req_to_token[index] = values.to(torch.int32)


class PageAllocator:
    """Hands out whole pages; token slots of a request are page aligned (page_size 1 or more).

    Args:
        num_pages: pages in the pool, page 0 included (it is reserved and never handed out).
        page_size: tokens per page. device: device of the returned slot tensors.
        generator: optional ``torch.Generator``; when given the free list is shuffled, so pages
            are handed out in random order (tests use this to catch page-table mistakes).
    """

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str,
                 generator: Optional[torch.Generator] = None):
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"PageAllocator: num_pages/page_size are too small; expected "
                             f"num_pages >= 2 and page_size >= 1, got {num_pages}, {page_size}.")
        self.num_pages, self.page_size = num_pages, page_size
        self.device = torch.device(device)
        free = torch.arange(1, num_pages)
        if generator is not None:
            free = free[torch.randperm(num_pages - 1, generator=generator)]
        self.free_pages = free.tolist()

    def available_size(self) -> int:
        """Free token slots."""
        return len(self.free_pages) * self.page_size

    def alloc_pages(self, n: int) -> list[int]:
        """Take ``n`` free page ids; ``RuntimeError`` when fewer than ``n`` are free."""
        if n > len(self.free_pages):
            raise RuntimeError(f"PageAllocator.alloc_pages: out of pages; asked for {n}, "
                               f"{len(self.free_pages)} free. Free finished requests first.")
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return page ids to the free list."""
        self.free_pages.extend(int(p) for p in pages)

    def alloc_extend(self, req_to_token_pool: ReqToTokenPool, row: int, prefix_len: int,
                     num_new: int) -> Tensor:
        """Slots for tokens ``prefix_len .. prefix_len + num_new - 1`` of request ``row``.

        Positions inside the request's last, partly filled page reuse it; the others get new
        pages. ``req_to_token[row]`` is updated.
        Returns:
            [num_new] int64 token slots (the ``out_cache_loc`` of these tokens).
        """
        ps = self.page_size
        end = prefix_len + num_new
        first_new_page = (prefix_len + ps - 1) // ps          # logical page index
        num_pages_needed = (end + ps - 1) // ps - first_new_page
        table = req_to_token_pool.req_to_token
        old = table[row, :first_new_page * ps:ps].long() // ps if first_new_page else None
        new = torch.tensor(self.alloc_pages(max(num_pages_needed, 0)), dtype=torch.long)
        pages = new if old is None else torch.cat([old.cpu(), new])
        slots = (pages[:, None] * ps + torch.arange(ps)).reshape(-1)[:end]
        table[row, :end] = slots.to(device=table.device, dtype=torch.int32)
        return slots[prefix_len:end].to(self.device)


@dataclasses.dataclass
class KVWriteLoc:
    """Where this step's new K/V go, per cache kind (built once per batch by the backend).

    Attributes:
        loc: [N] int64 slots in the full pool (``out_cache_loc``).
        swa_loc: [N] int64 slots in the sliding-window pool, or None without one.
        encoder_loc: [sum encoder_lens] int64 slots of encoder tokens (cross attention) or None.
    """

    loc: Tensor
    swa_loc: Optional[Tensor] = None
    encoder_loc: Optional[Tensor] = None


def layer_buffers(layer_num: int, start_layer: int, kv_sharing: Sequence[tuple[int, int]],
                  make) -> list[Tensor]:
    """One buffer per layer id ``start_layer .. start_layer + layer_num - 1``: ``make()`` for
    each layer with a cache of its own; for each ``(layer, target)`` of ``kv_sharing`` (cross-layer
    KV sharing: the layer reads ``target``'s cache, writes none) the target's buffer itself, so
    sharing layers cost no memory."""
    targets = dict(kv_sharing)
    buffers = {i: make() for i in range(start_layer, start_layer + layer_num) if i not in targets}
    return [buffers[targets.get(i, i)] for i in range(start_layer, start_layer + layer_num)]


class MHATokenToKVPool:
    """Per-layer K and V buffers ``[num_slots, Hkv, D]`` (and ``Dv``) for multi-head attention.

    Args:
        size: token slots per layer (page 0 included, so ``size // page_size - 1`` usable pages).
        page_size: tokens per page; ``size`` must be a multiple of it.
        dtype: cache dtype (a float dtype, or fp8 with per-layer scales on write and read).
        head_num: Hkv. head_dim: D. layer_num: number of layers. v_head_dim: Dv (default D).
        start_layer: first layer id stored here (pipeline stages; layer ids are global).
        kv_sharing: ``(layer, target)`` pairs of layers that read ``target``'s cache and have
            no buffers of their own (``layer_buffers``).
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int,
                 head_dim: int, layer_num: int, device: torch.device | str,
                 v_head_dim: Optional[int] = None, start_layer: int = 0,
                 kv_sharing: Sequence[tuple[int, int]] = ()):
        if size % page_size:
            raise ValueError(f"MHATokenToKVPool: size is not a multiple of page_size; expected "
                             f"size % {page_size} == 0, got size={size}.")
        self.size, self.page_size, self.dtype = size, page_size, dtype
        self.head_num, self.head_dim = head_num, head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.layer_num, self.start_layer = layer_num, start_layer
        self.device = torch.device(device)
        self.k_buffer = layer_buffers(layer_num, start_layer, kv_sharing, lambda: torch.zeros(
            (size, head_num, head_dim), dtype=dtype, device=self.device))
        self.v_buffer = layer_buffers(layer_num, start_layer, kv_sharing, lambda: torch.zeros(
            (size, head_num, self.v_head_dim), dtype=dtype, device=self.device))
        # (layer_id, page_size, inference mode) -> (K, V, paged K, paged V), see get_paged_kv
        self._paged_views: dict[tuple, tuple[Tensor, Tensor, Tensor, Tensor]] = {}

    @property
    def num_pages(self) -> int:
        """Pages per layer (``size // page_size``, page 0 included)."""
        return self.size // self.page_size

    def get_key_buffer(self, layer_id: int) -> Tensor:
        """[num_slots, Hkv, D] of layer ``layer_id``."""
        return self.k_buffer[layer_id - self.start_layer]

    def get_value_buffer(self, layer_id: int) -> Tensor:
        """[num_slots, Hkv, Dv] of layer ``layer_id``."""
        return self.v_buffer[layer_id - self.start_layer]

    def get_kv_buffer(self, layer_id: int) -> tuple[Tensor, Tensor]:
        """``(K [num_slots, Hkv, D], V [num_slots, Hkv, Dv])`` of layer ``layer_id``."""
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def get_paged_kv(self, layer_id: int, page_size: Optional[int] = None
                     ) -> tuple[Tensor, Tensor]:
        """K/V of a layer viewed as pages ``[num_pages, page_size, Hkv, D]`` (a view, no copy).

        ``page_size=1`` gives the token-granular view used with slot-valued page tables.
        """
        ps = self.page_size if page_size is None else page_size
        k, v = self.get_kv_buffer(layer_id)
        if torch.compiler.is_compiling():  # traced: plain views, no Python-side cache
            return k.view(-1, ps, *k.shape[1:]), v.view(-1, ps, *v.shape[1:])
        # Eager (piecewise attention runs here once per layer and step): reuse the views while
        # the layer's buffers are the same tensors (views made in and out of inference mode
        # are kept apart, as autograd treats them differently).
        key = (layer_id, ps, torch.is_inference_mode_enabled())
        hit = self._paged_views.get(key)
        if hit is None or hit[0] is not k or hit[1] is not v:
            hit = (k, v, k.view(-1, ps, *k.shape[1:]), v.view(-1, ps, *v.shape[1:]))
            self._paged_views[key] = hit
        return hit[2], hit[3]

    def set_kv_buffer(self, layer, loc: Tensor, cache_k: Tensor, cache_v: Tensor,
                      k_scale=None, v_scale=None) -> None:
        """Write ``cache_k [N, Hkv, D]``/``cache_v`` into slots ``loc [N]`` of ``layer``'s buffers.

        ``layer`` is an attention layer (its ``layer_id``) or an int layer id. fp8 caches divide by
        ``k_scale``/``v_scale`` first (inside ``store_kv_cache``).
        """
        layer_id = layer if isinstance(layer, int) else layer.layer_id
        k_buf, v_buf = self.get_kv_buffer(layer_id)
        if (k_scale is None and v_scale is None and not torch.compiler.is_compiling()
                and not debug_checks_enabled()):
            # eager, unscaled (a decode layer's store): the op itself, which checks the shapes;
            # the wrapper adds scale handling and, under the debug switch, the slot checks
            torch.ops.xpu_ops.store_kv_cache.default(k_buf, v_buf, loc, cache_k, cache_v, None,
                                                     None)
            return
        xpu_ops.store_kv_cache(k_buf, v_buf, loc, cache_k, cache_v,
                               k_scale=k_scale, v_scale=v_scale)


class SWAKVPool:
    """Hybrid pool: full-attention layers in one MHA pool, sliding-window layers in a smaller one.

    The engine allocates every token a slot in the full pool (the ``req_to_token`` value) and,
    while it is inside the window, a slot in the SWA pool; ``full_to_swa_index_mapping[full_slot]``
    is that SWA slot (0, the padding slot, once evicted). Mapping is kept page aligned: a full
    page maps onto one SWA page (``map_pages``), so translated page tables stay page tables.

    Args:
        size: slots of the full pool. size_swa: slots of the SWA pool.
        swa_attention_layer_ids / full_attention_layer_ids: global layer ids of each kind.
        page_size, dtype, head_num, head_dim, device, v_head_dim: as ``MHATokenToKVPool``.
        kv_sharing: as ``MHATokenToKVPool``'s; a sharing layer is of its target's kind.
    """

    def __init__(self, size: int, size_swa: int, swa_attention_layer_ids: Sequence[int],
                 full_attention_layer_ids: Sequence[int], page_size: int, dtype: torch.dtype,
                 head_num: int, head_dim: int, device: torch.device | str,
                 v_head_dim: Optional[int] = None, kv_sharing: Sequence[tuple[int, int]] = ()):
        self.size, self.size_swa, self.page_size, self.dtype = size, size_swa, page_size, dtype
        self.device = torch.device(device)
        kw = dict(page_size=page_size, dtype=dtype, head_num=head_num, head_dim=head_dim,
                  device=device, v_head_dim=v_head_dim)

        def local(ids):  # kv_sharing in the indices of one kind's pool
            index = {lid: i for i, lid in enumerate(ids)}
            return [(index[lid], index[t]) for lid, t in kv_sharing if lid in index]
        self.full_kv_pool = MHATokenToKVPool(size, layer_num=len(full_attention_layer_ids),
                                             kv_sharing=local(full_attention_layer_ids), **kw)
        self.swa_kv_pool = MHATokenToKVPool(size_swa, layer_num=len(swa_attention_layer_ids),
                                            kv_sharing=local(swa_attention_layer_ids), **kw)
        self.layers_mapping: dict[int, tuple[int, bool]] = {}
        for i, lid in enumerate(full_attention_layer_ids):
            self.layers_mapping[lid] = (i, False)
        for i, lid in enumerate(swa_attention_layer_ids):
            self.layers_mapping[lid] = (i, True)
        self.full_to_swa_index_mapping = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.head_num, self.head_dim = head_num, head_dim
        self.v_head_dim = self.full_kv_pool.v_head_dim

    def is_swa_layer(self, layer_id: int) -> bool:
        """True when ``layer_id`` is a sliding-window layer (stored in the SWA pool)."""
        return self.layers_mapping[layer_id][1]

    def _pool(self, layer_id: int) -> tuple[MHATokenToKVPool, int]:
        idx, is_swa = self.layers_mapping[layer_id]
        return (self.swa_kv_pool if is_swa else self.full_kv_pool), idx

    def get_key_buffer(self, layer_id: int) -> Tensor:
        """[num_slots, Hkv, D] of ``layer_id``, from the SWA or the full pool."""
        pool, idx = self._pool(layer_id)
        return pool.get_key_buffer(idx)

    def get_value_buffer(self, layer_id: int) -> Tensor:
        """[num_slots, Hkv, Dv] of ``layer_id``, from the SWA or the full pool."""
        pool, idx = self._pool(layer_id)
        return pool.get_value_buffer(idx)

    def get_kv_buffer(self, layer_id: int) -> tuple[Tensor, Tensor]:
        """``(K, V)`` buffers of ``layer_id`` from the pool that holds it."""
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def get_paged_kv(self, layer_id: int, page_size: Optional[int] = None):
        """Paged K/V views ``[num_pages, page_size, Hkv, D]`` of ``layer_id`` from its pool."""
        pool, idx = self._pool(layer_id)
        return pool.get_paged_kv(idx, page_size)

    def translate_loc_from_full_to_swa(self, kv_indices: Tensor) -> Tensor:
        """Full-pool slots -> SWA-pool slots (same shape and dtype as ``kv_indices``)."""
        return self.full_to_swa_index_mapping[kv_indices.long()].to(kv_indices.dtype)

    def map_pages(self, full_pages: Sequence[int], swa_pages: Sequence[int]) -> None:
        """Map every slot of full page ``full_pages[i]`` to the same offset in ``swa_pages[i]``."""
        ps = self.page_size
        offs = torch.arange(ps)
        full = (torch.as_tensor(list(full_pages))[:, None] * ps + offs).reshape(-1)
        swa = (torch.as_tensor(list(swa_pages))[:, None] * ps + offs).reshape(-1)
        self.full_to_swa_index_mapping[full.to(self.device)] = swa.to(self.device)

    def set_kv_buffer(self, layer, loc: Tensor, cache_k: Tensor, cache_v: Tensor,
                      k_scale=None, v_scale=None, loc_is_swa: bool = False) -> None:
        """Write K/V of ``layer``; full-pool ``loc`` is translated for SWA layers unless
        ``loc_is_swa`` says it already was."""
        layer_id = layer if isinstance(layer, int) else layer.layer_id
        pool, idx = self._pool(layer_id)
        if self.is_swa_layer(layer_id) and not loc_is_swa:
            loc = self.translate_loc_from_full_to_swa(loc)
        pool.set_kv_buffer(idx, loc, cache_k, cache_v, k_scale, v_scale)


class MLATokenToKVPool:
    """Per-layer latent cache ``[num_slots, 1, R + r]``: compressed KV (R) then rope key (r).

    Args:
        size: token slots per layer. page_size: tokens per page. dtype: cache dtype.
        kv_lora_rank: R. qk_rope_head_dim: r. layer_num, device, start_layer, kv_sharing: as
            MHA.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, kv_lora_rank: int,
                 qk_rope_head_dim: int, layer_num: int, device: torch.device | str,
                 start_layer: int = 0, kv_sharing: Sequence[tuple[int, int]] = ()):
        if size % page_size:
            raise ValueError(f"MLATokenToKVPool: size is not a multiple of page_size; expected "
                             f"size % {page_size} == 0, got size={size}.")
        self.size, self.page_size, self.dtype = size, page_size, dtype
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.layer_num, self.start_layer = layer_num, start_layer
        self.device = torch.device(device)
        width = self.row_width(kv_lora_rank, qk_rope_head_dim, dtype)
        self.kv_buffer = layer_buffers(layer_num, start_layer, kv_sharing, lambda: torch.zeros(
            (size, 1, width), dtype=dtype, device=self.device))

    def row_width(self, kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype) -> int:
        """Elements of one token's cache row: ``R + r`` (a subclass may store another layout)."""
        return kv_lora_rank + qk_rope_head_dim

    def get_key_buffer(self, layer_id: int) -> Tensor:
        """[num_slots, 1, R + r] latent cache of ``layer_id``."""
        return self.kv_buffer[layer_id - self.start_layer]

    def get_value_buffer(self, layer_id: int) -> Tensor:
        """[num_slots, 1, R] latent part (a view)."""
        return self.get_key_buffer(layer_id)[..., :self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int) -> tuple[Tensor, Tensor]:
        """``(latent cache [num_slots, 1, R + r], its latent part [num_slots, 1, R])``."""
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_mla_kv_buffer(self, layer, loc: Tensor, cache_k_nope: Tensor,
                          cache_k_rope: Tensor) -> None:
        """Write ``cat(k_nope [N, 1, R], k_rope [N, 1, r])`` into slots ``loc``."""
        layer_id = layer if isinstance(layer, int) else layer.layer_id
        xpu_ops.store_mla_kv_cache(self.get_key_buffer(layer_id), loc, cache_k_nope,
                                   cache_k_rope)

    def set_kv_buffer(self, layer, loc: Tensor, cache_k: Tensor, cache_v=None,
                      k_scale=None, v_scale=None) -> None:
        """Write a whole latent row ``cache_k [N, 1, R + r]`` (``cache_v`` is ignored)."""
        r = self.kv_lora_rank
        self.set_mla_kv_buffer(layer, loc, cache_k[..., :r], cache_k[..., r:])


__all__ = ["ReqToTokenPool", "PageAllocator", "KVWriteLoc",
           "MHATokenToKVPool", "SWAKVPool", "MLATokenToKVPool"]
