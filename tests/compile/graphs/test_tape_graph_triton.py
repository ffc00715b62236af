"""``TapeGraph`` and the kernel ops of ``xpu_ops``: a ``triton`` provider's launch is recorded
and re-launched on the recorded memory at replay (its host logic frozen, no provider asked
again); a ``reference`` op is one entry rerun on the recorded arguments (it stands for a device
kernel that reads its inputs from memory). Both against a float64 oracle of ``merge_state_v2``
on inputs rewritten in place after the capture.

Triton's own library must be decorated for the interpreter (``tests/ops/triton_mode.py``):
where Triton was imported in compile mode first, the Triton case reruns this module in a fresh
process.
"""

from __future__ import annotations

import pytest
import torch

import xpu_ops
from compile.graphs.tape_graph import TapeGraph, TapeLaunch, TapeOp
from tests.ops import triton_mode
from tests.ops.triton_mode import interpret_while_module_runs  # noqa: F401 (autouse)

test_rerun_in_subprocess = triton_mode.rerun_in_subprocess(__file__)


def merge_oracle(v_a, s_a, v_b, s_b):
    """float64 ``merge_state_v2``: ``w = e^(s - max)``, ``v = (w_a v_a + w_b v_b) / (w_a + w_b)``."""
    s_a, s_b = s_a.double(), s_b.double()
    m = torch.maximum(s_a, s_b)
    w_a, w_b = torch.exp(s_a - m), torch.exp(s_b - m)
    v = (w_a[..., None] * v_a.double() + w_b[..., None] * v_b.double()) / (w_a + w_b)[..., None]
    return v, m + torch.log(w_a + w_b)


def merge_inputs(n=3, h=2, d=16):
    return (torch.randn(n, h, d), torch.randn(n, h), torch.randn(n, h, d), torch.randn(n, h))


@pytest.mark.skipif(not triton_mode.INTERPRETED, reason="Triton was imported in compile mode "
                    "before this module; its test_rerun_in_subprocess covers it")
def test_triton_launch_is_replayed_on_the_recorded_memory():
    inputs = merge_inputs()
    v_m, s_m = torch.full_like(inputs[0], float("nan")), torch.full_like(inputs[1], float("nan"))
    with triton_mode.running("triton"):
        graph = TapeGraph(lambda *a: xpu_ops.merge_state_v2(*a, v_m, s_m), inputs)
    kinds = [type(e) for e in graph.tape]
    assert kinds.count(TapeLaunch) == 1 and TapeOp not in kinds  # the kernel, not the op
    for t in inputs:  # new values at the same addresses
        t.copy_(torch.randn_like(t))
    v_m.fill_(float("nan")), s_m.fill_(float("nan"))
    graph.replay()  # no provider forced now: the recorded launch runs again
    v64, s64 = merge_oracle(*inputs)
    torch.testing.assert_close(v_m.double(), v64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_m.double(), s64, atol=1e-5, rtol=1e-5)


def test_reference_kernel_op_is_one_entry_rerun_on_the_recorded_arguments():
    inputs = merge_inputs()
    v_m, s_m = torch.empty_like(inputs[0]), torch.empty_like(inputs[1])
    with xpu_ops.use_provider("reference"):
        graph = TapeGraph(lambda *a: xpu_ops.merge_state_v2(*a, v_m, s_m), inputs)
    ops = [e.func for e in graph.tape]
    assert ops == [torch.ops.xpu_ops.merge_state_v2.default]
    for t in inputs:
        t.copy_(torch.randn_like(t))
    v_m.fill_(float("nan"))
    graph.replay()
    torch.testing.assert_close(v_m.double(), merge_oracle(*inputs)[0], atol=1e-5, rtol=1e-5)
