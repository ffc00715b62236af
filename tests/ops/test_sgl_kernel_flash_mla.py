"""Glue tests of the FlashMLA surface's ``sgl_kernel`` provider
(``xpu_ops/sgl_kernel/flash_mla.py``) against ``tests/ops/native_sgl_kernel.py`` (sgl-kernel-xpu's schemas on the CPU reference):
the argument mapping, ``+inf`` empty rows returned as ``-inf``, and the declined calls. Not
hardware results."""

from __future__ import annotations

import pytest
import torch

import xpu_ops
from xpu_ops import sgl_kernel as sk
from xpu_ops.testing_flash_mla import flashmla_cache

from .native_sgl_kernel import define_native_library

I32 = torch.int32


@pytest.fixture
def native():
    namespace = define_native_library("xpu_ops_glue_flash_mla", "writes")
    with sk.bound_to(namespace):
        yield namespace


def _both(fn, *args, **kwargs):
    with xpu_ops.use_provider("sgl_kernel"):
        got = fn(*args, **kwargs)
    with xpu_ops.use_provider("reference"):
        want = fn(*args, **kwargs)
    return got, want


@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_decode_equals_reference(native, fp8):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(3, 4, 576, generator=gen) / 4
    cache = flashmla_cache(values, torch.ones(3, 4, dtype=torch.bool), 512, fp8, torch.bfloat16)
    q = (torch.randn(2, 2, 4, 576, generator=gen) / 4).bfloat16()
    indices = torch.randint(-1, 12, (2, 2, 5), generator=gen).to(I32)
    indices[0, 0] = -1                                               # an empty row
    extra = flashmla_cache(values[:1], torch.ones(1, 4, dtype=torch.bool), 512, fp8,
                           torch.bfloat16)
    extra_idx = torch.randint(0, 4, (2, 2, 3), generator=gen).to(I32)[:, :, ::1]
    kwargs = dict(indices=indices, attn_sink=torch.randn(4), extra_k_cache=extra,
                  extra_indices_in_kvcache=extra_idx, topk_length=torch.tensor([5, 3], dtype=I32),
                  extra_topk_length=torch.tensor([0, 2], dtype=I32), is_fp8_kvcache=fp8)
    (out, lse), (ref, ref_lse) = _both(xpu_ops.flash_mla_with_kvcache, q, cache, None, None, 512,
                                      None, None, 0.05, **kwargs)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    assert torch.isneginf(lse[0, :, 0]).all()


def test_sparse_prefill_equals_reference(native):
    gen = torch.Generator().manual_seed(1)
    q = (torch.randn(3, 4, 512, generator=gen) / 4).bfloat16()
    kv = (torch.randn(9, 1, 512, generator=gen) / 4).bfloat16()
    indices = torch.randint(-1, 12, (3, 1, 6), generator=gen).to(I32)
    indices[1] = 20                                                   # no valid index
    got, want = _both(xpu_ops.flash_mla_sparse_fwd, q, kv, indices, 0.05, 512,
                      torch.randn(4), torch.tensor([6, 6, 2], dtype=I32))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert torch.isneginf(got[2][1]).all()


def test_declined_calls_name_the_reason(native):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, 4, 576, generator=gen)
    cache = torch.randn(2, 4, 1, 576, generator=gen)
    table, lens = torch.zeros(1, 2, dtype=I32), torch.tensor([5], dtype=I32)
    with xpu_ops.use_provider("sgl_kernel"):
        with pytest.raises(NotImplementedError, match="no dense"):
            xpu_ops.flash_mla_with_kvcache(q.bfloat16(), cache.bfloat16(), table, lens, 512)
        with pytest.raises(NotImplementedError, match="bfloat16 queries"):
            xpu_ops.flash_mla_with_kvcache(q, cache, None, None, 512,
                                           indices=torch.zeros(1, 1, 2, dtype=I32))
        with pytest.raises(NotImplementedError, match="Dv = 512"):
            xpu_ops.flash_mla_sparse_fwd(q[0].bfloat16(), cache[0].bfloat16(),
                                         torch.zeros(1, 1, 2, dtype=I32), 0.1, d_v=256)


def test_raw_native_ops_get_fakes(native):
    names = xpu_ops.register_sgl_kernel_fakes(native)
    assert f"{native}::flash_mla_sparse_decode" in names or xpu_ops.sgl_kernel_fakes.has_fake(
        f"{native}::flash_mla_sparse_decode")
