"""The shim's FlashMLA names (``xpu_ops/compat_flash_mla.py``, ``xpu_ops/compat.py``), called as
sglang's sgl-kernel test ``test_flashmla.py`` calls them (tiny shapes, CPU): sgl-kernel's
``get_mla_metadata`` tensors passed positionally, FlashMLA fp8 pages as a float8_e4m3fn tensor,
block-table and index padding of 2147480000, base-2 statistics of
``sgl_kernel.flash_mla.flash_mla_sparse_fwd``; checked against the float64 oracle."""

from __future__ import annotations

import math

import pytest
import torch

import xpu_ops
from xpu_ops.mla_fp8_layout import quantize_fp8_tokens

from . import oracle_flash_mla as oracle
from .test_compat_shim import shim  # noqa: F401  (the fixture: installs, then removes it)
from .utils import assert_matches_oracle

I32 = torch.int32
PAD = 2147480000


def test_names_resolve(shim):
    import sgl_kernel
    from sgl_kernel.flash_mla import flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata
    assert flash_mla_with_kvcache is xpu_ops.flash_mla_with_kvcache
    assert get_mla_metadata is xpu_ops.get_mla_metadata
    assert flash_mla_sparse_fwd is not xpu_ops.flash_mla_sparse_fwd          # base 2
    assert sgl_kernel.flash_mla_sparse_fwd is xpu_ops.flash_mla_sparse_fwd   # sgl-kernel-xpu's
    assert sgl_kernel.flash_mla_with_kvcache is xpu_ops.flash_mla_with_kvcache


def test_sparse_prefill_statistics_are_base_2(shim):
    from sgl_kernel.flash_mla import flash_mla_sparse_fwd
    gen = torch.Generator().manual_seed(0)
    s_q, s_kv, topk = 3, 20, 16
    q = (torch.randn(1, s_q, 4, 576, generator=gen) / 10).to(torch.bfloat16)
    kv = (torch.randn(1, s_kv, 1, 576, generator=gen) / 10).to(torch.bfloat16)
    indices = torch.full((1, s_q, 1, topk), s_kv, dtype=I32)
    for s in range(s_q):
        indices[0, s, 0, :12] = torch.randperm(s_kv, generator=gen)[:12]
        indices[0, s, 0, 12:14] = PAD                              # past the keys
    out, max_logits, lse = flash_mla_sparse_fwd(q.squeeze(0), kv.squeeze(0),
                                                indices.squeeze(0), sm_scale=576 ** -0.5)
    want, want_max, want_lse = oracle.flash_mla_sparse_fwd(q[0], kv[0], indices[0],
                                                           576 ** -0.5, 512)
    torch.testing.assert_close(out.double(), want, atol=8e-4, rtol=2.01 / 128)
    log2e = 1 / math.log(2)
    torch.testing.assert_close(max_logits.double(), want_max * log2e, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse * log2e, atol=1e-5, rtol=1e-5)


def _blocked(gen, b, s_k, block_size=8, d=576):
    max_pad = -(-s_k // block_size) * block_size
    table = torch.arange(b * max_pad // block_size, dtype=I32).view(b, -1)
    table = table.view(-1)[torch.randperm(table.numel(), generator=gen)].view(b, -1)
    blocked = (torch.randn(table.numel(), block_size, 1, d, generator=gen) / 10)
    return table, blocked.to(torch.bfloat16)


def test_dense_decode_as_sgl_kernel_calls_it(shim):
    from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata
    gen = torch.Generator().manual_seed(1)
    b, s_q, h, s_k = 2, 2, 4, 20
    table, blocked = _blocked(gen, b, s_k)
    seqlens = torch.tensor([20, 9], dtype=I32)
    blocked[table[1, 2:].long()] = float("nan")                   # pages past request 1
    blocked[table[1, 1].long(), 1:] = float("nan")                # slots past its 9 tokens
    table[1, 2:] = PAD
    q = torch.randn(b, s_q, h, 576, generator=gen).clamp(-1, 1).to(torch.bfloat16)
    meta, splits = get_mla_metadata(seqlens, s_q * h, 1, h, False, None)
    out, lse = flash_mla_with_kvcache(q, blocked, table, seqlens, 512, meta, splits,
                                      causal=True, is_fp8_kvcache=False, indices=None)
    want, want_lse = oracle.flash_mla_with_kvcache(q, blocked, table, seqlens, 512,
                                                   576 ** -0.5, True, False)
    assert_matches_oracle(out, want, torch.bfloat16, lse, want_lse)


def test_sparse_fp8_decode_as_sgl_kernel_calls_it(shim):
    from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata
    gen = torch.Generator().manual_seed(2)
    b, s_q, h, s_k, topk = 2, 2, 4, 20, 8
    table, blocked = _blocked(gen, b, s_k)
    seqlens = torch.tensor([20, 6], dtype=I32)
    indices = torch.full((b, s_q, topk), -1, dtype=I32)
    for i in range(b):
        for j in range(s_q):
            pos = torch.randperm(int(seqlens[i]), generator=gen)[:topk]
            indices[i, j, :len(pos)] = table[i, pos // 8] * 8 + pos % 8
    quantized = quantize_fp8_tokens(blocked.float(), 512)          # [blocks, 8, 1, 656] fp8
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape[-1] == 656
    q = torch.randn(b, s_q, h, 576, generator=gen).clamp(-1, 1).to(torch.bfloat16)
    meta, splits = get_mla_metadata(seqlens, s_q * h, 1, h, True, topk)
    out, lse = flash_mla_with_kvcache(q, quantized, table, seqlens, 512, meta, splits,
                                      causal=False, is_fp8_kvcache=True, indices=indices)
    want, want_lse = oracle.flash_mla_with_kvcache(q, quantized, None, None, 512, 576 ** -0.5,
                                                   False, True, indices)
    assert_matches_oracle(out, want, torch.bfloat16, lse, want_lse)
    with pytest.raises(ValueError, match="descale_k is given with is_fp8_kvcache"):
        flash_mla_with_kvcache(q, quantized, table, seqlens, 512, meta, splits,
                               is_fp8_kvcache=True, indices=indices,
                               descale_q=torch.ones(1), descale_k=torch.ones(1))
