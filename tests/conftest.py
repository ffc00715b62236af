"""Fixtures of every test: xpu_ops' environment variables read afresh around each test.

xpu_ops reads ``XPU_OPS_PROVIDER``, ``TRITON_INTERPRET`` and ``XPU_OPS_DEBUG_CHECKS`` once
(``xpu_ops.refresh()`` reads them again), so a test that changes one uses ``xpu_env``, and the
environment that ``monkeypatch`` restores after a test is read again before the next one.
"""

from __future__ import annotations

from typing import Callable, Optional

import pytest

import xpu_ops


@pytest.fixture(autouse=True)
def _environment_read_per_test():
    xpu_ops.refresh()
    yield
    xpu_ops.refresh()


@pytest.fixture
def xpu_env(monkeypatch) -> Callable[[str, Optional[str]], None]:
    """``xpu_env(name, value)``: set environment variable ``name`` to ``value`` (None: unset it)
    for this test, then ``xpu_ops.refresh()`` so the next op call sees it."""
    def set_env(name: str, value: Optional[str]) -> None:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        xpu_ops.refresh()
    return set_env
