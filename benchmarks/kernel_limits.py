"""What limits the kernels' table rows that miss their targets (``bench_attention.py
--kernels-table``): where an eager call's host time goes, and what bounds each compiled kernel.

Host time of one eager call (``host_breakdown``): every Triton launch the call makes is timed
(``xpu_ops.triton._common._launch`` wrapped: ``time.perf_counter_ns`` at its entry and exit), so
the call's host time (until it returns; the device idle at its start) splits into

- (a) ``python``: before the first launch (the op's checks, the dispatcher, the provider's entry,
  the launch's arguments and allocations);
- (b) ``triton``: inside ``kernel[grid](...)``, itself split into ``driver`` (the compiled
  kernel's launcher: the C conversion of every argument and ``cuLaunchKernel``; timed by
  wrapping the launcher the ``CompiledKernel`` holds as its ``_run`` (Triton 3.4 and later) or
  ``run`` (3.3), None where neither is found) and ``binder`` (the rest: Triton's binder, i.e.
  specialisation of every argument, the kernel-cache lookup, the grid);
- (c) ``other``: the rest (between launches, and after the last one until the call returns).

Medians over ``iters`` calls after ``warmup`` (so the three need not add up to the host median).
The same call with the launch replaced by a no-op (``launch=NO_LAUNCH``) is the host time of the
call without Triton, a cross-check of (a) + (c). ``profile_top`` ranks the functions of ``calls``
calls under ``cProfile`` by own time, and sums own time per area (``xpu_ops``, Triton, torch,
C builtins): cProfile adds its overhead to every Python call, so its microseconds rank
contributors rather than measure them. ``launch_signature`` counts the launched kernel's runtime
parameters and constexprs.

What bounds a compiled kernel (``launch_limits``): the ``CompiledKernel`` each launch of a call
returns carries its registers per thread, spills (``n_regs``, ``n_spills``), shared memory per
block (``metadata.shared``), warps and stages (read with ``getattr``: Triton 3.3 to 3.6 name them
alike; a missing one is None). ``occupancy`` turns them into resident blocks per multiprocessor
under the device's limits (registers allocated per warp in units of 256, shared memory plus the
1 KiB the driver reserves per block on sm_80 and later, threads, blocks per SM) and names the
limit; the grid's blocks over (blocks per SM x SMs) are its waves. On the CPU (Triton's
interpreter) a launch returns no compiled kernel and ``launch_limits`` returns no row.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import inspect
import math
import os
import pstats
import statistics
import time
from typing import Callable, Iterator, Optional

from xpu_ops.triton import _common


def NO_LAUNCH(kernel, grid, device, args, kwargs):  # noqa: N802 (a constant-like stand-in)
    """A launch that does nothing (the call's host time without Triton)."""
    return None


@dataclasses.dataclass
class Launch:
    start_ns: int
    end_ns: int
    kernel: object
    grid: object
    args: tuple
    kwargs: dict
    compiled: object  # Triton's CompiledKernel (None from the interpreter or NO_LAUNCH)


@contextlib.contextmanager
def timed_launches(launch: Optional[Callable] = None) -> Iterator[list[Launch]]:
    """Record every Triton launch made inside the block (``Launch``: entry and exit times, the
    kernel, its grid and arguments, the compiled kernel it returned); ``launch`` replaces the
    real one (``NO_LAUNCH``: none runs)."""
    real = _common._launch
    run = launch or real
    seen: list[Launch] = []

    def timed(kernel, grid, device, args, kwargs):
        t0 = time.perf_counter_ns()
        compiled = run(kernel, grid, device, args, kwargs)
        t1 = time.perf_counter_ns()
        seen.append(Launch(t0, t1, kernel, grid, args, kwargs, compiled))
        return compiled
    _common._launch = timed
    try:
        yield seen
    finally:
        _common._launch = real


def host_breakdown(fn: Callable[[], object], sync: Callable[[], object], warmup: int = 20,
                   iters: int = 200, launch: Optional[Callable] = None) -> dict:
    """Median microseconds per call of ``fn``: ``host`` (until it returns), ``python``,
    ``triton`` (``binder`` + ``driver``; those two None when the launcher could not be timed),
    ``other`` (the module docstring's (a), (b), (c)) and ``with_sync`` (until the device
    finishes), plus ``launches`` per call; ``launch`` as in ``timed_launches``."""
    parts: dict[str, list[float]] = {k: [] for k in ("host", "python", "triton", "other",
                                                      "with_sync", "binder", "driver")}
    counts, driver = [], []
    with timed_launches(launch) as seen:
        for _ in range(warmup):
            fn()
        with timed_drivers({id(r.compiled): r.compiled for r in seen}, driver):
            for _ in range(iters):
                sync()
                seen.clear()
                driver.clear()
                t0 = time.perf_counter_ns()
                fn()
                t1 = time.perf_counter_ns()
                sync()
                t2 = time.perf_counter_ns()
                inside = sum(r.end_ns - r.start_ns for r in seen)
                before = (seen[0].start_ns - t0) if seen else t1 - t0
                split = (("binder", inside - sum(driver)), ("driver", sum(driver))) \
                    if seen and len(driver) == len(seen) else ()
                for key, ns in (("host", t1 - t0), ("python", before), ("triton", inside),
                                ("other", t1 - t0 - before - inside), ("with_sync", t2 - t0),
                                *split):
                    parts[key].append(ns / 1e3)
                counts.append(len(seen))
    out = {k: statistics.median(v) if len(v) == iters else None for k, v in parts.items()}
    out["launches"] = statistics.median(counts)
    return out


@contextlib.contextmanager
def timed_drivers(compiled: dict, spent: list) -> Iterator[None]:
    """Inside the block, each call of the launcher of each ``CompiledKernel`` of ``compiled``
    (values) appends its nanoseconds to ``spent``: the launcher is the instance's ``_run``
    (Triton 3.4 and later, behind the ``run`` property) or ``run`` (3.3); one that holds
    neither is left alone."""
    undo = []
    for kernel in compiled.values():
        own = getattr(kernel, "__dict__", {})
        attr = next((a for a in ("_run", "run") if callable(own.get(a))), None)
        if attr is None:
            continue
        inner = own[attr]

        def timed(*args, _inner=inner, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent.append(time.perf_counter_ns() - t0)
        setattr(kernel, attr, timed)
        undo.append((kernel, attr, inner))
    try:
        yield
    finally:
        for kernel, attr, inner in undo:
            setattr(kernel, attr, inner)


def launch_signature(fn: Callable[[], object], launch: Optional[Callable] = None) -> list[dict]:
    """Per launch of one call of ``fn``: the kernel's name, its runtime and constexpr
    parameters, and the arguments passed positionally, by keyword and as launch options
    (keywords that are no parameter: ``num_warps``, ``num_stages``, ...)."""
    with timed_launches(launch) as seen:
        fn()
    rows = []
    for r in seen:
        params = kernel_params(r.kernel)
        rows.append(dict(kernel=kernel_name(r.kernel),
                         runtime=sum(not c for c in params.values()),
                         constexpr=sum(params.values()), positional=len(r.args),
                         keyword=sum(k in params for k in r.kwargs),
                         options=sorted(k for k in r.kwargs if k not in params)))
    return rows


def kernel_params(kernel) -> dict[str, bool]:
    """``{parameter name: is constexpr}`` of a ``@triton.jit`` kernel: its ``params`` (a
    ``JITFunction``), else its Python signature's ``tl.constexpr`` annotations (the
    interpreter's ``InterpretedFunction`` has no ``params``)."""
    params = getattr(kernel, "params", None)
    if params:
        return {p.name: bool(p.is_constexpr) for p in params}
    fn = getattr(kernel, "fn", kernel)
    return {name: "constexpr" in str(p.annotation)
            for name, p in inspect.signature(fn).parameters.items()}


def kernel_name(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", type(kernel).__name__)


def _area(filename: str) -> str:
    """The package a profiled function's file belongs to (``~``: a C builtin)."""
    path = filename.replace(os.sep, "/")
    if filename == "~":
        return "C builtins"
    for area in ("xpu_ops", "triton", "torch"):
        if f"/{area}/" in path:
            return area
    return "other"


def profile_top(fn: Callable[[], object], calls: int = 200, top: int = 12,
                launch: Optional[Callable] = None) -> dict:
    """``{"rows": [...], "areas": {...}}``: the ``top`` functions by own time over ``calls``
    calls of ``fn`` under cProfile (``function``, ``ncalls`` per call, own and cumulative
    microseconds per call) and the own microseconds per call of each area (``_area``);
    ``launch`` as in ``timed_launches``."""
    prof = cProfile.Profile()
    with timed_launches(launch):
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    rows, areas = [], {}
    for (filename, line, name), (_, nc, tt, ct, _) in stats.items():
        area = _area(filename)
        areas[area] = areas.get(area, 0.0) + tt / calls * 1e6
        short = "/".join(filename.replace(os.sep, "/").split("/")[-2:])
        rows.append(dict(function=f"{short}:{line}({name})" if filename != "~" else name,
                         area=area, ncalls=nc / calls, own_us=tt / calls * 1e6,
                         cum_us=ct / calls * 1e6))
    rows.sort(key=lambda r: -r["own_us"])
    return {"rows": rows[:top], "areas": dict(sorted(areas.items(), key=lambda kv: -kv[1]))}


# Resident blocks per multiprocessor by compute capability (CUDA programming guide, "Technical
# Specifications per Compute Capability"); an unknown capability sets no such limit.
MAX_BLOCKS_PER_SM = {(7, 0): 32, (7, 5): 16, (8, 0): 32, (8, 6): 16, (8, 7): 16, (8, 9): 24,
                     (9, 0): 32, (10, 0): 32}
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256


def device_limits(index: int = 0) -> dict:
    """The CUDA device's per-multiprocessor limits that bound resident blocks (None: unknown)."""
    import torch
    props = torch.cuda.get_device_properties(index)
    cc = (props.major, props.minor)
    return dict(name=props.name, sms=props.multi_processor_count,
                regs=getattr(props, "regs_per_multiprocessor", None),
                threads=getattr(props, "max_threads_per_multi_processor", None),
                smem=getattr(props, "shared_memory_per_multiprocessor", None),
                smem_block=getattr(props, "shared_memory_per_block_optin", None),
                warp=getattr(props, "warp_size", 32), blocks=MAX_BLOCKS_PER_SM.get(cc),
                reserved_smem=1024 if props.major >= 8 else 0)


def occupancy(n_regs: Optional[int], shared: Optional[int], warps: int,
              limits: dict) -> tuple[Optional[int], str]:
    """``(resident blocks per multiprocessor, what limits it)`` of a block of ``warps`` warps
    using ``n_regs`` registers per thread and ``shared`` bytes of shared memory, under
    ``limits`` (``device_limits``); ``(None, reason)`` when nothing is known."""
    warp = limits.get("warp") or 32
    bounds = {}
    if n_regs and limits.get("regs"):
        per_warp = math.ceil(n_regs * warp / REG_ALLOC_UNIT) * REG_ALLOC_UNIT
        bounds["registers"] = limits["regs"] // per_warp // warps
    if shared and limits.get("smem"):
        if limits.get("smem_block") and shared > limits["smem_block"]:
            return 0, "shared memory (over the per-block maximum)"
        bounds["shared memory"] = limits["smem"] // (shared + limits.get("reserved_smem", 0))
    if limits.get("threads"):
        bounds["threads"] = limits["threads"] // (warps * warp)
    if limits.get("blocks"):
        bounds["blocks per SM"] = limits["blocks"]
    if not bounds:
        return None, "unknown"
    least = min(bounds.values())
    return least, ", ".join(k for k, v in bounds.items() if v == least)


def _grid(grid, kwargs: dict) -> Optional[tuple]:
    """The launch's grid as a tuple of ints (a callable grid called with the keyword
    arguments, as Triton calls it with the bound ones; None when that fails)."""
    if callable(grid):
        try:
            grid = grid(kwargs)
        except Exception:
            return None
    return tuple(int(g) for g in grid)


def compiled_facts(compiled) -> Optional[dict]:
    """Registers, spills, shared bytes, warps and stages of a Triton ``CompiledKernel`` that a
    launch returned (it ran, so its binary is loaded and ``n_regs``/``n_spills`` are set; None
    when ``compiled`` is not one, e.g. the interpreter's result)."""
    meta = getattr(compiled, "metadata", None)
    if meta is None:
        return None
    return dict(regs=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None),
                shared=getattr(meta, "shared", None), warps=getattr(meta, "num_warps", None),
                stages=getattr(meta, "num_stages", None))


def launch_limits(label: str, fn: Callable[[], object], limits: dict) -> list[dict]:
    """One row per launch of one call of ``fn``: ``label``, the kernel, its grid's blocks, the
    compiled facts (``compiled_facts``), resident blocks per SM and their limit (``occupancy``)
    and the waves (blocks / (blocks per SM x SMs)). No row for a launch without a compiled
    kernel (the CPU)."""
    with timed_launches() as seen:
        fn()
    rows = []
    for r in seen:
        facts = compiled_facts(r.compiled)
        if facts is None:
            continue
        warps = facts["warps"] or r.kwargs.get("num_warps", 4)
        per_sm, limit = occupancy(facts["regs"], facts["shared"], warps, limits)
        grid = _grid(r.grid, r.kwargs)
        blocks = None if grid is None else math.prod(grid)
        waves = (blocks / (per_sm * limits["sms"]) if blocks and per_sm and limits.get("sms")
                 else None)
        rows.append(dict(label=label, kernel=kernel_name(r.kernel), grid=grid, blocks=blocks,
                         **facts,
                         blocks_per_sm=per_sm, limit=limit, waves=waves))
    return rows
