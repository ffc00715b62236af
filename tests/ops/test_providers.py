"""Routing: ops registered per dispatch key, the provider of each (op, device type) resolved once.

Each op has one kernel per dispatch key (CPU, CUDA, XPU; ``xpu_ops/_registration.py``) that calls
its ``providers.Route``. A route resolves its chain of implementations at the first call and again
only when the forced provider (``use_provider``, ``XPU_OPS_PROVIDER``) or a declared availability
state (the ``sgl_kernel`` binding) differs, or after ``xpu_ops.refresh()``, which also reads the
environment again (``XPU_OPS_PROVIDER``, ``TRITON_INTERPRET``: read once, never per call);
``supports`` runs on every call. Each test warms a route, flips one switch and checks the very next
call.
"""

from __future__ import annotations

import os

import pytest
import torch

import xpu_ops
from xpu_ops import providers
from xpu_ops import sgl_kernel as sk
from xpu_ops._registration import define_op
from xpu_ops.triton import _common as triton_common

from tests.markers import GPU_DEVICE

from .native_sgl_kernel import define_native_library

OP = "flash_attn_with_kvcache"
# Ops whose selection runs no ``supports`` hook of a provider that may be chosen, so ``select``
# can be called without arguments: triton's and sgl_kernel's implementations respectively.
TRITON_OP, SGL_OP = "prepare_swa_spec_page_table", "merge_state_v2"
CPU = torch.device("cpu")
TEST_NS = "xpu_ops_routes_test"


def _uncached_choice(op: str, device_type: str = "cpu") -> str:
    """First provider that ``candidates`` (no cache) says can run: the default selection when
    no ``supports`` declines."""
    return next(name for name, reason in providers.candidates(op, device_type) if reason is None)


class Counting:
    """An ``available`` function that counts how often it is asked."""

    def __init__(self, answer=None):
        self.calls, self.answer = 0, answer

    def __call__(self, device_type: str):
        self.calls += 1
        return self.answer


_defined: dict[str, object] = {}


def _test_op(name: str):
    """``torch.ops.xpu_ops_routes_test.<name>(x) -> Tensor`` defined once with ``by_device``;
    its checks reject a 0-d ``x``."""
    if name not in _defined:
        @define_op(f"{TEST_NS}::{name}", mutates_args=(), by_device=True)
        def op(x: torch.Tensor) -> torch.Tensor:
            if x.dim() == 0:
                raise ValueError(f"{name}: x is 0-d; expected at least 1-D, got shape ().")

        @op.register_fake
        def _(x):
            return torch.empty_like(x)
        _defined[name] = op
    return getattr(getattr(torch.ops, TEST_NS), name)


@pytest.fixture
def test_op(request):
    """A throw-away op (per test) whose implementations are removed afterwards."""
    name = request.node.name.replace("[", "_").replace("]", "").replace("-", "_")[:60]
    packet = _test_op(name)
    yield name, packet
    providers._registry.pop(name, None)
    providers.refresh()


def test_every_op_has_one_kernel_per_dispatch_key():
    for packet in xpu_ops.REGISTERED_OPS:
        qualname = packet._qualified_op_name
        for key in providers.DISPATCH_KEYS.values():
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key), (qualname, key)


def test_other_backends_run_the_checks_then_name_the_device(test_op):
    name, op = test_op
    providers.register(name, "reference")(lambda x: x.clone())
    with pytest.raises(ValueError, match="x is 0-d"):
        op(torch.tensor(1.0).to_sparse())
    with pytest.raises(RuntimeError, match=f"{TEST_NS}::{name}: no provider runs on cpu "
                                           r"torch.sparse_coo tensors; expected dense "
                                           r"\(torch.strided\) tensors on one of \['cpu', "
                                           r"'cuda', 'xpu'\]"):
        op(torch.ones(2).to_sparse())


def test_resolved_once_per_state_and_again_after_a_switch(test_op, xpu_env, monkeypatch):
    name, op = test_op
    xpu_env("XPU_OPS_PROVIDER", None)
    ref, tri = Counting(), Counting()
    providers.register(name, "reference", available=ref)(lambda x: x + 1)
    providers.register(name, "triton", available=tri)(lambda x: x + 2)
    x = torch.zeros(3)
    for _ in range(5):
        assert torch.equal(op(x), x + 2)       # triton first in PROVIDER_ORDER
    assert (ref.calls, tri.calls) == (1, 1)    # asked at the first call only
    with xpu_ops.use_provider("reference"):
        for _ in range(3):
            assert torch.equal(op(x), x + 1)
    assert torch.equal(op(x), x + 2)
    assert (ref.calls, tri.calls) == (2, 2)    # one resolution for the forced state
    with xpu_ops.use_provider("reference"):
        assert torch.equal(op(x), x + 1)
    assert (ref.calls, tri.calls) == (2, 2)    # both states were resolved before
    monkeypatch.setenv("XPU_OPS_PROVIDER", "reference")
    assert torch.equal(op(x), x + 2)           # the environment is not read per call
    providers.refresh()                        # reads it, forgets the resolutions
    assert torch.equal(op(x), x + 1) and (ref.calls, tri.calls) == (3, 3)
    xpu_env("XPU_OPS_PROVIDER", None)
    assert torch.equal(op(x), x + 2) and (ref.calls, tri.calls) == (4, 4)


