"""The split plan's shared-memory estimate of a decode program
(``paged_attention.decode_program_smem``) gives the residency that the compiled kernel's
shared memory gives, for the two default decode tiles (D 128: 16 x 64 keys, 2 warps, 4 stages;
D 64 at a small batch: 16 x 128 keys, 4 warps, 3 stages), compiled for sm_90 without a GPU."""

import re

import pytest
import torch

import compile_kernels as ck
from xpu_ops.triton import paged_attention as pa
from xpu_ops.triton import split_plan

H100_SMEM = 228 * 1024


@pytest.mark.parametrize("name", ["decode page 64", "decode b1 1k page 16 D64"])
def test_estimated_residency_is_the_compiled_one(name):
    case = next(c for c in ck.workloads() if c[0] == name)
    _, q_lens, k_lens, page, hq, hkv, d, dv, kv_dtype = case[:9]
    _, params = ck.launch_args(case, frozenset({"page_tiles"}), 132)
    meta = params.meta
    cfg = pa._Config(meta["BLOCK_M"], meta["BLOCK_N"], meta["num_warps"], meta["num_stages"])
    estimate = pa.decode_program_smem(cfg, meta["D_PAD"], meta["DV_PAD"], 2,
                                      torch.empty((), dtype=kv_dtype).element_size())
    _, resources = ck.compile_one(case, frozenset({"page_tiles"}), 90, 132)
    compiled = int(re.search(r"dynamic shared (\d+) KiB", resources)[1]) * 1024
    assert abs(estimate - compiled) <= 0.1 * compiled, (estimate, compiled)
    assert split_plan.resident_programs(estimate, H100_SMEM, 2, pa.DECODE_MAX_RESIDENT) == \
        split_plan.resident_programs(compiled, H100_SMEM, 2, pa.DECODE_MAX_RESIDENT)


@pytest.mark.parametrize("name, resident, splits", [("decode b1 1k page 16 D64", 3, 5),
                                                    ("decode page 64", 2, 2)])
def test_a_cuda_launch_plans_with_the_residency_of_its_tiles(name, resident, splits,
                                                             monkeypatch):
    """On an H100/H200-sized device (132 multiprocessors of 228 KiB): the D 64 small-batch
    tiles count 3 resident programs, the D 128 tiles 2, and the launch's split count is the
    plan's at that residency (what bench_decode_graph reports as planned). The harness's page
    tables hold one page more than the longest request: 1040 keys (5 splits of >= 256 keys on
    396 slots) and 4160 (two chunks of >= 4096 keys)."""
    monkeypatch.setattr(pa, "smem_per_sm", lambda device: H100_SMEM)
    pa._launch_params.cache_clear()
    case = next(c for c in ck.workloads() if c[0] == name)
    try:
        _, params = ck.launch_args(case, frozenset({"page_tiles"}), 132)
    finally:
        pa._launch_params.cache_clear()
    meta = params.meta
    cfg = pa._Config(meta["BLOCK_M"], meta["BLOCK_N"], meta["num_warps"], meta["num_stages"])
    cuda = torch.device("cuda")
    assert pa.decode_resident(cuda, cfg, meta["D_PAD"], meta["DV_PAD"], 2, 2) == resident
    assert params.num_splits == splits
