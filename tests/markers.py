"""Markers for tests that need an accelerator, in one place.

``requires_gpu`` (module ``pytestmark`` or a decorator) marks a test ``gpu`` and skips it where
no CUDA or XPU device is present; ``requires_gpu_graphs`` does the same for tests that capture
device graphs. The default ``addopts`` (``-m 'not gpu'``) deselects both; on the GPU machine run
``pytest -m gpu``.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch


def _gpu_device() -> Optional[str]:
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return None


GPU_DEVICE: Optional[str] = _gpu_device()   # "cuda", "xpu" or None
requires_gpu = [pytest.mark.gpu,
                pytest.mark.skipif(GPU_DEVICE is None, reason="needs a CUDA or XPU device")]


def requires_gpu_graphs(test):
    """Decorator: mark ``test`` (a function or class) ``gpu`` and skip it unless the current
    device can capture and replay device graphs (``compile.graphs.device.supports_graphs``)."""
    from compile.graphs import device as dev
    skip = pytest.mark.skipif(not dev.supports_graphs(dev.as_device()),
                              reason="needs CUDA/XPU graphs")
    return pytest.mark.gpu(skip(test))
