"""Graphs wing: torch.compile integration. The split op and forward context that cut a model at
attention, the piecewise backend (Inductor per piece), full-step and piece capture, `compile_model`,
and `device.py`, the only module that knows device differences (CUDA, XPU, CPU emulation)."""

from compile.graphs.compiled_model import compile_model
from compile.graphs.forward_context import get_forward_context, set_forward_context
from compile.graphs.graph_runner import GraphRunner, full_and_piecewise
from compile.graphs.piecewise import PiecewiseModel, compile_piecewise

__all__ = ["compile_model", "compile_piecewise", "PiecewiseModel", "GraphRunner",
           "full_and_piecewise", "set_forward_context", "get_forward_context"]
