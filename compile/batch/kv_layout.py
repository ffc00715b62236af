"""``KVLayout``: the plain facts that size a model's KV pools, and the pool they give.

Pools know nothing of layers or models: whoever owns the model derives a ``KVLayout`` from its
attention layers (``compile.backend.layer.kv_layout(model)``) and the engine sizes the pools
from it (``make_kv_pool`` here, ``compile.batch.swa_pages.hybrid_kv_pool`` for a hybrid
sliding-window pool, ``compile.batch.swa_pages.kv_cache_bytes`` for the bytes either takes).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from compile.batch.dsa_pool import DSATokenToKVPool
from compile.batch.memory_pool import MHATokenToKVPool, MLATokenToKVPool


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """KV-cache shape of one model, in the pools' terms.

    Attributes:
        num_layers: KV layer ids ``0 .. num_layers - 1`` (global layer ids).
        head_num: Hkv. head_dim: D. v_head_dim: Dv (MLA: D = R + r, Dv = R).
        swa_layer_ids: ids of the sliding-window layers, ascending (their KV may live in a
            smaller SWA pool); empty without such layers.
        sliding_window: W, tokens a sliding-window query sees (Hugging Face's
            ``sliding_window``; the largest over ``swa_layer_ids``), None without such layers.
        kv_lora_rank: R of an MLA latent cache ``[num_slots, 1, R + r]`` (0: not MLA).
        kv_sharing: ``(layer, target)`` of each layer that reads ``target``'s cache (cross-layer
            KV sharing); such layers get no buffers of their own.
        linear_layer_ids: ids below ``num_layers`` of linear-attention layers (their state
            lives in ``compile.batch.state_pool.LinearStatePool``); they get no KV buffers.
        index_head_dim: Di of a DSA index-key cache beside the MLA latent cache (DeepSeek-V3.2's
            lightning indexer; ``compile.batch.dsa_pool``); 0: none.
    """

    num_layers: int
    head_num: int
    head_dim: int
    v_head_dim: int
    swa_layer_ids: tuple[int, ...] = ()
    sliding_window: Optional[int] = None
    kv_lora_rank: int = 0
    kv_sharing: tuple[tuple[int, int], ...] = ()
    linear_layer_ids: tuple[int, ...] = ()
    index_head_dim: int = 0

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        """Ids of the layers that are not sliding-window layers, ascending."""
        swa = set(self.swa_layer_ids)
        return tuple(i for i in range(self.num_layers) if i not in swa)

    @property
    def cache_layer_ids(self) -> tuple[int, ...]:
        """Ids of the layers with a cache of their own (not in ``kv_sharing`` nor
        ``linear_layer_ids``), ascending."""
        shared = {lid for lid, _ in self.kv_sharing} | set(self.linear_layer_ids)
        return tuple(i for i in range(self.num_layers) if i not in shared)

    @property
    def pool_sharing(self) -> tuple[tuple[int, int], ...]:
        """``kv_sharing`` plus each linear-attention layer aliased to the first layer with a
        cache: what the pools take as ``kv_sharing``, so linear layers cost no KV memory
        (nothing reads or writes their alias)."""
        if not self.linear_layer_ids:
            return self.kv_sharing
        owner = self.cache_layer_ids[0]
        return self.kv_sharing + tuple((lid, owner) for lid in self.linear_layer_ids)

    @property
    def qk_rope_head_dim(self) -> int:
        """r, the rope part of an MLA latent row (``head_dim - kv_lora_rank``; 0: not MLA)."""
        return self.head_dim - self.kv_lora_rank if self.kv_lora_rank else 0


def check_layout(function: str, layout) -> None:
    """``TypeError`` unless ``layout`` is a ``KVLayout`` (e.g. a model config was passed)."""
    if not isinstance(layout, KVLayout):
        raise TypeError(f"{function}: layout must be a KVLayout; expected the model's KV facts, "
                        f"got {type(layout).__name__}. Pass compile.backend.kv_layout(model).")


def make_kv_pool(layout: KVLayout, size: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> MHATokenToKVPool | MLATokenToKVPool:
    """One pool holding every layer of ``layout``: ``MLATokenToKVPool`` when ``kv_lora_rank``
    (``DSATokenToKVPool`` with an ``index_head_dim`` too), else ``MHATokenToKVPool``;
    ``size`` token slots per layer (page 0 included).

    Raises:
        TypeError: ``layout`` is not a ``KVLayout``.

    >>> import torch
    >>> from compile.batch.kv_layout import KVLayout, make_kv_pool
    >>> pool = make_kv_pool(KVLayout(num_layers=2, head_num=1, head_dim=8, v_head_dim=8),
    ...                     size=32, page_size=16, dtype=torch.float32, device="cpu")
    >>> tuple(pool.get_key_buffer(1).shape)
    (32, 1, 8)
    """
    check_layout("make_kv_pool", layout)
    if layout.kv_lora_rank and layout.index_head_dim:
        return DSATokenToKVPool(size, page_size, dtype, layout.kv_lora_rank,
                                layout.qk_rope_head_dim, layout.num_layers, device,
                                kv_sharing=layout.kv_sharing,
                                index_head_dim=layout.index_head_dim)
    if layout.kv_lora_rank:
        return MLATokenToKVPool(size, page_size, dtype, layout.kv_lora_rank,
                                layout.qk_rope_head_dim, layout.num_layers, device,
                                kv_sharing=layout.pool_sharing)
    return MHATokenToKVPool(size, page_size, dtype, layout.head_num, layout.head_dim,
                            layout.num_layers, device, v_head_dim=layout.v_head_dim,
                            kv_sharing=layout.pool_sharing)


__all__ = ["KVLayout", "check_layout", "make_kv_pool"]
