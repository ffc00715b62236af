"""Launch a compiled Triton kernel through torch's C++ launcher (Inductor's static launcher).

Triton's own launcher runs a few microseconds of Python per launch (scratch allocation checks,
argument annotation) before its C entry point. Inductor launches the kernels it generates
through ``torch._C._StaticCudaLauncher`` (``_StaticXpuLauncher`` on XPU) instead: the kernel
binary is loaded once and each launch is one C++ call with the non-constant arguments. This
module wraps that for an already compiled ``CompiledKernel`` of ours; it is used by
``launcher.BoundLaunch`` when torch provides it and the kernel qualifies (no global or profile
scratch, one CTA per program, no launch hooks), and never required: ``make_static_launch``
returns None whenever something is missing, and the caller keeps Triton's launcher.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Optional, Sequence

import torch


def _static_kernel_class():
    """``statically_launched_kernel_by_device`` of this torch, or None (torch < 2.8)."""
    try:  # torch >= 2.12: CUDA, ROCm and XPU
        from torch._inductor.runtime.static_triton_launcher import (
            statically_launched_kernel_by_device)
        return statically_launched_kernel_by_device
    except ImportError:
        pass
    try:  # torch 2.8 - 2.11: CUDA only
        from torch._inductor.runtime.static_cuda_launcher import StaticallyLaunchedCudaKernel
    except ImportError:
        return None

    def by_device(kernel, device_type: str):
        if device_type != "cuda":
            raise NotImplementedError(f"no static launcher for {device_type}")
        return StaticallyLaunchedCudaKernel(kernel)
    return by_device


def _kept_arguments(compiled, constants: Sequence[int]) -> list[int]:
    """Indices of the kernel parameters the compiled binary takes (not constexpr, not a value
    Triton specialised into a constant), in signature order."""
    names = compiled.src.fn.arg_names

    def index(key) -> int:
        if isinstance(key, str):
            return names.index(key)
        return key[0] if isinstance(key, tuple) else key

    signature = {index(key): ty for key, ty in compiled.src.signature.items()}
    constant = set(constants)
    return [i for i in sorted(signature) if signature[i] != "constexpr" and i not in constant]


class StaticLaunch:
    """``compiled`` launched by torch's C++ launcher with all but the slot arguments fixed.

    Args:
        kernel: torch's ``StaticallyLaunched*Kernel`` of ``compiled``, loaded on the device.
        full_args: every kernel parameter's value in signature order (constexprs included);
            the entries at ``slots`` are replaced per call.
        slots: parameter indices of the per-call tensors.
        kept: parameter indices the binary takes (see ``_kept_arguments``).
        grid: ``(x, y, z)`` program counts.
    """

    __slots__ = ("kernel", "args", "positions", "grid")

    def __init__(self, kernel, full_args: Sequence[Any], slots: Sequence[int],
                 kept: Sequence[int], grid: tuple[int, int, int]):
        self.kernel = kernel
        self.args = [full_args[i] for i in kept]
        self.positions = tuple(kept.index(i) for i in slots)
        self.grid = grid

    def __call__(self, stream: int, tensors: Sequence[torch.Tensor]) -> None:
        args = self.args
        for p, t in zip(self.positions, tensors):
            args[p] = t
        g = self.grid
        self.kernel.run(g[0], g[1], g[2], stream, *args)


def make_static_launch(compiled, device: torch.device, full_args: Sequence[Any],
                       slots: Sequence[int], grid: tuple[int, int, int]) -> Optional[StaticLaunch]:
    """A ``StaticLaunch`` of ``compiled`` on ``device``, or None when torch has no static
    launcher for it (old torch, unsupported device or kernel feature, a slot that the binary
    does not take)."""
    make = _static_kernel_class()
    if make is None:
        return None
    try:
        if not hasattr(compiled, "_cubin_path"):
            compiled._cubin_path = None  # the binary is written from compiled.asm below
        kernel = make(compiled, device.type)
        folder = os.path.join(tempfile.gettempdir(), f"xpu_ops_kernels_{os.getuid()}")
        kernel.reload_cubin_from_raw(os.path.join(folder, f"{compiled.hash}.bin"))
        kernel.load_kernel(device.index if device.index is not None else
                           torch.cuda.current_device() if device.type == "cuda" else 0)
        kept = _kept_arguments(compiled, getattr(kernel, "full_constexprs", ()))
        if len(kept) != len(kernel.arg_tys) or any(i not in kept for i in slots):
            return None
        return StaticLaunch(kernel, full_args, slots, kept, grid)
    except Exception:  # any unsupported feature or torch/Triton version difference
        return None


__all__ = ["StaticLaunch", "make_static_launch"]
