"""``DSATokenToKVPool``: the MLA latent pool plus the DSA index-key cache beside it (sglang's
``NSATokenToKVPool`` role).

DeepSeek-V3.2's lightning indexer keeps, per layer and token, one fp8 index key of ``Di``
features and its float32 scale, in the paged layout DeepGEMM's ``fp8_paged_mqa_logits`` reads
(``xpu_ops.index_k_layout``: ``uint8 [num_pages, page_size, 1, Di + 4]``, each page's fp8 keys
then its scales). Token slot ``s`` is the same slot in the latent cache and in the index-key
cache (page ``s // page_size``, row ``s % page_size``), so one page table serves both.
Pools know nothing of layers: callers pass layer ids.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

import xpu_ops
from xpu_ops.index_k_layout import SCALE_BYTES

from compile.batch.memory_pool import MLATokenToKVPool, layer_buffers


class DSATokenToKVPool(MLATokenToKVPool):
    """``MLATokenToKVPool`` plus one index-key cache per layer.

    Args:
        index_head_dim: Di, features of an index key (a multiple of 4).
        other arguments: as ``MLATokenToKVPool``.
    Raises:
        ValueError: ``size`` not a multiple of ``page_size`` or ``index_head_dim`` not a
            positive multiple of 4.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, kv_lora_rank: int,
                 qk_rope_head_dim: int, layer_num: int, device: torch.device | str,
                 start_layer: int = 0, kv_sharing: Sequence[tuple[int, int]] = (), *,
                 index_head_dim: int):
        if index_head_dim <= 0 or index_head_dim % 4:
            raise ValueError(f"DSATokenToKVPool: index_head_dim is not a positive multiple of 4; "
                             f"expected the indexer's head dim, got {index_head_dim}.")
        super().__init__(size, page_size, dtype, kv_lora_rank, qk_rope_head_dim, layer_num,
                         device, start_layer, kv_sharing)
        self.index_head_dim = index_head_dim
        self.index_k_with_scale_buffer = layer_buffers(
            layer_num, start_layer, kv_sharing, lambda: torch.zeros(
                (size // page_size, page_size, 1, index_head_dim + SCALE_BYTES),
                dtype=torch.uint8, device=self.device))

    def get_index_k_with_scale_buffer(self, layer_id: int) -> Tensor:
        """``uint8 [num_pages, page_size, 1, Di + 4]`` index-key cache of ``layer_id``."""
        return self.index_k_with_scale_buffer[layer_id - self.start_layer]

    def set_index_k_buffer(self, layer_id: int, loc: Tensor, index_k: Tensor) -> None:
        """Quantise ``index_k [N, Di]`` into slots ``loc [N]`` of ``layer_id``'s index-key
        cache (``xpu_ops.store_index_k_cache``: per-token scale ``amax / 448``)."""
        xpu_ops.store_index_k_cache(self.get_index_k_with_scale_buffer(layer_id), loc, index_k)

    def index_bytes_per_token(self) -> int:
        """Bytes of one token's index key and scale in one layer (``Di + 4``)."""
        return self.index_head_dim + SCALE_BYTES


__all__ = ["DSATokenToKVPool"]
