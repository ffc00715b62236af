"""Shared plumbing of the ``triton`` provider: availability, device facts, CPU interpreter launch.

Triton decides at ``@triton.jit`` decoration time whether a kernel is compiled or interpreted
(``TRITON_INTERPRET=1`` read from the environment when the decorator runs). Kernels here are
always decorated for compilation; a launch on CPU tensors instead runs an ``InterpretedFunction``
built from the same Python function, so tests can turn the interpreter on with the environment
variable at any time, whatever imported this package first: ``interpreting()`` reads it through
``provider_table.getenv`` (once; ``xpu_ops.refresh()`` reads it again and re-resolves the routes, so
the next op call on the CPU sees the change).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import types
from typing import Optional

import torch

from .. import provider_table

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401


# Kernel paths beside the portable kernel. Each kind of launch takes its ``DEFAULT_PATHS``;
# ``XPU_OPS_TRITON_PATHS`` (a comma list, "none" or "all"; read once at import) replaces them
# for every launch of the process, and benchmarks pass them per launch.
OPTIONAL_PATHS = {
    "page_tiles": "one page-table load per page of a key tile, int32 in-page offsets, unmasked "
                  "head-dim columns (page sizes that are powers of two)",
    "phases": "three-phase key loop: masked edge tiles around unmasked interior tiles",
    "tma": "tensor descriptors (TMA) for Q, O and interior K/V tiles (one box per page, up to "
           "two pages per tile); CUDA capability >= 9.0 (implies page_tiles and phases)",
    "tma_ws": "tma with the interior key loop warp-specialised (tl.range warp_specialize)",
    "mla_split": "absorbed MLA: two programs per row tile, each accumulating half of the latent "
                 "output columns (both compute the scores)",
    "fold_scale": "plain scores (no qv, no softcap) stay raw q.k and the softmax applies the "
                  "scale inside its exp2 argument: one FMA per score instead of a multiply "
                  "and a subtract",
}
# The paths of decode-like launches (at most 64 packed rows per request) and of the others
# (prefill, extend). On the H200 ``page_tiles`` was the fastest decode variant at every
# batch size and page size, by up to 1.4x at pages of 64 and 128. Prefill and extend take
# ``tma`` where tensor descriptors are supported (``_pick_config`` drops it elsewhere) and
# ``phases``, each faster than the one before it on the H200 prefill and extend rows
# (benchmarks/bench_attention.py --variant all).
DEFAULT_PATHS = {"decode": frozenset({"page_tiles"}), "prefill": frozenset({"tma", "phases"})}


def parse_paths(spec: str) -> frozenset[str]:
    """The optional kernel paths named by ``spec`` (comma-separated; "" or "none": none, "all":
    every one).

    Raises:
        ValueError: a name that is not in ``OPTIONAL_PATHS``.

    >>> sorted(parse_paths("page_tiles"))
    ['page_tiles']
    """
    names = {p.strip() for p in spec.split(",") if p.strip()}
    if names == {"all"}:
        return frozenset(OPTIONAL_PATHS)
    if names == {"none"}:
        return frozenset()
    unknown = sorted(names - set(OPTIONAL_PATHS))
    if unknown:
        raise ValueError(f"XPU_OPS_TRITON_PATHS: {', '.join(unknown)} is not an optional kernel path; expected "
                         f"a comma list of {sorted(OPTIONAL_PATHS)}, 'none' or 'all', got "
                         f"{spec!r}. Fix the spelling or leave it unset for the defaults.")
    return frozenset(names)


_SPEC = os.environ.get("XPU_OPS_TRITON_PATHS", "")
# None: every launch takes its kind's DEFAULT_PATHS.
ENABLED_PATHS: Optional[frozenset[str]] = parse_paths(_SPEC) if _SPEC.strip() else None


def launch_paths(decode: bool) -> frozenset[str]:
    """The kernel paths a launch takes unless told otherwise: ``XPU_OPS_TRITON_PATHS`` when
    set, else ``DEFAULT_PATHS`` of its kind (``decode``: at most 64 packed rows per request).

    >>> launch_paths(decode=True) <= frozenset(OPTIONAL_PATHS)
    True
    """
    if ENABLED_PATHS is not None:
        return ENABLED_PATHS
    return DEFAULT_PATHS["decode" if decode else "prefill"]


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1`` (as of the last ``xpu_ops.refresh()``): Triton kernels
    may run on CPU tensors (slowly)."""
    return provider_table.getenv("TRITON_INTERPRET") == "1"


def available(device_type: str) -> Optional[str]:
    """``None`` when the Triton kernels can run on ``device_type``, else the reason they cannot."""
    if not HAS_TRITON:
        return "the triton package does not import (pip install triton)"
    if device_type in ("cuda", "xpu"):
        return None
    if device_type == "cpu":
        if interpreting():
            return None
        return ("Triton compiles for GPUs only; on cpu it runs through its interpreter, which is "
                "enabled by TRITON_INTERPRET=1 (tests only: far too slow for real use)")
    return f"Triton has no backend for device type {device_type!r}"