def test_the_dispatcher_routes_by_device_type(test_op):
    name, op = test_op
    seen = []
    providers.register(name, "reference")(lambda x: seen.append(x.device.type) or x.clone())
    assert providers.route(name, "cpu") is providers.route(name, "cpu")
    op(torch.ones(2))
    assert seen == ["cpu"]
    cuda_route = providers.route(name, "cuda")
    assert cuda_route._current[1] == ()        # never called: nothing resolved for cuda
    with pytest.raises(ValueError, match="x is 0-d"):  # the checks run before the provider
        op(torch.tensor(1.0))
    assert seen == ["cpu"]
    fake = op(torch.empty(4, device="meta"))   # the fake: no provider runs
    assert fake.shape == (4,) and seen == ["cpu"]


@pytest.mark.gpu
@pytest.mark.skipif(GPU_DEVICE is None, reason="needs a CUDA or XPU device")
def test_gpu_calls_run_the_kernel_of_their_dispatch_key(test_op):
    """On the GPU machine: a CUDA/XPU tensor reaches that device type's route, the CPU route
    stays unresolved, and a registered op's GPU default is its best available provider."""
    name, op = test_op
    seen = []
    providers.register(name, "reference")(lambda x: seen.append(x.device.type) or x.clone())
    op(torch.ones(2, device=GPU_DEVICE))
    assert seen == [GPU_DEVICE] and providers.route(name, "cpu")._current[1] == ()
    assert providers.select(TRITON_OP, torch.device(GPU_DEVICE)).provider == _uncached_choice(
        TRITON_OP, GPU_DEVICE)


def test_a_failed_resolution_is_not_kept(test_op, xpu_env):
    name, op = test_op
    xpu_env("XPU_OPS_PROVIDER", None)
    state = {"up": False}
    providers.register(name, "reference")(lambda x: x + 1)
    providers.register(name, "triton",
                       available=lambda dt: None if state["up"] else "down")(lambda x: x + 2)
    x = torch.zeros(1)
    with xpu_ops.use_provider("triton"):
        with pytest.raises(RuntimeError, match="provider 'triton' was requested .* cannot run "
                                               "on cpu: down"):
            op(x)
        state["up"] = True
        assert torch.equal(op(x), x + 2)


def test_use_provider_forces_after_the_route_is_warm(xpu_env):
    xpu_env("XPU_OPS_PROVIDER", None)
    xpu_env("TRITON_INTERPRET", None)
    default = providers.select(OP, CPU).provider
    assert default == _uncached_choice(OP)
    with xpu_ops.use_provider("reference"):
        assert providers.select(OP, CPU).provider == "reference"
    with xpu_ops.use_provider("triton"):
        with pytest.raises(RuntimeError, match="provider 'triton' was requested .* cannot run on "
                                               "cpu"):
            providers.select(OP, CPU)
    assert providers.select(OP, CPU).provider == default


def test_env_provider_is_read_at_refresh(xpu_env):
    xpu_env("TRITON_INTERPRET", None)
    xpu_env("XPU_OPS_PROVIDER", None)
    default = providers.select(OP, CPU).provider
    xpu_env("XPU_OPS_PROVIDER", "reference")
    assert providers.select(OP, CPU).provider == "reference"
    xpu_env("XPU_OPS_PROVIDER", "bogus")
    with pytest.raises(ValueError, match="'bogus' is not a provider"):
        providers.select(OP, CPU)
    os.environ["XPU_OPS_PROVIDER"] = "triton"  # a plain assignment is seen as well
    xpu_ops.refresh()
    with pytest.raises(RuntimeError, match="provider 'triton' was requested"):
        providers.select(OP, CPU)
    xpu_env("XPU_OPS_PROVIDER", None)
    assert providers.select(OP, CPU).provider == default


def test_a_warm_call_reads_no_environment_variable(monkeypatch):
    """``os.environ`` is read when a route resolves, never by the calls after it."""
    v, s = torch.randn(2, 1, 4), torch.randn(2, 1)
    xpu_ops.merge_state_v2(v, s, v, s)
    xpu_ops.store_kv_cache(torch.zeros(4, 1, 4), torch.zeros(4, 1, 4), torch.tensor([1]),
                           v[:1], v[:1])

    class Unreadable(dict):
        def get(self, *args):
            raise AssertionError(f"os.environ read per call: {args}")
        __getitem__ = get
    monkeypatch.setattr(providers.os, "environ", Unreadable())
    out, lse = xpu_ops.merge_state_v2(v, s, v, s)
    assert torch.allclose(out, v) and torch.allclose(lse, s + torch.log(torch.tensor(2.0)))
    kc = torch.zeros(4, 1, 4)
    xpu_ops.store_kv_cache(kc, kc.clone(), torch.tensor([1]), v[:1], v[:1])
    assert torch.equal(kc[1], v[0]) and not kc[[0, 2, 3]].any()


