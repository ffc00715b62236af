"""GPU check of the FlashMLA kernel's fused split-KV merge at DeepSeek-V3.2's sparse decode shape
(128 heads, 576 = 512 + 64, top-2048 of a 64-token paged cache, bf16): the planned launch splits
(4 requests x 8 head blocks leave the device mostly empty), matches the reference provider with
NaN in every unselected slot, replays bit for bit inside a CUDA graph, and leaves the stream
workspace's counters zero. Marked ``gpu``: ``pytest -m gpu tests/ops/test_flash_mla_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

import xpu_ops

from ..markers import GPU_DEVICE, requires_gpu

pytestmark = requires_gpu
OP = torch.ops.xpu_ops.flash_mla_with_kvcache


def _sparse_decode(b=4, h=128, d=576, dv=512, pages=256, page=64, topk=2048):
    gen = torch.Generator(device=GPU_DEVICE).manual_seed(3)
    cache = torch.randn(pages, page, 1, d, device=GPU_DEVICE, generator=gen, dtype=torch.bfloat16)
    picked = torch.stack([torch.randperm(pages * page, device=GPU_DEVICE, generator=gen)[:topk]
                          for _ in range(b)]).view(b, 1, topk).int()
    unselected = torch.ones(pages * page, dtype=torch.bool, device=GPU_DEVICE)
    unselected[picked.flatten().long()] = False
    cache.view(pages * page, d)[unselected] = float("nan")   # only selected slots may be read
    q = torch.randn(b, 1, h, d, device=GPU_DEVICE, generator=gen, dtype=torch.bfloat16)
    lengths = torch.tensor([topk, topk - 1, 1000, 17][:b], dtype=torch.int32, device=GPU_DEVICE)
    return [q, cache, None, None, dv, d ** -0.5, False, False, picked, None, None, None,
            lengths, None]


def test_sparse_decode_split_merge_matches_reference_and_replays_bitwise():
    if GPU_DEVICE != "cuda":
        pytest.skip("CUDA graphs")
    from xpu_ops.triton import flash_mla
    from xpu_ops.triton import paged_attention as pa
    args = _sparse_decode()
    grids = []
    real = flash_mla.launch

    def spy(kernel, grid, device, *a, **kw):
        grids.append(grid)
        return real(kernel, grid, device, *a, **kw)
    with xpu_ops.use_provider("reference"):
        ref_out, ref_lse = OP(*args)
    flash_mla.launch = spy
    try:
        with xpu_ops.use_provider("triton"):
            out, lse = OP(*args)
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                OP(*args)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                g_out, g_lse = OP(*args)
    finally:
        flash_mla.launch = real
    assert len(grids) == 3 and all(g[2] > 1 for g in grids), grids   # one split launch each
    err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
    assert not out.isnan().any() and err < 1e-2, err
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(g_out, out) and torch.equal(g_lse, lse)
    for ws in pa._WORKSPACES.values():
        assert (ws[2] == 0).all()
