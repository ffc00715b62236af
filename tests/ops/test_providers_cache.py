"""``providers.select`` caches availability: every switch still takes effect on the next call.

The cache (``xpu_ops/providers.py``) is keyed on op, device type and the functions declared with
``availability_depends_on``; ``use_provider``, ``XPU_OPS_PROVIDER`` and ``supports`` are read
on every call. Each test warms the cache first, then flips a switch and checks the very next
selection against ``providers.candidates`` (which asks every ``available`` afresh).
"""

from __future__ import annotations

import os

import pytest
import torch

import xpu_ops
from xpu_ops import providers
from xpu_ops import sgl_kernel as sk
from xpu_ops.triton import _common as triton_common

from .native_sgl_kernel import define_native_library

OP = "flash_attn_with_kvcache"
# Ops whose selection runs no ``supports`` hook of a provider that may be chosen, so ``select``
# can be called without arguments: triton's and sgl_kernel's implementations respectively.
TRITON_OP, SGL_OP = "prepare_swa_spec_page_table", "merge_state_v2"
CPU = torch.device("cpu")


def _uncached_choice(op: str, device_type: str = "cpu") -> str:
    """First provider that ``candidates`` (no cache) says can run: the default selection when
    no ``supports`` declines."""
    return next(name for name, reason in providers.candidates(op, device_type) if reason is None)


@pytest.fixture
def test_op():
    """A throw-away op name; its implementations are removed afterwards."""
    name = "providers_cache_test_op"
    yield name
    providers._registry.pop(name, None)
    providers.invalidate_cache()


def test_use_provider_forces_after_the_cache_is_warm(monkeypatch):
    monkeypatch.delenv("XPU_OPS_PROVIDER", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    default = providers.select(OP, CPU).provider
    assert default == _uncached_choice(OP)
    with xpu_ops.use_provider("reference"):
        assert providers.select(OP, CPU).provider == "reference"
    with xpu_ops.use_provider("triton"):
        with pytest.raises(RuntimeError, match="provider 'triton' was requested .* cannot run on "
                                               "cpu"):
            providers.select(OP, CPU)
    assert providers.select(OP, CPU).provider == default


def test_env_provider_is_read_on_every_call(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("XPU_OPS_PROVIDER", raising=False)
    default = providers.select(OP, CPU).provider
    monkeypatch.setenv("XPU_OPS_PROVIDER", "reference")
    assert providers.select(OP, CPU).provider == "reference"
    monkeypatch.setenv("XPU_OPS_PROVIDER", "bogus")
    with pytest.raises(ValueError, match="'bogus' is not a provider"):
        providers.select(OP, CPU)
    os.environ["XPU_OPS_PROVIDER"] = "triton"  # a plain assignment is seen as well
    with pytest.raises(RuntimeError, match="provider 'triton' was requested"):
        providers.select(OP, CPU)
    monkeypatch.delenv("XPU_OPS_PROVIDER")
    assert providers.select(OP, CPU).provider == default


@pytest.mark.skipif(not triton_common.HAS_TRITON, reason="triton is not installed")
def test_triton_interpret_toggle_changes_the_selection(monkeypatch):
    monkeypatch.delenv("XPU_OPS_PROVIDER", raising=False)
    for flag in ("1", "0", "1", None):
        if flag is None:
            monkeypatch.delenv("TRITON_INTERPRET")
        else:
            monkeypatch.setenv("TRITON_INTERPRET", flag)
        assert providers.select(TRITON_OP, CPU).provider == _uncached_choice(TRITON_OP), flag
        with xpu_ops.use_provider("triton"):
            if flag == "1":
                assert providers.select(TRITON_OP, CPU).provider == "triton"
            else:
                with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
                    providers.select(TRITON_OP, CPU)


def test_sgl_kernel_binding_changes_the_selection(monkeypatch):
    monkeypatch.delenv("XPU_OPS_PROVIDER", raising=False)
    outside = providers.select(SGL_OP, CPU).provider
    with sk.bound_to(define_native_library("xpu_ops_providers_cache_native")):
        assert providers.select(SGL_OP, CPU).provider == "sgl_kernel"
    assert providers.select(SGL_OP, CPU).provider == outside


def test_registering_an_implementation_clears_the_cache(test_op):
    providers.register(test_op, "reference")(lambda x: "reference")
    assert providers.select(test_op, CPU).provider == "reference"
    providers.register(test_op, "triton", available=lambda device_type: None)(lambda x: "triton")
    assert providers.select(test_op, CPU).provider == "triton"


def test_declared_state_is_part_of_the_key(test_op, monkeypatch):
    state = {"up": False}
    read = lambda: state["up"]  # noqa: E731
    monkeypatch.setattr(providers, "_state_fns", list(providers._state_fns))
    providers.availability_depends_on(read)
    providers.register(test_op, "reference")(lambda: None)
    providers.register(test_op, "triton",
                       available=lambda dt: None if state["up"] else "down")(lambda: None)
    assert providers.select(test_op, CPU).provider == "reference"
    state["up"] = True
    assert providers.select(test_op, CPU).provider == "triton"
    state["up"] = False
    assert providers.select(test_op, CPU).provider == "reference"


def test_supports_runs_on_every_call_and_fallbacks_are_counted(test_op):
    providers.register(test_op, "reference")(lambda n: None)
    providers.register(test_op, "triton", available=lambda dt: None,
                       supports=lambda n: None if n < 8 else f"n={n} is too large")(lambda n: None)
    assert providers.select(test_op, CPU, 4).provider == "triton"
    key = (test_op, "triton", "n=9 is too large")
    with pytest.warns(UserWarning, match="declined this call"):
        assert providers.select(test_op, CPU, 9).provider == "reference"
    assert providers.select(test_op, CPU, 9).provider == "reference"
    assert providers.fallbacks()[key] == 2
    assert providers.select(test_op, CPU, 4).provider == "triton"
    providers._fallbacks.pop(key)


def test_getenv_follows_os_environ(monkeypatch):
    name = "XPU_OPS_PROVIDERS_CACHE_TEST"
    monkeypatch.delenv(name, raising=False)
    assert providers.getenv(name) is None
    monkeypatch.setenv(name, "1")
    assert providers.getenv(name) == "1"
    os.environ[name] = "é"
    assert providers.getenv(name) == "é" == os.environ[name]
    del os.environ[name]
    assert providers.getenv(name) is None
