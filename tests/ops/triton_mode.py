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

import contextlib
import os
import subprocess
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


def provider_params() -> list:
    """``pytest.param`` of the providers to compare on the CPU: ``reference`` and ``triton``
    (the latter skipped when Triton is in compile mode here; ``rerun_in_subprocess`` covers it)."""
    skip = pytest.mark.skipif(not INTERPRETED, reason="Triton was imported in compile mode "
                              "before this module; its test_rerun_in_subprocess covers it")
    return [pytest.param("reference", id="reference"),
            pytest.param("triton", id="triton", marks=skip)]


@contextlib.contextmanager
def running(provider: str):
    """Run ``xpu_ops`` ops with ``provider`` (Triton kernels through the interpreter)."""
    import xpu_ops
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    xpu_ops.refresh()  # xpu_ops reads the variable once
    try:
        with xpu_ops.use_provider(provider):
            yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
        xpu_ops.refresh()


@pytest.fixture(autouse=True, scope="module")
def interpret_while_module_runs():
    """``TRITON_INTERPRET=1`` while the importing module's tests run: Triton's lazily imported
    modules check the flag at launch time. Autouse in every module that imports it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    yield
    mp.undo()


def rerun_in_subprocess(path: str):
    """A test that reruns the module at ``path`` in a fresh interpreter-mode process when Triton
    is in compile mode here (then the module's Triton tests skip); skipped otherwise."""
    @pytest.mark.skipif(INTERPRETED, reason="Triton is in interpreter mode in this process")
    def test_rerun_in_subprocess():
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not gpu", "-p",
                               "no:cacheprovider", path], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return test_rerun_in_subprocess


__all__ = ["INTERPRETED", "tl", "triton", "provider_params", "running", "rerun_in_subprocess",
           "interpret_while_module_runs"]
