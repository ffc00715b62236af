"""The one place that knows device differences: availability, graph class and context, pool handle,
sync.

Everything else in ``compile/`` asks this module instead of touching ``torch.cuda`` or
``torch.xpu`` directly, so the graph runners read the same on every device:

| device | graph class | graph context | pool handle |
|---|---|---|---|
| ``cuda`` | ``torch.cuda.CUDAGraph`` | ``torch.cuda.graph`` | ``torch.cuda.graph_pool_handle`` |
| ``xpu`` | ``torch.xpu.XPUGraph`` (when this torch has it) | ``torch.xpu.graph`` | ``torch.xpu.graph_pool_handle`` |
| ``cpu`` | none: graph runners run the same code without capture | | |

No Intel GPU was available to this project: the ``xpu`` column is chosen by attribute lookup
(``torch.xpu.XPUGraph`` appeared in recent torch releases) and is untested on hardware.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def as_device(device: torch.device | str | None = None) -> torch.device:
    """``device`` as a ``torch.device`` (None: the current accelerator, else the CPU)."""
    if device is None:
        if torch.accelerator.is_available():
            return torch.device(torch.accelerator.current_accelerator().type)
        return torch.device("cpu")
    return torch.device(device)


def _module(device: torch.device | str) -> Optional[Any]:
    """``torch.cuda`` / ``torch.xpu`` for an accelerator device, None for the CPU."""
    kind = torch.device(device).type
    if kind in ("cuda", "xpu"):
        return getattr(torch, kind)
    return None


def is_available(device: torch.device | str) -> bool:
    """True when this torch build can run on ``device``'s type (the CPU always)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return True
    mod = _module(device)
    return mod is not None and mod.is_available()


def supports_graphs(device: torch.device | str) -> bool:
    """True when ``device`` can capture and replay device graphs with this torch build."""
    return is_available(device) and graph_class(device) is not None


def graph_class(device: torch.device | str) -> Optional[type]:
    """``torch.cuda.CUDAGraph`` or ``torch.xpu.XPUGraph``; None where the device has none."""
    mod = _module(device)
    if mod is None:
        return None
    return getattr(mod, "CUDAGraph" if torch.device(device).type == "cuda" else "XPUGraph",
                   None)


def new_graph(device: torch.device | str):
    """A new, empty device graph object.

    Raises:
        NotImplementedError: the device (or this torch build) has no graph API.
    """
    cls = graph_class(device)
    if cls is None:
        raise NotImplementedError(f"new_graph: device {torch.device(device)} has no graph API in "
                                  f"torch {torch.__version__}; expected cuda, or xpu with "
                                  "torch.xpu.XPUGraph. Run without capture on this device.")
    return cls()


def graph_pool_handle(device: torch.device | str):
    """A memory-pool handle shared by the graphs captured on ``device`` (None on the CPU)."""
    mod = _module(device)
    fn = getattr(mod, "graph_pool_handle", None) if mod is not None else None
    return fn() if fn is not None else None


def graph_capture(graph, device: torch.device | str, *, pool=None):
    """Context manager capturing the work launched inside it into ``graph``.

    Args:
        graph: from ``new_graph(device)``.
        pool: a ``graph_pool_handle`` so several graphs share one memory pool (or None).
    """
    mod = _module(device)
    ctx = getattr(mod, "graph", None) if mod is not None else None
    if ctx is None:
        raise NotImplementedError(f"graph_capture: device {torch.device(device)} has no graph "
                                  "context manager; expected torch.cuda.graph or torch.xpu.graph.")
    return ctx(graph, pool=pool)


def synchronize(device: torch.device | str) -> None:
    """Wait for all work queued on ``device`` (no-op on the CPU)."""
    mod = _module(device)
    if mod is not None and mod.is_available():
        mod.synchronize()


__all__ = ["as_device", "is_available", "supports_graphs", "graph_class", "new_graph",
           "graph_pool_handle", "graph_capture", "synchronize"]
