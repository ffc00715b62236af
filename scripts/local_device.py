"""The local device in place of ``torch.xpu`` for sgl-kernel-xpu's tests (``plumb_xpu_tests.py``
rewrites ``torch.xpu.<name>`` to ``local_device.<name>`` and the ``"xpu"`` device to ``DEVICE``).

``DEVICE`` is ``"cuda"`` when CUDA is available, else ``"cpu"`` (the CPU runs the tests on the
reference provider). ``is_available()`` is True: the local device always exists. The functions
below (``torch.xpu``'s and ``torch.accelerator``'s names that sgl-kernel-xpu's tests call) map to
``torch.cuda`` on CUDA and to CPU equivalents otherwise; any other name is ``torch.cuda``'s on
CUDA, a no-op returning 0 on the CPU. ``get_device_properties()`` adds ``has_fp64 = True`` (an
XPU property the tests read; CUDA GPUs and CPUs have fp64).
"""

from __future__ import annotations

import time

import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def is_available() -> bool:
    return True


def synchronize(*args, **kwargs) -> None:
    if CUDA:
        torch.cuda.synchronize(*args, **kwargs)


def empty_cache() -> None:
    if CUDA:
        torch.cuda.empty_cache()


def get_device_name(*args) -> str:
    return torch.cuda.get_device_name(*args) if CUDA else "cpu"


def manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def device_count() -> int:
    return torch.cuda.device_count() if CUDA else 1


def current_accelerator() -> torch.device:
    return torch.device(DEVICE)


def set_device_index(index) -> None:
    if CUDA:
        torch.cuda.set_device(index)


class _Properties:
    def __init__(self, base):
        self._base = base
        self.has_fp64 = True

    def __getattr__(self, name):
        return getattr(self._base, name)


def get_device_properties(device=None) -> _Properties:
    if not CUDA:
        return _Properties(None)
    return _Properties(torch.cuda.get_device_properties(
        torch.cuda.current_device() if device is None else device))


class _CpuStream:
    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


def Stream(*args, **kwargs):  # noqa: N802 (torch.xpu.Stream's name)
    return torch.cuda.Stream(*args, **kwargs) if CUDA else _CpuStream()


def set_stream(stream) -> None:
    if CUDA:
        torch.cuda.set_stream(stream)


class _CpuEvent:
    """``torch.xpu.Event``'s timing on the CPU: ``record`` reads the clock, ``elapsed_time``
    returns milliseconds."""

    def __init__(self, enable_timing: bool = False, **kwargs):
        self.t = None

    def record(self, *args) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return (end.t - self.t) * 1000.0


Event = torch.cuda.Event if CUDA else _CpuEvent


def __getattr__(name: str):
    if CUDA:
        return getattr(torch.cuda, name)
    return lambda *args, **kwargs: 0
