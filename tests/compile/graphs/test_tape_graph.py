"""``TapeGraph`` (``emulate="tape"``) replays what a device graph holds, not the Python.

Each case changes something the capture froze (an attribute rebound to a new tensor, a host
int read from a tensor, a provider's launch) and checks that a tape replay gives the stale
result a device graph gives, where the rerun emulation (``EmulatedGraph``) follows the Python
to the eager result. ``test_tape_graph_triton.py`` covers the kernel ops (a recorded Triton
launch, a reference op rerun).
"""

from __future__ import annotations

import pytest
import torch

from compile.graphs.forward_context import BatchDescriptor, GraphMode, set_forward_context
from compile.graphs.graph_wrapper import GraphWrapper
from compile.graphs.tape_graph import TapeGraph

DESC = BatchDescriptor(GraphMode.PIECEWISE, None, 4)


def calls(step, emulate: str, args, before_replay) -> list:
    """Warm-up, capture, then ``before_replay()`` and a replay of ``step`` through a
    ``GraphWrapper``; the three results (copies)."""
    wrapper = GraphWrapper(step, GraphMode.PIECEWISE, torch.device("cpu"), emulate=emulate)
    outs = []
    with set_forward_context({}, None, 4, DESC):
        for i in range(3):
            if i == 2:
                before_replay()
            outs.append(wrapper(*args).clone())
    assert (wrapper.captures, wrapper.replays) == (1, 1)
    return outs


class Rebinding:
    """A backend that rebinds its buffer between steps (``self.scale = new tensor``): a device
    graph keeps reading the tensor it captured."""

    def __init__(self):
        self.scale = torch.full((4,), 2.0)

    def __call__(self, x):
        return x * self.scale

    def next_step(self):
        self.scale = torch.full((4,), 3.0)


@pytest.mark.parametrize("emulate", ["tape", "rerun"])
def test_rebound_attribute_is_stale_in_a_tape_replay(emulate):
    step, x = Rebinding(), torch.rand(4) + 0.5
    outs = calls(step, emulate, (x,), step.next_step)
    eager = x * step.scale
    if emulate == "tape":  # the graph multiplies by the captured tensor, 2
        torch.testing.assert_close(outs[2], 2.0 * x)
        assert not torch.allclose(outs[2], eager)
    else:  # the rerun follows the Python: the bug stays hidden
        torch.testing.assert_close(outs[2], eager)


@pytest.mark.parametrize("emulate", ["tape", "rerun"])
def test_host_int_read_at_capture_is_frozen(emulate):
    lengths, x = torch.tensor([2]), torch.rand(8) + 0.5

    def step(x):  # a host decision: how many rows the step sums
        return x[:int(lengths.max())].sum().reshape(1)

    outs = calls(step, emulate, (x,), lambda: lengths.fill_(6))
    if emulate == "tape":
        torch.testing.assert_close(outs[2], x[:2].sum().reshape(1))
    else:
        torch.testing.assert_close(outs[2], x[:6].sum().reshape(1))


def test_replay_reads_inputs_in_place_and_writes_the_captured_output():
    x, w = torch.rand(3, 4), torch.rand(4, 2)
    graph = TapeGraph(lambda a: torch.relu(a @ w) + 1, (x,))
    out = graph.outputs
    x.copy_(torch.rand(3, 4) - 0.5)
    graph.replay()
    assert graph.outputs is out
    want = torch.relu(x.double() @ w.double()) + 1
    torch.testing.assert_close(out.double(), want)


def test_a_view_op_that_copied_is_rerun():
    x, w = torch.rand(2, 3, 4), torch.rand(6, 2)
    with torch.inference_mode():  # reshape reaches the tape whole (no autograd decomposition)
        graph = TapeGraph(lambda a: a.transpose(0, 1).reshape(3, 8)[:, :6] @ w, (x,))  # copies
    assert any(e.func is torch.ops.aten.reshape.default for e in graph.tape)
    x.copy_(torch.rand(2, 3, 4))
    graph.replay()
    want = x.double().transpose(0, 1).reshape(3, 8)[:, :6] @ w.double()
    torch.testing.assert_close(graph.outputs.double(), want)


def test_data_dependent_shape_raises_at_replay():
    x = torch.tensor([0.0, 1.0, 0.0, 2.0])
    graph = TapeGraph(lambda a: a.nonzero(), (x,))
    x.fill_(1.0)
    with pytest.raises(RuntimeError, match="shape depends on data"):
        graph.replay()


def test_unknown_emulation_is_refused():
    with pytest.raises(ValueError, match="emulate must be a bool or one of"):
        GraphWrapper(lambda x: x, GraphMode.PIECEWISE, torch.device("cpu"), emulate="replay")
