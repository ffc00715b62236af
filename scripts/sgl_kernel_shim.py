"""pytest plugin (``-p sgl_kernel_shim``): ``import sgl_kernel`` resolves to xpu-ops in this run.

Loaded by the client-test runners (``scripts/run_sgl_kernel_tests.py``,
``scripts/run_sgl_kernel_xpu_tests.py``) before the test files are imported, so sgl-kernel's and
sgl-kernel-xpu's own tests run on ``xpu_ops.compat.install_sgl_kernel_shim()``. Refuses to run
when a real ``sgl_kernel`` is installed: the shim never shadows one, and the run would test that
package instead of xpu-ops.

Also:

* ``--xpu-ops-shard=i/n``: keep every n-th test of the collection sorted by node id, starting
  with the i-th (1-based), so n jobs split a file's tests evenly (each xdist worker collects the
  same list and keeps the same tests).
* ``XPU_OPS_TEST_RESULTS=<path>``: append ``{"nodeid", "when", "outcome", "seconds"}`` as one
  JSON line per test phase report as it arrives (in the controller under xdist), so a job
  stopped at its budget keeps the outcomes of the tests that ran, and the seconds of each phase
  (where the GPU time goes, for planning the runs).
"""

from __future__ import annotations

import json
import os

import pytest

import xpu_ops

_MODULE = xpu_ops.compat.install_sgl_kernel_shim()


def pytest_addoption(parser):
    parser.addoption("--xpu-ops-shard", default=None,
                     help="i/n: run only every n-th test (sorted node ids), starting at the i-th")


def pytest_configure(config):
    if not xpu_ops.compat.is_shim(_MODULE):
        raise pytest.UsageError(
            f"sgl_kernel_shim: `import sgl_kernel` gives the installed package {_MODULE!r}, not "
            "the xpu-ops shim; run in an environment without sgl-kernel.")
    shard = config.getoption("--xpu-ops-shard")
    if shard is not None:
        try:
            index, total = (int(x) for x in shard.split("/"))
            assert 1 <= index <= total
        except (ValueError, AssertionError):
            raise pytest.UsageError(f"--xpu-ops-shard: expected i/n with 1 <= i <= n, got "
                                    f"{shard!r}") from None


def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--xpu-ops-shard")
    if shard is None:
        return
    index, total = (int(x) for x in shard.split("/"))
    order = sorted(range(len(items)), key=lambda i: items[i].nodeid)
    keep = {i for rank, i in enumerate(order) if rank % total == index - 1}
    config.hook.pytest_deselected(items=[it for i, it in enumerate(items) if i not in keep])
    items[:] = [it for i, it in enumerate(items) if i in keep]


def _record(report, when: str) -> None:
    path = os.environ.get("XPU_OPS_TEST_RESULTS")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):   # workers: the controller writes
        return
    record = {"nodeid": report.nodeid, "when": when, "outcome": report.outcome,
              "seconds": round(getattr(report, "duration", 0.0), 3)}
    if report.failed:                    # the exception line ("E   ...") says what broke
        lines = [line for line in report.longreprtext.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("E ")]
        record["message"] = (errors or lines or [""])[-1][:300]
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_runtest_logreport(report):
    _record(report, report.when)


def pytest_collectreport(report):
    if report.failed:               # a file that does not import: one error for the file
        _record(report, "collect")
