"""``tests/compile/engine/test_parallel.py``'s checks on 2 GPUs with NCCL, plus TP=2 under the
serving path (``full_and_piecewise``: decode steps captured whole, the all-reduces inside the
graphs).

Run on a 2-GPU machine (``nvidia-h200-x2``, NVLink multicast off as KINDS.md says):
``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python -m pytest -m gpu -q
tests/compile/engine/test_parallel_gpu.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.compile.engine.test_parallel import (LAYERS, SCENARIOS, _assert_same_run, _worker,
                                         generate, tiny_model)

NAMES = ("tp", "tp_kv1", "dcp", "tp_graphs")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA devices")]


@pytest.fixture(scope="module")
def gpu_ranks(tmp_path_factory) -> list[dict]:
    path = str(tmp_path_factory.mktemp("parallel_gpu"))
    mp.spawn(_worker, args=(2, path, "cuda", NAMES), nprocs=2, join=True)
    return [torch.load(os.path.join(path, f"rank{r}.pt")) for r in range(2)]


@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_one_gpu(gpu_ranks, name):
    torch.manual_seed(0)
    expected = generate(tiny_model(LAYERS, device="cuda:0", **SCENARIOS[name]))[:2]
    for r in range(2):
        _assert_same_run(gpu_ranks[r][name], expected, tol=1e-4)   # sharded matmul sums
