"""The FlashMLA kernel's fused split-KV merge (``xpu_ops/triton/flash_mla.py``): one launch,
the last split of each (row, head block) to arrive merges all of them.

Against the float64 oracle under Triton's interpreter, with the split count forced: the
stream's split workspace poisoned with NaN beforehand (every partial the merge reads was written
by this launch) and its counters zero afterwards (the next launch and graph replays may reuse
them); a second call gives the same bits; a launch without the workspace (as inside a graph
capture) takes fresh buffers; no second kernel is launched.
"""

from __future__ import annotations

import math

import pytest

from .triton_mode import provider_params, rerun_in_subprocess, running  # first

import torch  # noqa: E402

from xpu_ops.triton import flash_mla  # noqa: E402
from xpu_ops.triton import paged_attention as pa  # noqa: E402

from . import oracle_flash_mla as oracle  # noqa: E402
from .test_flash_mla_kvcache import _sparse_args  # noqa: E402
from .utils import assert_matches_oracle  # noqa: E402

OP = torch.ops.xpu_ops.flash_mla_with_kvcache
TRITON = [p for p in provider_params() if p.values[0] == "triton"]
I32 = torch.int32
test_rerun_in_subprocess = rerun_in_subprocess(__file__)


def _args():
    """bf16 fp8-free sparse decode: 2 requests x 2 query rows, 40 ranks (3 splits of 16-rank
    tiles: 16, 16, 8), a sink per head (one +inf) and an extra cache in the last split."""
    args = _sparse_args(5, d=288, dv=256, topk=40, pages=(6, 8), dtype=torch.bfloat16)
    args[9] = torch.tensor([0.0, math.inf, -1.0, 1.0])
    args[10], args[11] = args[1][:2], torch.randint(-1, 16, (2, 2, 5), dtype=I32)
    args[12] = torch.tensor([40, 17], dtype=I32)
    return args


def _launches(args, provider):
    seen = []
    real = flash_mla.launch

    def spy(kernel, grid, device, *a, **kw):
        seen.append((kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), grid))
        return real(kernel, grid, device, *a, **kw)
    flash_mla.launch = spy
    try:
        with running(provider):
            out, lse = OP(*args)
    finally:
        flash_mla.launch = real
    return out, lse, seen


@pytest.mark.parametrize("provider", TRITON)
def test_one_launch_merges_poisoned_splits_and_leaves_counters_zero(provider, monkeypatch):
    monkeypatch.setattr(flash_mla, "plan_splits", lambda *args: 3)
    ws = pa._workspace(torch.device("cpu"), 1 << 16, 0, 64)
    ws[0].fill_(float("nan"))
    args = _args()
    out, lse, seen = _launches(args, provider)
    expected, expected_lse = oracle.flash_mla_with_kvcache(*args)
    assert_matches_oracle(out, expected, args[0].dtype, lse, expected_lse)
    assert [(name, grid[2]) for name, grid in seen] == [("_flash_mla_kernel", 3)]
    assert (pa._workspace(torch.device("cpu"), 0, 0, 64)[2] == 0).all()
    again, again_lse, _ = _launches(args, provider)
    assert torch.equal(again, out) and torch.equal(again_lse, lse)


@pytest.mark.parametrize("provider", TRITON)
def test_a_launch_without_the_workspace_takes_fresh_buffers(provider, monkeypatch):
    """As inside a graph capture (no stream workspace): partials and counters of the call."""
    monkeypatch.setattr(flash_mla, "plan_splits", lambda *args: 2)
    monkeypatch.setattr(flash_mla, "_workspace", lambda *args: None)
    args = _args()
    out, lse, seen = _launches(args, provider)
    expected, expected_lse = oracle.flash_mla_with_kvcache(*args)
    assert_matches_oracle(out, expected, args[0].dtype, lse, expected_lse)
    assert [grid[2] for _, grid in seen] == [2]
