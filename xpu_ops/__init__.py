"""xpu-ops: paged-attention kernels as first-class PyTorch operators.

Every public function is a thin wrapper over one ``torch.ops.xpu_ops`` custom op with a fake
implementation, so it traces under ``torch.compile`` and passes ``torch.library.opcheck``; the
op runs the best provider for its device (``reference``, ``triton`` or ``sgl_kernel``, see
``xpu_ops.providers`` and ``python -m xpu_ops info``).
"""

import torch

from .ops.block_ids import build_bidirectional_block_ids
from .ops.dsa_index_cache import gather_index_k_cache, store_index_k_cache
from .ops.dsa_indexer import (fp8_mqa_logits, fp8_paged_mqa_logits,
                              get_paged_mqa_logits_metadata)
from .ops.dsa_topk import (fast_topk_transform_fused, fast_topk_transform_ragged_fused,
                           fast_topk_v2)
from .ops.hadamard import hadamard_transform
from .ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from .ops.gated_delta_rule import (chunk_gated_delta_rule, fused_gdn_gating,
                                   fused_recurrent_gated_delta_rule)
from .ops.gdn_attention import gdn_attention
from .ops.kv_cache import store_kv_cache, store_mla_kv_cache
from .ops.merge_state import merge_state, merge_state_v2
from .ops.mla_decode import (flash_mla_decode, flash_mla_decode_get_workspace_size,
                             flash_mla_get_workspace_size)
from .ops.mla_prefill import flash_mla_prefill, flash_mla_prefill_get_workspace_size
from .ops.flash_mla_kvcache import flash_mla_with_kvcache, get_mla_metadata
from .ops.mla_sparse_prefill import flash_mla_sparse_fwd
from .ops.paged_attention import flash_attn_with_kvcache
from .ops.sparse_attn import (convert_vertical_slash_indexes,
                              convert_vertical_slash_indexes_mergehead, sparse_attn_func)
from .ops.store_cache import store_cache_xpu
from .ops.swa_spec import prepare_swa_spec_page_table
from .ops.varlen_attention import flash_attn_varlen_func
from .providers import refresh, use_provider
from ._value_checks import debug_checks  # value checks behind XPU_OPS_DEBUG_CHECKS=1
from . import compat  # install_sgl_kernel_shim
from .sgl_kernel_fakes import register_sgl_kernel_fakes

#: The op packets this package registers, in ``torch.ops.xpu_ops``.
REGISTERED_OPS = [
    torch.ops.xpu_ops.flash_attn_with_kvcache,
    torch.ops.xpu_ops.flash_attn_varlen_func,
    torch.ops.xpu_ops.merge_state_v2,
    torch.ops.xpu_ops.merge_state,
    torch.ops.xpu_ops.store_cache,
    torch.ops.xpu_ops.sparse_attn_func,
    torch.ops.xpu_ops.convert_vertical_slash_indexes,
    torch.ops.xpu_ops.flash_mla_decode,
    torch.ops.xpu_ops.flash_mla_prefill,
    torch.ops.xpu_ops.store_kv_cache,
    torch.ops.xpu_ops.store_mla_kv_cache,
    torch.ops.xpu_ops.prepare_swa_spec_page_table,
    torch.ops.xpu_ops.apply_rotary_emb,
    torch.ops.xpu_ops.flash_mla_with_kvcache,
    torch.ops.xpu_ops.flash_mla_sparse_fwd,
    torch.ops.xpu_ops.fp8_mqa_logits,
    torch.ops.xpu_ops.fp8_paged_mqa_logits,
    torch.ops.xpu_ops.fast_topk,
    torch.ops.xpu_ops.fast_topk_transform,
    torch.ops.xpu_ops.store_index_k_cache,
    torch.ops.xpu_ops.hadamard_transform,
    torch.ops.xpu_ops.causal_conv1d_fn,
    torch.ops.xpu_ops.causal_conv1d_update,
    torch.ops.xpu_ops.fused_gdn_gating,
    torch.ops.xpu_ops.chunk_gated_delta_rule,
    torch.ops.xpu_ops.fused_recurrent_gated_delta_rule,
    torch.ops.xpu_ops.gdn_attention,
]


def __getattr__(name: str):
    """``xpu_ops.testing`` (and ``xpu_ops.testing_layouts``) after a plain ``import xpu_ops``:
    imported on first access, so ``import xpu_ops`` does not pay for them."""
    if name in ("testing", "testing_layouts"):
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "REGISTERED_OPS", "build_bidirectional_block_ids", "flash_attn_varlen_func",
    "flash_attn_with_kvcache", "flash_mla_decode",
    "flash_mla_decode_get_workspace_size", "flash_mla_get_workspace_size", "flash_mla_prefill",
    "flash_mla_prefill_get_workspace_size", "flash_mla_sparse_fwd", "flash_mla_with_kvcache",
    "get_mla_metadata", "merge_state", "merge_state_v2", "prepare_swa_spec_page_table",
    "sparse_attn_func", "convert_vertical_slash_indexes",
    "convert_vertical_slash_indexes_mergehead", "store_cache_xpu", "store_kv_cache", "store_mla_kv_cache", "use_provider", "debug_checks",
    "refresh",
    "fp8_mqa_logits", "fp8_paged_mqa_logits", "get_paged_mqa_logits_metadata",
    "fast_topk_v2", "fast_topk_transform_fused", "fast_topk_transform_ragged_fused",
    "store_index_k_cache", "gather_index_k_cache", "hadamard_transform",
    "causal_conv1d_fn", "causal_conv1d_update", "fused_gdn_gating", "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule", "gdn_attention",
]