@functools.lru_cache(maxsize=None)
def _interpreted(fn):
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction(_with_interpreted_callees(fn))


def _with_interpreted_callees(fn):
    """``fn`` rebound to globals in which the ``@triton.jit`` functions it names (helpers a
    kernel calls) are interpreted copies too: a compiled ``JITFunction`` called from an
    interpreted kernel raises "Cannot call @triton.jit'd outside of the scope of a kernel"."""
    from triton.runtime.jit import JITFunction
    callees = {name: value for name, value in fn.__globals__.items()
               if name in fn.__code__.co_names and isinstance(value, JITFunction)
               and value.fn is not fn}
    if not callees:
        return fn
    scope = dict(fn.__globals__)
    scope.update({name: _interpreted(value.fn) for name, value in callees.items()})
    clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__, clone.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    clone.__module__, clone.__doc__ = fn.__module__, fn.__doc__
    return clone


@functools.lru_cache(maxsize=None)
def descriptors_supported(device_type: str, index: Optional[int]) -> bool:
    """Whether kernels may build tensor descriptors on this device: Triton has
    ``tl.make_tensor_descriptor`` and the device is CUDA with capability >= 9.0 (TMA), or the
    CPU interpreter (tests). XPU is left out: not verified there."""
    if not HAS_TRITON or not hasattr(tl, "make_tensor_descriptor"):
        return False
    if device_type == "cuda":
        return torch.cuda.get_device_capability(index) >= (9, 0)
    return device_type == "cpu"


@functools.lru_cache(maxsize=None)
def warp_specialize_supported() -> bool:
    """Whether this Triton's ``tl.range`` takes ``warp_specialize``."""
    import inspect
    return HAS_TRITON and "warp_specialize" in inspect.signature(tl.range).parameters


@functools.lru_cache(maxsize=None)
def set_descriptor_allocator() -> None:
    """Give Triton the scratch allocator that kernels building tensor descriptors on the device
    need (``triton.set_allocator``; once per process, from the caching allocator, so a graph
    capture draws from the graph's pool). On the CPU interpreter nothing is needed."""
    def alloc(size: int, alignment: int, stream: Optional[int]):
        return torch.empty(size, dtype=torch.int8, device="cuda")
    triton.set_allocator(alloc)


# Launch observers: callables ``observer(kernel, grid, device, args, kwargs)`` returning a
# context manager that ``launch`` holds while the kernel runs (``contextlib.nullcontext()`` when
# it only watches). ``compile/graphs/tape_graph.py`` adds one while it records a capture (the
# graph emulation of the CPU); nothing in ``xpu_ops`` adds one. Empty, a launch pays one test.
LAUNCH_OBSERVERS: list = []


def launch(kernel, grid, device: torch.device, *args, **kwargs) -> None:
    """Launch ``kernel[grid](*args, **kwargs)``; on CPU through Triton's interpreter. Each of
    ``LAUNCH_OBSERVERS`` sees the launch first and holds its context around it."""
    if LAUNCH_OBSERVERS:
        with contextlib.ExitStack() as observed:
            for observer in tuple(LAUNCH_OBSERVERS):
                observed.enter_context(observer(kernel, grid, device, args, kwargs))
            _launch(kernel, grid, device, args, kwargs)
    else:
        _launch(kernel, grid, device, args, kwargs)


def _launch(kernel, grid, device: torch.device, args: tuple, kwargs: dict):
    """``kernel[grid](*args, **kwargs)``'s result: Triton's ``CompiledKernel`` on a GPU (its
    registers, spills and shared memory, read by benchmarks), None from the interpreter."""
    if device.type == "cpu" and not hasattr(kernel, "rewriter"):
        kernel = _interpreted(kernel.fn)
    return kernel[grid](*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _num_sms(device_type: str, index: Optional[int]) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index or 0).multi_processor_count
    if device_type == "xpu":
        props = torch.xpu.get_device_properties(index or 0)
        return int(getattr(props, "gpu_subslice_count", 0) or getattr(props, "max_compute_units", 64))
    return 4  # CPU interpreter: a small "machine" so that tiny test shapes exercise split-KV


@functools.lru_cache(maxsize=None)
def _smem_per_sm(device_type: str, index: Optional[int]) -> Optional[int]:
    if device_type != "cuda":
        return None
    try:
        props = torch.cuda.get_device_properties(index or 0)
    except Exception:  # no CUDA runtime here (offline compiles): unknown
        return None
    return getattr(props, "shared_memory_per_multiprocessor", None) or None


def smem_per_sm(device: torch.device) -> Optional[int]:
    """Shared memory bytes of one multiprocessor of a CUDA ``device`` (None: unknown, e.g. XPU
    or no CUDA runtime): a device fact, like ``num_sms``."""
    return _smem_per_sm(device.type, device.index)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (CUDA) / Xe cores (XPU) of ``device``: a shape-like fact."""
    return _num_sms(device.type, device.index)


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``max(n, 1)``."""
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division ``ceil(a / b)`` for ints (e.g. tiles or pages covering ``a`` tokens)."""
    return -(-a // b)
