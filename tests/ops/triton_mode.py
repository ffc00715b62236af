"""Import Triton for the CPU tests in interpreter mode, whichever test module imports it first.

Triton reads ``TRITON_INTERPRET`` once per ``@triton.jit`` decoration, i.e. at import time, and
that includes its own standard library (``tl.zeros_like``, the reduction combiners): a kernel
interpreted later still calls those as compiled ``JITFunction``s and fails with "Cannot call
@triton.jit'd outside of the scope of a kernel". So this module sets the variable, imports Triton
and restores the environment at once (``xpu_ops`` keeps choosing the ``reference`` provider on
CPU for other modules; tests that run Triton set the variable again while they run).
``INTERPRETED`` is False when something imported Triton in compile mode before this module, and
on a machine with a CUDA/XPU device, where Triton must compile (the GPU tests need it).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

_GPU = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
_FRESH = "triton" not in sys.modules and not _GPU
if _FRESH:
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
    import triton.language as tl  # noqa: E402
finally:
    if _FRESH:
        if _saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = _saved

# True when Triton's language library was decorated for the interpreter.
INTERPRETED = type(tl.zeros_like).__name__ == "InterpretedFunction"

__all__ = ["INTERPRETED", "tl", "triton"]
