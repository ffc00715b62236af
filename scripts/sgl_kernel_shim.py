"""pytest plugin (``-p sgl_kernel_shim``): ``import sgl_kernel`` resolves to xpu-ops in this run.

Loaded by ``scripts/run_sgl_kernel_tests.py`` before the test files are imported, so sgl-kernel's
own tests run unmodified on ``xpu_ops.compat.install_sgl_kernel_shim()``. Refuses to run when a
real ``sgl_kernel`` is installed: the shim never shadows one, and the run would test that
package instead of xpu-ops.
"""

from __future__ import annotations

import pytest

import xpu_ops

_MODULE = xpu_ops.compat.install_sgl_kernel_shim()


def pytest_configure(config):
    if not xpu_ops.compat.is_shim(_MODULE):
        raise pytest.UsageError(
            f"sgl_kernel_shim: `import sgl_kernel` gives the installed package {_MODULE!r}, not "
            "the xpu-ops shim; run in an environment without sgl-kernel.")
