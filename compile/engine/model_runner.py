"""``ModelRunnerInfo``: the sglang ``ModelRunner`` attributes ``XPUAttentionBackend`` reads.

Users without sglang build one of these; sglang users pass their ``ModelRunner`` unchanged (the
backend is duck-typed on these attribute names).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Optional

import torch


@dataclasses.dataclass
class ModelRunnerInfo:
    """What the attention backend needs to know about the model and its pools.

    Attributes:
        model_config: object with ``context_len`` (max tokens per request) and
            ``num_attention_heads``; for MLA also ``kv_lora_rank``, ``qk_rope_head_dim``.
        tp_size: tensor-parallel size (heads in layers are already divided by it).
        device: torch device of the pools and batches.
        page_size: tokens per KV page.
        req_to_token_pool: ReqToTokenPool.
        token_to_kv_pool: MHATokenToKVPool, SWAKVPool or MLATokenToKVPool.
        kv_cache_dtype: dtype of the KV cache (an fp8 dtype enables scale/descale).
        server_args: object with sglang's ``speculative_eagle_topk``,
            ``speculative_num_draft_tokens``, ``speculative_num_steps`` and
            ``enable_deterministic_inference`` (each may be absent).
        sliding_window_size: the left window bound of sliding layers, ``W - 1`` for a Hugging Face
            ``sliding_window = W`` (sglang's convention), or None.
        attention_chunk_size: chunk of local-attention (iRoPE) layers or None.
        is_hybrid_swa: True when ``token_to_kv_pool`` is an SWAKVPool.
        use_mla_backend: True for MLA models (default: the pool is an MLATokenToKVPool).
        dcp_group: the decode-context-parallel ``ParallelGroup``
            (``compile.backend.dcp_attention``), or None without DCP.
        state_pool: the ``LinearStatePool`` of a model with linear-attention layers
            (``compile.backend.HybridLinearAttnBackend`` reads it), or None.
    """

    model_config: Any
    tp_size: int
    device: torch.device
    page_size: int
    req_to_token_pool: Any
    token_to_kv_pool: Any
    kv_cache_dtype: torch.dtype
    server_args: Any = dataclasses.field(default_factory=SimpleNamespace)
    sliding_window_size: Optional[int] = None
    attention_chunk_size: Optional[int] = None
    is_hybrid_swa: bool = False
    use_mla_backend: Optional[bool] = None
    dcp_group: Any = None
    state_pool: Any = None


__all__ = ["ModelRunnerInfo"]
