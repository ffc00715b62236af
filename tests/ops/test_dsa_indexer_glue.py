"""The ``sgl_kernel`` provider of the DSA indexer ops, against the test-only stand-in of
sgl-kernel-xpu's native library (``native_sgl_kernel``: its schemas and input contract, zeros
past each row, top-k positions in no order): the glue meets xpu-ops' contract (``-inf`` past a
row and for hidden blocks, ascending positions) and declines what the native kernels do not
serve (``next_n > 1``, ``topk != 2048``). Glue tests, not hardware results."""

from __future__ import annotations

import pytest
import torch

import xpu_ops
from xpu_ops import sgl_kernel as sk
from xpu_ops.index_k_layout import blocks_to_tokens
from xpu_ops.testing import sample_inputs

from . import dsa_oracle as oracle
from .native_sgl_kernel import define_native_library

I32 = torch.int32


@pytest.fixture(autouse=True)
def native():
    with sk.bound_to(define_native_library("xpu_ops_glue_dsa", "writes")):
        xpu_ops.refresh()
        yield
    xpu_ops.refresh()


@pytest.mark.parametrize("index", [0, 3, 4])          # the samples with next_n = 1
def test_paged_logits_through_the_native_op_match_the_oracle(index):
    q, cache, w, lens, table, max_len, _ = list(sample_inputs(
        torch.ops.xpu_ops.fp8_paged_mqa_logits, "cpu", seed=index))[index][0]
    with xpu_ops.use_provider("sgl_kernel"):
        got = xpu_ops.fp8_paged_mqa_logits(q, cache, w, lens, table, None, max_len)
    want, bound = oracle.paged_mqa_logits(q, cache, w, lens, table, max_len)
    assert torch.equal(got == -torch.inf, want == -torch.inf)
    finite = want != -torch.inf
    assert bool(((got.double() - want).abs()[finite] <= 1e-5 * bound[finite] + 1e-6).all())


def test_next_n_above_one_is_declined():
    args, _ = list(sample_inputs(torch.ops.xpu_ops.fp8_paged_mqa_logits, "cpu"))[1]
    with xpu_ops.use_provider("sgl_kernel"), pytest.raises(NotImplementedError, match="next_n"):
        torch.ops.xpu_ops.fp8_paged_mqa_logits(*args)


def _rows(seed):
    gen = torch.Generator().manual_seed(seed)
    score = torch.randn(5, 3000, generator=gen)
    score[1] = score[1].round()                       # ties, none at the 2048th score below
    lengths = torch.tensor([3000, 100, 2048, 2500, 0], dtype=I32)
    return score, lengths


def test_topk_2048_through_the_native_op_is_sorted_and_equals_the_reference():
    score, lengths = _rows(1)
    starts = torch.tensor([0, 5, 0, 500, 0], dtype=I32)
    with xpu_ops.use_provider("sgl_kernel"):
        got = xpu_ops.fast_topk_v2(score, lengths, 2048, starts)
    assert got.tolist() == oracle.topk_positions(score, lengths, starts, 2048)
    table = torch.randint(0, 10 ** 6, (2, 3000), dtype=I32)
    cu = torch.tensor([0, 2, 5], dtype=I32)
    with xpu_ops.use_provider("sgl_kernel"):
        slots = xpu_ops.fast_topk_transform_fused(score, lengths, table, cu, 2048)
    assert slots.tolist() == oracle.topk_slots(score, lengths, table, cu, None, 2048)


def test_topk_other_than_2048_is_declined():
    score, lengths = _rows(2)
    with xpu_ops.use_provider("sgl_kernel"), pytest.raises(NotImplementedError, match="2048"):
        xpu_ops.fast_topk_v2(score, lengths, 64)


def test_the_sgl_kernel_shim_exports_the_indexer_functions():
    module = xpu_ops.compat.install_sgl_kernel_shim()
    try:
        if not xpu_ops.compat.is_shim(module):
            pytest.skip("a real sgl_kernel is installed here")
        from sgl_kernel import (fast_topk_transform_fused, fast_topk_transform_ragged_fused,
                                fast_topk_v2, fp8_mqa_logits, fp8_paged_mqa_logits,
                                hadamard_transform)
        assert (fp8_mqa_logits, fp8_paged_mqa_logits, hadamard_transform, fast_topk_v2,
                fast_topk_transform_fused, fast_topk_transform_ragged_fused) == (
            xpu_ops.fp8_mqa_logits, xpu_ops.fp8_paged_mqa_logits, xpu_ops.hadamard_transform,
            xpu_ops.fast_topk_v2, xpu_ops.fast_topk_transform_fused,
            xpu_ops.fast_topk_transform_ragged_fused)
    finally:
        xpu_ops.compat.uninstall_sgl_kernel_shim()


def test_native_indexer_ops_get_fakes_and_compile_fullgraph():
    """sglang's DSA backend calls the raw native ops: with ``register_sgl_kernel_fakes`` they
    trace (shape of the logits, top-k written in place) and a compiled call equals eager."""
    namespace = define_native_library("xpu_ops_glue_dsa_fakes", "writes")
    xpu_ops.register_sgl_kernel_fakes(namespace)
    ops = getattr(torch.ops, namespace)
    q, cache, w, lens, table, max_len, _ = list(sample_inputs(
        torch.ops.xpu_ops.fp8_paged_mqa_logits, "cpu"))[0][0]
    width = 2100
    table = torch.cat([table, table.new_zeros(table.shape[0], 600)], 1)   # room for 2100 keys

    def step(q, cache, w, lens, table):
        logits = ops.fp8_paged_mqa_logits(q.view(torch.uint8), cache, w, lens, table, None,
                                          width, False)
        indices = torch.empty(logits.shape[0], 2048, dtype=I32)
        ops.fast_topk(logits, indices, lens, None)
        return logits, indices

    args = (q, blocks_to_tokens(cache), w, lens.clamp(max=8), table)   # the native layout
    want = step(*args)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(*args)
    assert want[0].shape == (q.shape[0], width)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
