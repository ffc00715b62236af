"""Graphs wing: torch.compile integration. The split op and forward context that cut a model at
attention, the piecewise backend (Inductor per piece), full-step and piece capture, `compile_model`,
and `device.py`, the only module that knows device differences (CUDA, XPU, CPU emulation)."""
