"""Glue tests of ``xpu_ops.compat.install_sgl_kernel_shim`` (``xpu_ops/compat.py``).

sgl-kernel-style calls with the keyword sets sglang's XPU backend
(``python/sglang/srt/layers/attention/xpu_backend.py``) uses run through the shim and are compared
with the float64 oracle. They run xpu-ops' own providers (reference on CPU); no sgl-kernel here.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest
import torch

import xpu_ops
from xpu_ops import sgl_kernel as sk
from xpu_ops.compat import install_sgl_kernel_shim, is_shim, uninstall_sgl_kernel_shim
from xpu_ops.testing import paged_kv_cache

from . import oracle

ATOL = 2e-5


@pytest.fixture
def shim():
    existing = sys.modules.get("sgl_kernel")
    if (existing is not None and not is_shim(existing)) or (
            existing is None and importlib.util.find_spec("sgl_kernel") is not None):
        pytest.skip("a real sgl_kernel is installed; the shim must not (and will not) shadow it")
    module = install_sgl_kernel_shim()
    yield module
    uninstall_sgl_kernel_shim()


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def test_glue_shim_resolves_sgl_kernel_imports(shim):
    import sgl_kernel
    from sgl_kernel import flash_mla_decode, flash_mla_get_workspace_size, merge_state_v2
    from sgl_kernel.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    assert sgl_kernel is shim and is_shim(sgl_kernel)
    assert flash_attn_with_kvcache is xpu_ops.flash_attn_with_kvcache
    assert flash_attn_varlen_func is xpu_ops.flash_attn_varlen_func
    assert merge_state_v2 is xpu_ops.merge_state_v2
    assert flash_mla_decode is xpu_ops.flash_mla_decode
    assert flash_mla_get_workspace_size is xpu_ops.flash_mla_get_workspace_size
    # sglang 0.5.23: xpu_backend.py's and flashattention_backend.py's imports.
    from sgl_kernel import (flash_mla_decode_get_workspace_size, flash_mla_prefill,
                            flash_mla_prefill_get_workspace_size)
    from sgl_kernel.flash_attn import get_scheduler_metadata
    assert flash_mla_decode_get_workspace_size is xpu_ops.flash_mla_decode_get_workspace_size
    assert flash_mla_prefill is xpu_ops.flash_mla_prefill
    assert flash_mla_prefill_get_workspace_size is xpu_ops.flash_mla_prefill_get_workspace_size
    assert get_scheduler_metadata(batch_size=1, max_seqlen_q=1, max_seqlen_k=8) is None
    assert install_sgl_kernel_shim() is shim                               # installed once
    assert "compatibility shim" in sk.native._package_reason("sgl_kernel")  # never "native"


def test_glue_shim_never_shadows_an_imported_package(monkeypatch):
    real = types.ModuleType("sgl_kernel")
    monkeypatch.setitem(sys.modules, "sgl_kernel", real)
    assert install_sgl_kernel_shim() is real
    assert sys.modules["sgl_kernel"] is real and not uninstall_sgl_kernel_shim()


def test_glue_shim_never_shadows_an_importable_package(monkeypatch, tmp_path):
    if "sgl_kernel" in sys.modules:
        pytest.skip("sgl_kernel already imported")
    (tmp_path / "sgl_kernel").mkdir()
    (tmp_path / "sgl_kernel" / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        module = install_sgl_kernel_shim()
        assert getattr(module, "REAL", False) and not is_shim(module)
    finally:
        sys.modules.pop("sgl_kernel", None)


def _layer(gen, k_lens, page_size=16, hq=4, hkv=2, d=64):
    (key_cache, value_cache), page_table, cache_seqlens = paged_kv_cache(
        gen, k_lens, page_size, [(hkv, d), (hkv, d)], dtype=torch.float32, device="cpu")
    return key_cache, value_cache, page_table, cache_seqlens


def _oracle_paged(q, key_cache, value_cache, cache_seqlens, page_table, cu_seqlens_q, *, causal,
                  scale, sinks=None):
    return oracle.flash_attn_with_kvcache(
        q, key_cache, value_cache, cache_seqlens, page_table, cu_seqlens_q, None, None, None,
        None, None, sinks, max_seqlen_q=0, softmax_scale=scale, causal=causal,
        window_size_left=-1, window_size_right=0 if causal else -1, softcap=0.0)


def test_glue_sglang_forward_extend_call(shim):
    from sgl_kernel.flash_attn import flash_attn_with_kvcache
    gen = torch.Generator().manual_seed(0)
    key_cache, value_cache, page_table, cache_seqlens = _layer(gen, (21, 40))
    cu_seqlens_q, hq, d = _i32([0, 3, 8]), 4, 64
    q = torch.randn(8, hq * d, generator=gen)
    attn_output = torch.full((8, hq * d), float("nan"))
    sinks = torch.randn(hq, generator=gen)
    # The keyword set of XPUAttentionBackend.forward_extend (non-cascade, fixed output buffer).
    o = flash_attn_with_kvcache(
        q=q.contiguous().view(-1, hq, d), k_cache=key_cache, v_cache=value_cache,
        page_table=page_table, cache_seqlens=cache_seqlens, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k_new=None, max_seqlen_q=5, softmax_scale=0.125, causal=True,
        window_size=(-1, -1), softcap=0.0, k_descale=None, v_descale=None,
        return_softmax_lse=False, out=attn_output.view(-1, hq, d), sinks=sinks)
    expected, _ = _oracle_paged(q.view(-1, hq, d), key_cache, value_cache, cache_seqlens,
                                page_table, cu_seqlens_q, causal=True, scale=0.125, sinks=sinks)
    assert o.data_ptr() == attn_output.data_ptr()
    torch.testing.assert_close(attn_output.view(-1, hq, d).double(), expected, atol=ATOL, rtol=0)


def test_glue_sglang_cascade_verify_call(shim):
    """Target verify with topk > 1: prefix pass + expand pass + merge_state_v2 (LSE transposed),
    which must equal one non-causal pass over prefix and drafts together."""
    from sgl_kernel import merge_state_v2
    from sgl_kernel.flash_attn import flash_attn_with_kvcache
    gen = torch.Generator().manual_seed(1)
    page_size, hq, d = 4, 4, 64
    key_cache, value_cache, full_table, full_lens = _layer(gen, (12, 9), page_size=page_size)
    prefix_table, prefix_lens = full_table[:, :2], _i32([8, 8])      # first two pages: prefix
    draft_table, draft_lens = full_table[:, 2:], full_lens - 8       # the rest: draft tokens
    cu_seqlens_q = _i32([0, 2, 4])
    q = torch.randn(4, hq, d, generator=gen)
    common = dict(k_cache=key_cache, v_cache=value_cache, cu_seqlens_k_new=None, max_seqlen_q=2,
                  softmax_scale=0.125, window_size=(-1, -1), softcap=0.0, k_descale=None,
                  v_descale=None)
    o, softmax_lse, *rest = flash_attn_with_kvcache(
        q=q, page_table=prefix_table, cache_seqlens=prefix_lens, cu_seqlens_q=cu_seqlens_q,
        causal=False, return_softmax_lse=True, out=None, **common)
    o_expand, softmax_lse_expand, *rest_expand = flash_attn_with_kvcache(
        q=q, page_table=draft_table, cache_seqlens=draft_lens, cu_seqlens_q=cu_seqlens_q,
        causal=False, return_softmax_lse=True, **common)
    o, _ = merge_state_v2(o, softmax_lse.T.contiguous(), o_expand,
                          softmax_lse_expand.T.contiguous())
    expected, _ = _oracle_paged(q, key_cache, value_cache, full_lens, full_table, cu_seqlens_q,
                                causal=False, scale=0.125)
    assert rest == [] and rest_expand == []
    torch.testing.assert_close(o.double(), expected, atol=ATOL, rtol=0)


def test_glue_sglang_varlen_call(shim):
    from sgl_kernel.flash_attn import flash_attn_varlen_func
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(7, 4, 64, generator=gen)
    k, v = torch.randn(7, 2, 64, generator=gen), torch.randn(7, 2, 48, generator=gen)
    cu_seqlens_q = _i32([0, 3, 7])
    # MHA over the extend part of an MLA model (cu_seqlens_k = cu_seqlens_q, causal, LSE).
    output = flash_attn_varlen_func(
        q=q, k=k.to(q.dtype), v=v.to(q.dtype), cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_q, max_seqlen_q=4, max_seqlen_k=4, softmax_scale=0.125,
        causal=True, return_softmax_lse=True)
    output, lse, *rest = output
    expected, expected_lse = oracle.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_q, causal=True, window_size_right=0,
        softmax_scale=0.125)
    torch.testing.assert_close(output.double(), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse.double(), expected_lse, atol=ATOL, rtol=0)


def test_glue_sglang_mla_decode_call(shim):
    from sgl_kernel import flash_mla_decode, flash_mla_get_workspace_size
    gen = torch.Generator().manual_seed(3)
    (kv_cache,), page_table, cache_seqlens = paged_kv_cache(gen, (19, 2), 8, [(80,)],
                                                            dtype=torch.float32, device="cpu")
    q_nope, q_pe = torch.randn(2, 4, 64, generator=gen), torch.randn(2, 4, 16, generator=gen)
    workspace = torch.empty(flash_mla_get_workspace_size(max_seq_len=64, num_batches=2,
                                                         num_heads=4, page_size=8,
                                                         num_kv_splits=-1), dtype=torch.uint8)
    out = flash_mla_decode(q_nope, q_pe, kv_cache, cache_seqlens, page_table, workspace, 0.1, -1)
    expected = oracle.flash_mla_decode(q_nope, q_pe, kv_cache, cache_seqlens, page_table, 0.1)
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0)


# Every attention import of the clients, written out from their sources (not from the shim's
# table): sglang 0.5.23's attention backends and sgl-kernel-xpu main's attention tests.
CLIENT_IMPORTS = {
    "sgl_kernel": ("merge_state", "merge_state_v2", "flash_mla_decode",
                   "flash_mla_decode_get_workspace_size", "flash_mla_get_workspace_size",
                   "flash_mla_prefill", "flash_mla_prefill_get_workspace_size",
                   "flash_mla_with_kvcache", "flash_mla_sparse_fwd", "get_mla_metadata",
                   "store_cache_xpu"),
    "sgl_kernel.flash_attn": ("flash_attn_with_kvcache", "flash_attn_varlen_func",
                              "get_scheduler_metadata", "build_bidirectional_block_ids"),
    "sgl_kernel.flash_mla": ("flash_mla_with_kvcache", "flash_mla_sparse_fwd",
                             "get_mla_metadata"),
    "sgl_kernel.testing.rotary_embedding": ("_apply_rotary_emb",),
    # dual_chunk_flashattention_backend.py and sgl-kernel-xpu's test_flash_attn_sparse.py
    "sgl_kernel.sparse_flash_attn": ("sparse_attn_func", "convert_vertical_slash_indexes",
                                     "convert_vertical_slash_indexes_mergehead"),
}


@pytest.mark.parametrize("module,name", [(m, n) for m, names in CLIENT_IMPORTS.items()
                                         for n in names])
def test_glue_every_client_attention_import_resolves(shim, module, name):
    imported = importlib.import_module(module)
    value = getattr(imported, name)
    assert callable(value) and is_shim(imported)
    if hasattr(xpu_ops, name) and module != "sgl_kernel.flash_mla":   # base-2 sparse form there
        assert value is getattr(xpu_ops, name)


def test_glue_submodules_are_attributes_of_their_packages(shim):
    import sgl_kernel.testing.rotary_embedding as rotary
    import sgl_kernel
    assert sgl_kernel.testing.rotary_embedding is rotary and sgl_kernel.flash_mla.__name__ == \
        "sgl_kernel.flash_mla"
    assert uninstall_sgl_kernel_shim() and "sgl_kernel.testing.rotary_embedding" not in sys.modules
    install_sgl_kernel_shim()
