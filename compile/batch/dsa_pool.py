"""``DSATokenToKVPool``: the MLA latent pool plus the DSA index-key cache beside it (sglang's
``NSATokenToKVPool`` role).

DeepSeek-V3.2's lightning indexer keeps, per layer and token, one fp8 index key of ``Di``
features and its float32 scale, in the paged layout DeepGEMM's ``fp8_paged_mqa_logits`` reads
(``xpu_ops.index_k_layout``: ``uint8 [num_pages, page_size, 1, Di + 4]``, each page's fp8 keys
then its scales). Token slot ``s`` is the same slot in the latent cache and in the index-key
cache (page ``s // page_size``, row ``s % page_size``), so one page table serves both.
With ``dtype=torch.float8_e4m3fn`` the latent cache holds FlashMLA's fp8 tokens
(``xpu_ops.mla_fp8_layout``: per token R fp8 latent values, one float32 scale per 128 of them,
then r bfloat16 rope values; 656 bytes for DeepSeek's R = 512, r = 64, against 1152 in
bfloat16), quantised on write (scale ``amax / 448`` per tile), as sglang's DSA backend keeps it
with ``--kv-cache-dtype fp8_e4m3``; the sparse MLA kernels read it directly.
Pools know nothing of layers: callers pass layer ids.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

import xpu_ops
from xpu_ops.index_k_layout import SCALE_BYTES
from xpu_ops.mla_fp8_layout import FP8_TILE, fp8_token_bytes, quantize_fp8_tokens

from compile.batch.memory_pool import MLATokenToKVPool, layer_buffers


class DSATokenToKVPool(MLATokenToKVPool):
    """``MLATokenToKVPool`` plus one index-key cache per layer.

    Args:
        index_head_dim: Di, features of an index key (a multiple of 4).
        dtype: the latent cache's dtype; ``torch.float8_e4m3fn``: FlashMLA's fp8 tokens
            (module docstring; ``fp8_latent`` is then True).
        other arguments: as ``MLATokenToKVPool``.
    Raises:
        ValueError: ``size`` not a multiple of ``page_size``, ``index_head_dim`` not a
            positive multiple of 4, or an fp8 latent cache whose R is not a multiple of 128.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, kv_lora_rank: int,
                 qk_rope_head_dim: int, layer_num: int, device: torch.device | str,
                 start_layer: int = 0, kv_sharing: Sequence[tuple[int, int]] = (), *,
                 index_head_dim: int):
        if index_head_dim <= 0 or index_head_dim % 4:
            raise ValueError(f"DSATokenToKVPool: index_head_dim is not a positive multiple of 4; "
                             f"expected the indexer's head dim, got {index_head_dim}.")
        self.fp8_latent = dtype == torch.float8_e4m3fn
        if self.fp8_latent and (kv_lora_rank <= 0 or kv_lora_rank % FP8_TILE):
            raise ValueError(f"DSATokenToKVPool: kv_lora_rank is not a positive multiple of "
                             f"{FP8_TILE} with an fp8 latent cache; expected FlashMLA's fp8 "
                             f"token layout (R = 512 for DeepSeek), got {kv_lora_rank}.")
        super().__init__(size, page_size, dtype, kv_lora_rank, qk_rope_head_dim, layer_num,
                         device, start_layer, kv_sharing)
        self.index_head_dim = index_head_dim
        self.index_k_with_scale_buffer = layer_buffers(
            layer_num, start_layer, kv_sharing, lambda: torch.zeros(
                (size // page_size, page_size, 1, index_head_dim + SCALE_BYTES),
                dtype=torch.uint8, device=self.device))

    def row_width(self, kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype) -> int:
        """``R + r`` elements, or with an fp8 latent cache FlashMLA's token bytes."""
        if dtype == torch.float8_e4m3fn:
            return fp8_token_bytes(kv_lora_rank + qk_rope_head_dim, kv_lora_rank)
        return kv_lora_rank + qk_rope_head_dim

    def set_mla_kv_buffer(self, layer, loc: Tensor, cache_k_nope: Tensor,
                          cache_k_rope: Tensor) -> None:
        """Write ``cat(k_nope [N, 1, R], k_rope [N, 1, r])`` into slots ``loc`` (as
        ``MLATokenToKVPool``'s; an fp8 latent cache gets the tokens quantised first)."""
        if not self.fp8_latent:
            return super().set_mla_kv_buffer(layer, loc, cache_k_nope, cache_k_rope)
        layer_id = layer if isinstance(layer, int) else layer.layer_id
        raw = quantize_fp8_tokens(torch.cat((cache_k_nope, cache_k_rope), -1),
                                  self.kv_lora_rank)                      # [N, 1, token bytes]
        self._store_token_bytes(layer_id, loc, raw)

    def set_kv_buffer(self, layer, loc: Tensor, cache_k: Tensor, cache_v=None,
                      k_scale=None, v_scale=None) -> None:
        """Write whole cache rows ``cache_k`` into slots ``loc``: latent rows ``[N, 1, R + r]``
        (quantised first with an fp8 latent cache), or, with an fp8 latent cache, rows as
        stored (``[N, 1, token bytes]`` of a 1-byte dtype, as disaggregation moves them),
        copied bit for bit."""
        if not self.fp8_latent or cache_k.element_size() != 1:
            return super().set_kv_buffer(layer, loc, cache_k, cache_v, k_scale, v_scale)
        layer_id = layer if isinstance(layer, int) else layer.layer_id
        self._store_token_bytes(layer_id, loc, cache_k)

    def _store_token_bytes(self, layer_id: int, loc: Tensor, raw: Tensor) -> None:
        """Copy fp8 tokens ``raw [N, 1, token bytes]`` (any 1-byte dtype) into slots ``loc``."""
        # the bytes as 2-byte words, which the store copies bit for bit (it skips, as for any
        # cache, slots outside the pool)
        words = raw.contiguous().view(torch.float16)
        cache = self.get_key_buffer(layer_id).view(torch.float16)
        half = words.shape[-1] // 2
        xpu_ops.store_mla_kv_cache(cache, loc, words[..., :half], words[..., half:])

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