@pytest.mark.skipif(not triton_common.HAS_TRITON, reason="triton is not installed")
def test_triton_interpret_toggle_changes_the_cpu_selection(xpu_env):
    xpu_env("XPU_OPS_PROVIDER", None)
    for flag in ("1", "0", "1", None):
        xpu_env("TRITON_INTERPRET", flag)
        assert providers.select(TRITON_OP, CPU).provider == _uncached_choice(TRITON_OP), flag
        with xpu_ops.use_provider("triton"):
            if flag == "1":
                assert providers.select(TRITON_OP, CPU).provider == "triton"
            else:
                with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
                    providers.select(TRITON_OP, CPU)


def test_sgl_kernel_binding_changes_the_selection(xpu_env):
    xpu_env("XPU_OPS_PROVIDER", None)
    outside = providers.select(SGL_OP, CPU).provider
    with sk.bound_to(define_native_library("xpu_ops_providers_cache_native")):
        assert providers.select(SGL_OP, CPU).provider == "sgl_kernel"
    assert providers.select(SGL_OP, CPU).provider == outside


def test_registering_an_implementation_resolves_again(test_op):
    name, _ = test_op
    providers.register(name, "reference")(lambda x: "reference")
    assert providers.select(name, CPU).provider == "reference"
    providers.register(name, "triton", available=lambda device_type: None)(lambda x: "triton")
    assert providers.select(name, CPU).provider == "triton"


def test_declared_state_is_part_of_the_key_of_its_device_types(test_op):
    name, _ = test_op
    state = {"up": False}
    read = lambda: state["up"]  # noqa: E731
    providers.availability_depends_on(read, device_types=("cpu",))
    try:
        providers.register(name, "reference")(lambda: None)
        providers.register(name, "triton",
                           available=lambda dt: None if state["up"] else "down")(lambda: None)
        assert providers.select(name, CPU).provider == "reference"
        state["up"] = True
        assert providers.select(name, CPU).provider == "triton"
        state["up"] = False
        assert providers.select(name, CPU).provider == "reference"
        assert read not in providers.route(name, "xpu")._fns
    finally:
        providers._state_fns["cpu"].remove(read)
        providers.refresh()


def test_supports_runs_on_every_call_and_fallbacks_are_counted(test_op):
    name, _ = test_op
    providers.register(name, "reference")(lambda n: None)
    providers.register(name, "triton", available=lambda dt: None,
                       supports=lambda n: None if n < 8 else f"n={n} is too large")(lambda n: None)
    assert providers.select(name, CPU, 4).provider == "triton"
    key = (name, "triton", "n=9 is too large")
    with pytest.warns(UserWarning, match="declined this call"):
        assert providers.select(name, CPU, 9).provider == "reference"
    assert providers.select(name, CPU, 9).provider == "reference"
    assert providers.fallbacks()[key] == 2
    assert providers.select(name, CPU, 4).provider == "triton"
    with xpu_ops.use_provider("triton"), pytest.raises(
            NotImplementedError, match="provider 'triton' was requested but does not support "
                                       "this call: n=9 is too large"):
        providers.select(name, CPU, 9)
    providers._fallbacks.pop(key)


def test_getenv_reads_once_until_refresh(monkeypatch):
    name = "XPU_OPS_PROVIDERS_CACHE_TEST"
    monkeypatch.delenv(name, raising=False)
    assert providers.getenv(name) is None
    monkeypatch.setenv(name, "1")
    assert providers.getenv(name) is None
    providers.refresh()
    assert providers.getenv(name) == "1"
    os.environ[name] = "é"
    providers.refresh()
    assert providers.getenv(name) == "é" == os.environ[name]
    del os.environ[name]
    assert providers.getenv(name) == "é"
    providers.refresh()
    assert providers.getenv(name) is None


@pytest.mark.parametrize("op", [torch.ops.xpu_ops.flash_attn_with_kvcache,
                                torch.ops.xpu_ops.flash_attn_varlen_func,
                                torch.ops.xpu_ops.store_kv_cache,
                                torch.ops.xpu_ops.merge_state_v2], ids=lambda op: op.__name__)
def test_decode_layer_ops_take_no_keyword_only_arguments(op):
    """The dispatcher hands a Python kernel its keyword-only arguments as a new dict on every
    call (about half of a 21-argument call's dispatch), so the ops that every decode layer
    calls have positional schemas; keyword calls still bind by name."""
    assert [arg.name for arg in op.default._schema.arguments if arg.kwarg_only] == []
