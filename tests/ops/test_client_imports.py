"""Every attention name the clients take from ``sgl_kernel`` resolves through the shim.

The list is written out from the clients' sources (not from the shim's table): each entry is
``(module, name)`` with the files that import it. Sources read:

* sglang 0.5.23 (the wheel in ``.venv-sglang``): ``python/sglang/srt/layers/attention/``
  (``xpu_backend.py``, ``flashattention_backend.py``, ``dsa_backend.py``, ``merge_state.py``,
  ``vision.py``, ``deepseek_v4_backend.py``, ``dsa/``, ``dsv4/``, ``qsa/``, ``linear/``),
  ``hardware_backend/xpu/``, ``mem_cache/memory_pool.py`` (the KV store),
  ``layers/rotary_embedding/base.py`` (XPU's raw rotary op), ``models/gemma3_mm.py``;
* sgl-kernel-xpu main (``tests/``: the attention, MLA, merge, store, DSA-indexer, rotary, GDN
  and causal-conv1d files the runner ``scripts/run_sgl_kernel_xpu_tests.py`` runs; ``python/sgl_kernel/__init__.py``
  for the package-level names);
* sglang main's ``layers/attention/xpu_backend.py`` (commit 00aa388: the same names, with
  ``flash_mla_get_workspace_size`` where 0.5.23 has ``flash_mla_decode_get_workspace_size``);
* sgl-kernel's newest tests in the sglang repository (``sgl-kernel/tests/test_flash_attention.py``,
  ``test_merge_state_v2.py``, ``test_flashmla.py``).

``NOT_PROVIDED`` lists the ``sgl_kernel`` names those sources import that the shim does not
provide, each with the reason; none is an attention kernel an XPU run of sglang reaches.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import xpu_ops.compat_gdn

from .test_compat_shim import shim  # noqa: F401  (the fixture: the shim, or a skip)

_ATT = "sglang srt/layers/attention/"
_XT = "sgl-kernel-xpu tests/"
#: (module, name) -> where it is imported from.
CLIENT_IMPORTS = {
    ("sgl_kernel", "merge_state_v2"): (_ATT + "xpu_backend.py", _ATT + "flashattention_backend.py",
                                       _ATT + "merge_state.py", _XT + "test_merge_state_v2.py",
                                       "sgl-kernel tests/test_merge_state_v2.py"),
    ("sgl_kernel", "merge_state"): (_XT + "test_merge_state.py", _XT + "test_merge_state_v2.py",
                                    "sgl-kernel tests/test_merge_state_v2.py"),
    ("sgl_kernel", "flash_mla_decode"): (_ATT + "xpu_backend.py", _ATT + "dsa_backend.py",
                                         _XT + "test_flash_mla_decode.py"),
    ("sgl_kernel", "flash_mla_decode_get_workspace_size"): (_ATT + "xpu_backend.py",),
    ("sgl_kernel", "flash_mla_get_workspace_size"): (_ATT + "dsa_backend.py",
                                                     "sglang main " + _ATT + "xpu_backend.py",
                                                     _XT + "test_flash_mla_decode.py"),
    ("sgl_kernel", "flash_mla_prefill"): (_ATT + "xpu_backend.py", _ATT + "dsa_backend.py",
                                          _XT + "test_flash_mla_prefill.py"),
    ("sgl_kernel", "flash_mla_prefill_get_workspace_size"): (_ATT + "xpu_backend.py",
                                                             _ATT + "dsa_backend.py"),
    ("sgl_kernel", "flash_mla_with_kvcache"): (_ATT + "deepseek_v4_backend.py",
                                               _XT + "test_flash_mla_with_kvcache.py"),
    ("sgl_kernel", "flash_mla_sparse_fwd"): (_ATT + "deepseek_v4_backend.py",
                                             _XT + "test_flash_mla_sparse_fwd.py"),
    ("sgl_kernel", "fp8_mqa_logits"): (_ATT + "dsa/dsa_indexer.py",),
    ("sgl_kernel", "fp8_paged_mqa_logits"): (_ATT + "dsa/dsa_indexer.py",),
    ("sgl_kernel", "hadamard_transform"): (_ATT + "dsa/dsa_indexer.py", _XT + "test_hadamard.py"),
    ("sgl_kernel", "fast_topk_v2"): (_ATT + "dsa/dsa_topk_backend.py",
                                     _ATT + "dsa/kpool_fp8_index.py",
                                     _XT + "test_topk_transform.py"),
    ("sgl_kernel", "fast_topk_transform_fused"): (_ATT + "dsa/dsa_topk_backend.py",
                                                  _XT + "test_topk_transform.py"),
    ("sgl_kernel", "fast_topk_transform_ragged_fused"): (_ATT + "dsa/dsa_topk_backend.py",
                                                         _XT + "test_topk_transform.py"),
    ("sgl_kernel", "topk_transform_512"): (_XT + "test_topk_transform.py",),
    ("sgl_kernel", "topk_transform_512_v2"): (_XT + "test_topk_transform.py",),
    ("sgl_kernel", "fp8_paged_mqa_logits_triton"): (_ATT + "dsv4/indexer.py",
                                                    _XT + "test_fp8_paged_mqa_logits.py"),
    ("sgl_kernel", "store_cache_xpu"): ("sglang srt/mem_cache/memory_pool.py",
                                        _XT + "test_store_cache_xpu.py"),
    ("sgl_kernel.top_k", "fast_topk_v2"): (_ATT + "qsa/kernel.py (import sgl_kernel.top_k)",),
    ("sgl_kernel.flash_attn", "flash_attn_with_kvcache"): (
        _ATT + "xpu_backend.py", _ATT + "flashattention_backend.py", _ATT + "dsa_backend.py",
        _XT + "test_flash_attention.py", _XT + "test_flash_attention_4.py",
        "sgl-kernel tests/test_flash_attention.py"),
    ("sgl_kernel.flash_attn", "flash_attn_varlen_func"): (
        _ATT + "xpu_backend.py", _ATT + "flashattention_backend.py", _ATT + "dsa_backend.py",
        _ATT + "vision.py", _XT + "test_flash_attention.py",
        "sgl-kernel tests/test_flash_attention.py"),
    ("sgl_kernel.flash_attn", "get_scheduler_metadata"): (_ATT + "flashattention_backend.py",),
    ("sgl_kernel.flash_attn", "build_bidirectional_block_ids"): ("sglang srt/models/gemma3_mm.py",),
    ("sgl_kernel.flash_mla", "flash_mla_with_kvcache"): (_XT + "test_flashmla.py",
                                                         "sgl-kernel tests/test_flashmla.py"),
    ("sgl_kernel.flash_mla", "flash_mla_sparse_fwd"): (_XT + "test_flashmla.py",
                                                       "sgl-kernel tests/test_flashmla.py"),
    ("sgl_kernel.flash_mla", "get_mla_metadata"): (_XT + "test_flashmla.py",
                                                   "sgl-kernel tests/test_flashmla.py"),
    ("sgl_kernel.sparse_flash_attn", "sparse_attn_func"): (_XT + "test_flash_attn_sparse.py",),
    ("sgl_kernel.sparse_flash_attn", "convert_vertical_slash_indexes"): (
        _XT + "test_flash_attn_sparse.py",),
    ("sgl_kernel.sparse_flash_attn", "convert_vertical_slash_indexes_mergehead"): (
        _XT + "test_flash_attn_sparse.py",),
    ("sgl_kernel.sparse_flash_attn", "sparse_attn_varlen_func"): (
        "sgl-kernel-xpu python/sgl_kernel/__init__.py (package export)",),
    ("sgl_kernel", "sparse_attn_varlen_func"): (
        "sgl-kernel-xpu python/sgl_kernel/__init__.py (package export)",),
    ("sgl_kernel.testing.rotary_embedding", "_apply_rotary_emb"): (
        _XT + "test_flash_attention_4.py",),
    ("sgl_kernel.nsa", "_fp8_mqa_logits_impl"): (_XT + "test_fp8_mqa_logits.py",),
    ("sgl_kernel.nsa", "fp8_mqa_logits"): (_XT + "test_fp8_mqa_logits.py",),
    ("sgl_kernel.nsa", "fp8_paged_mqa_logits"): (_XT + "test_fp8_mqa_logits.py",),
    ("sgl_kernel.fp8_paged_mqa_logits", "FP8_DTYPE"): (_XT + "test_fp8_paged_mqa_logits.py",),
    ("sgl_kernel", "gdn_attention"): ("sglang srt/hardware_backend/xpu/attention/"
                                      "xpu_gdn_backend.py",),
    ("sgl_kernel.gdn_attn", "gdn_attention"): (
        "sgl-kernel-xpu python/sgl_kernel/__init__.py (its home module)",
        _XT + "test_gdn_attention_wrapper.py"),
    ("sgl_kernel", "causal_conv1d_fn_xpu"): (_XT + "test_causal_conv1d.py",),
    ("sgl_kernel", "causal_conv1d_update_xpu"): (_XT + "test_causal_conv1d.py",),
    ("sgl_kernel.mamba", "causal_conv1d_fn_xpu"): (
        "sgl-kernel-xpu python/sgl_kernel/__init__.py (its home module)",),
    ("sgl_kernel.mamba", "causal_conv1d_update_xpu"): (
        "sgl-kernel-xpu python/sgl_kernel/__init__.py (its home module)",),
}
#: ``torch.ops.sgl_kernel.<name>`` called directly -> where.
RAW_OPS = {
    "rotary_embedding": ("sglang srt/layers/rotary_embedding/base.py (XPU forward)",
                         _XT + "test_rotary_embedding.py"),
    "fp8_paged_mqa_logits": (_XT + "test_fp8_mqa_logits.py",),
    "gdn_attention": ("sglang srt/hardware_backend/xpu/attention/xpu_gdn_backend.py "
                      "(hasattr probe before its fused path)", _XT + "test_gdn_attention.py",
                      _XT + "test_gdn_attention_workspace.py (with workspace=)"),
}
#: Names the sources import from ``sgl_kernel`` that the shim does not provide, and why.
NOT_PROVIDED = {
    "*_cpu (decode_attention_cpu, extend_attention_cpu, ...)": "intel_amx_backend.py, linear/"
                     "*: sgl-kernel's CPU (AMX) kernels, used only on CPU servers",
    "infllmv2_attn_stage1, max_pooling_1d_varlen": "minicpm/sparse_utils.py: CUDA-only",
    "is_arch_support_pdl": "triton_backend.py, sgl_kernel.utils: a CUDA capability query",
    "cutlass_mla_decode, cutlass_mla_get_workspace_size": "sglang's CUDA cutlass MLA backend "
                     "(not in 0.5.23's attention package)",
}


@pytest.mark.parametrize("module,name", sorted(CLIENT_IMPORTS), ids=lambda v: str(v))
def test_client_import_resolves(shim, module, name):
    namespace = {}
    exec(f"from {module} import {name} as value", namespace)   # the clients' own statement
    value = namespace["value"]
    assert callable(value) or isinstance(value, torch.dtype), (module, name, value)


@pytest.mark.parametrize("name", sorted(RAW_OPS))
def test_raw_op_name_is_defined(shim, name):
    packet = getattr(torch.ops.sgl_kernel, name)
    assert isinstance(packet, torch._ops.OpOverloadPacket)


def test_module_attribute_forms(shim):
    import sgl_kernel
    import sgl_kernel.nsa as nsa
    from sgl_kernel import top_k as top_k_module
    assert isinstance(nsa._HEAD_LOOP_THRESHOLD, int)
    assert 2048 in top_k_module._FAST_TOPK_SUPPORTED_K
    # the package's name stays the function when a submodule shares it (sgl-kernel-xpu's order)
    assert callable(sgl_kernel.fp8_paged_mqa_logits)
    assert importlib.import_module("sgl_kernel.fp8_paged_mqa_logits").FP8_DTYPE is \
        torch.float8_e4m3fn
    # sgl-kernel-xpu's wrapper cache that test_gdn_attention_wrapper.py reads and clears
    import sgl_kernel.gdn_attn as gdn_attn
    assert isinstance(gdn_attn._gdn_ws_cache, dict)
    assert gdn_attn._gdn_ws_cache is xpu_ops.compat_gdn._gdn_ws_cache   # one cache
