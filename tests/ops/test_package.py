"""The ``xpu_ops`` package namespace: what a plain ``import xpu_ops`` makes reachable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_testing_is_an_attribute_after_a_plain_import_and_imported_lazily():
    """README/API.md spell ``xpu_ops.testing.sample_inputs(op, device)``: it works after only
    ``import xpu_ops``, which still does not import the testing modules (a fresh interpreter,
    since this process has imported them already)."""
    code = (
        "import sys, xpu_ops\n"
        "assert 'xpu_ops.testing' not in sys.modules, 'import xpu_ops imported xpu_ops.testing'\n"
        "assert 'xpu_ops.testing_layouts' not in sys.modules\n"
        "op = xpu_ops.REGISTERED_OPS[0]\n"
        "args, kwargs = next(iter(xpu_ops.testing.sample_inputs(op, 'cpu')))\n"
        "assert xpu_ops.testing is sys.modules['xpu_ops.testing']\n"
        "assert xpu_ops.testing_layouts is sys.modules['xpu_ops.testing_layouts']\n"
        "try:\n"
        "    xpu_ops.no_such_name\n"
        "except AttributeError as e:\n"
        "    assert \"has no attribute 'no_such_name'\" in str(e), e\n"
        "else:\n"
        "    raise AssertionError('xpu_ops.no_such_name did not raise')\n"
        "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
