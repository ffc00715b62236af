"""The edge-case table (``edge_cases.py``) on every path of every provider, against the float64
oracle, with NaN in ``out`` and every unused cache slot and guard regions around strided views.

The reference runs every path on every case. Triton (interpreted, ~0.3 s a launch) runs its
one pass and split-KV on every case and each optional kernel path on a rotating share of the
cases, so every path meets several cases in CI; ``XPU_OPS_EDGE_CASES=all`` runs the whole cross
product, and ``test_edge_cases_on_gpu`` runs it compiled on the GPU.
"""

from __future__ import annotations

import os

import pytest

from .triton_mode import INTERPRETED, rerun_in_subprocess, running  # first

import torch  # noqa: E402

import xpu_ops  # noqa: E402

from .edge_cases import (EDGE_CASES, REFERENCE_PATHS, TRITON_PATHS, applies,  # noqa: E402
                         check_result, edge_case_inputs, oracle_of, run_path)
from ..markers import GPU_DEVICE  # noqa: E402

test_rerun_in_subprocess = rerun_in_subprocess(__file__)
_ALL = os.environ.get("XPU_OPS_EDGE_CASES") == "all"
_OPTIONAL = TRITON_PATHS[2:]


def _params():
    params = []
    for i, (name, edge) in enumerate(EDGE_CASES.items()):
        for path in REFERENCE_PATHS:
            if applies(edge, path):
                params.append(pytest.param(name, "reference", path, id=f"{name}-reference-{path}"))
        rotated = {_OPTIONAL[i % len(_OPTIONAL)], _OPTIONAL[(i + 3) % len(_OPTIONAL)]}
        for path in TRITON_PATHS:
            if path in _OPTIONAL and not (_ALL or path in rotated):
                continue
            marks = pytest.mark.skipif(not INTERPRETED, reason="Triton in compile mode here; "
                                       "test_rerun_in_subprocess covers it")
            params.append(pytest.param(name, "triton", path, id=f"{name}-triton-{path}",
                                       marks=marks))
    return params


def _check(name, provider, path, device):
    edge = EDGE_CASES[name]
    args, kwargs, guards = edge_case_inputs(edge, device)
    want, want_lse = oracle_of(edge, tuple(t.cpu() if isinstance(t, torch.Tensor) else t
                                           for t in args), kwargs)
    out, lse = run_path(edge, path, args, kwargs)
    check_result(edge, out.cpu(), None if lse is None else lse.cpu(), want, want_lse, guards)


@pytest.mark.parametrize("name, provider, path", _params())
def test_edge_case(name, provider, path):
    with running(provider):
        _check(name, provider, path, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("provider, path", [("reference", "general"), ("reference", "one-pass")]
                         + [("triton", p) for p in TRITON_PATHS])
@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_cases_on_gpu(name, provider, path):
    """The whole table, Triton compiled: ``pytest -m gpu tests/ops/test_edge_cases.py``."""
    if GPU_DEVICE is None:
        pytest.skip("needs a CUDA or XPU device")
    with xpu_ops.use_provider(provider):
        _check(name, provider, path, GPU_DEVICE)
