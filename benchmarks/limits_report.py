"""``limits.md``/``.json`` of ``bench_attention.py --kernels-table``: the measured limits of the
rows short of their targets, in the same process as the kernels' table.

- The eager b=1 decode call of the op-call rows (``attention_calls``): its host time split into
  our Python before the Triton launch, the launch, and the rest (``kernel_limits.host_breakdown``),
  with the launch replaced by a no-op beside it; the launched kernels' parameter counts; the top
  functions by own time under cProfile and the own time per area.
- The compiled kernels of the rows short of their targets (prefill, MLA decode and its tile
  configs): registers, spills, shared memory, warps, resident blocks per SM and what limits
  them, waves (``kernel_limits.launch_limits``).
- Compiled-mode host time per 16-layer decode step (``compiled_step_host``).

Every part is skipped with its reason where it cannot run (the compiled kernels need a GPU).
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Optional

import torch

import kernel_limits as kl


def _sync(device: torch.device) -> Callable[[], object]:
    from compile.graphs import device as dev
    return lambda: dev.synchronize(device)


def _launch_cell(c: dict) -> str:
    split = (f" ({c['binder']:.1f} + {c['driver']:.1f})"
             if c.get("driver") is not None and c.get("binder") is not None else "")
    return f"{c['triton']:.1f}{split}"


class LimitsReport:
    """The parts measured so far; ``write(out)`` renders them (after each part: a run cut short
    keeps what it measured)."""

    def __init__(self, device_line: str, limits: Optional[dict] = None, where: str = ""):
        """``limits``: ``kernel_limits.device_limits()`` (None: no compiled kernel rows);
        ``where``: said after the device (e.g. the process's other tables)."""
        self.device_line, self.limits, self.where = device_line, limits, where
        self.calls: list[dict] = []       # host breakdown per call form (and launch mocked)
        self.signature: list[dict] = []   # kernel parameter counts of the packed call
        self.profile: Optional[dict] = None
        self.kernels: list[dict] = []     # kernel_limits.launch_limits rows
        self.steps: list[dict] = []       # compiled_step_host rows
        self.skipped: list[str] = []

    def kernel_rows(self, label: str, fn: Callable[[], object]) -> None:
        """Add ``launch_limits`` rows of one call of ``fn`` (nothing without device limits)."""
        if self.limits is None:
            return
        try:
            self.kernels += kl.launch_limits(label, fn, self.limits)
        except Exception as e:
            self.skipped.append(f"compiled kernels of {label}: {type(e).__name__}: "
                                f"{str(e)[:200]}")

    def eager_call(self, context: int = 1024, page: int = 16, warmup: int = 20,
                   iters: int = 200, device: str = "cuda", profile_calls: int = 200,
                   launch: Optional[Callable] = None) -> None:
        """The host breakdown of the op-call rows' eager triton call, both forms, each also
        with the launch a no-op; the packed call's launch signature and cProfile top;
        ``launch`` replaces the real launch (tests: the interpreter's takes a second)."""
        from attention_calls import triton_calls
        from bench_op_call import decode_inputs
        import xpu_ops
        dev = torch.device(device)
        w = decode_inputs(1, context, page, torch.bfloat16, dev)
        forms = triton_calls(w)
        with xpu_ops.use_provider("triton"):
            for form, fn in forms.items():
                for mocked in (False, True):
                    got = kl.host_breakdown(fn, _sync(dev), warmup, iters,
                                            kl.NO_LAUNCH if mocked else launch)
                    self.calls.append(dict(form=form, launch="no-op" if mocked else "real",
                                           context=context, page=page, iters=iters, **got))
            self.signature = kl.launch_signature(forms["packed"], launch)
            self.profile = dict(calls=profile_calls,
                                **kl.profile_top(forms["packed"], profile_calls, launch=launch))

    def step_host(self, out: str, **kwargs) -> None:
        """``compiled_step_host.step_host_rows(**kwargs)`` (default: compiled and eager, 16
        layers, b=1, context 1024) into ``steps``, written to ``out`` after each mode."""
        from compiled_step_host import step_host_rows

        def keep(rows):
            self.steps = list(rows)
            self.write(out)
        step_host_rows(on_row=keep, **kwargs)

    def guarded(self, what: str, part: Callable[[], object], out: str) -> None:
        """Run ``part`` (a failure is noted in ``skipped``, not raised), then write to ``out``."""
        start = time.perf_counter()
        try:
            part()
        except Exception as e:
            print(f"    {what} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            self.skipped.append(f"{what}: {type(e).__name__}: {str(e)[:200]}")
        self.write(out)
        print(f"    {what}: {time.perf_counter() - start:.0f} s", flush=True)

    def markdown(self) -> str:
        out = [f"Measured limits, {self.device_line}{f' ({self.where})' if self.where else ''}."]
        if self.calls:
            out += ["", *self._calls_md()]
        if self.kernels:
            out += ["", *self._kernels_md()]
        if self.steps:
            from compiled_step_host import step_host_table
            out += ["", step_host_table(self.steps)]
        if self.skipped:
            out += ["", *(f"- skipped: {s}" for s in self.skipped)]
        return "\n".join(out)

    def _calls_md(self) -> list[str]:
        c0 = self.calls[0]
        lines = [f"Eager decode call b=1, ctx {c0['context']}, page {c0['page']} (D 64), host "
                 f"time per call: median us over {c0['iters']} calls, each started with the "
                 "device idle. (a) before the first Triton launch (our checks, dispatch, "
                 "provider entry, launch arguments, allocations); (b) inside kernel[grid](...): "
                 "binder (Triton's specialisation of each argument, cache lookup, grid) + "
                 "driver (the compiled kernel's launcher: argument conversion and "
                 "cuLaunchKernel), when the launcher could be timed; (c) the rest "
                 "(between launches and after the last until the call returns); `no-op` "
                 "launch: the same call with the launch replaced by a no-op.", "",
                 "| call | launch | host us | (a) Python before launch | (b) Triton launch "
                 "(binder + driver) | "
                 "(c) other | launches/call | host + device us |",
                 "|---|---|---:|---:|---:|---:|---:|---:|"]
        for c in self.calls:
            lines.append(f"| {c['form']} | {c['launch']} | {c['host']:.1f} | "
                         f"{c['python']:.1f} | {_launch_cell(c)} | {c['other']:.1f} | "
                         f"{c['launches']:g} | {c['with_sync']:.1f} |")
        for s in self.signature:
            lines.append(f"\nLaunched by the packed call: {s['kernel']}, {s['runtime']} runtime "
                         f"parameters and {s['constexpr']} constexprs ({s['positional']} passed "
                         f"positionally, {s['keyword']} by keyword, launch options "
                         f"{', '.join(s['options']) or 'none'}).")
        if self.profile:
            lines += self._profile_md()
        return lines

    def _profile_md(self) -> list[str]:
        p = self.profile
        areas = ", ".join(f"{k} {v:.1f}" for k, v in p["areas"].items())
        lines = ["", f"The packed call under cProfile, {p['calls']} calls: own time per area "
                 f"(us per call) {areas}. Top functions by own time (cProfile's overhead "
                 "inflates every Python call: these rank, the table above measures):", "",
                 "| function | area | calls per call | own us | cumulative us |",
                 "|---|---|---:|---:|---:|"]
        for r in p["rows"]:
            lines.append(f"| `{r['function']}` | {r['area']} | {r['ncalls']:g} | "
                         f"{r['own_us']:.2f} | {r['cum_us']:.2f} |")
        return lines

    def _kernels_md(self) -> list[str]:
        lim = self.limits or {}
        lines = [f"Compiled kernels of the rows short of their targets (Triton's metadata after "
                 f"a launch; resident blocks per SM under this device's limits: "
                 f"{lim.get('regs')} registers, {(lim.get('smem') or 0) // 1024} KiB shared "
                 f"memory, {lim.get('threads')} threads, {lim.get('blocks')} blocks per SM; "
                 f"waves = blocks / (blocks per SM x {lim.get('sms')} SMs)):", "",
                 "| row / launch | kernel | grid (blocks) | warps | stages | registers/thread "
                 "| spills | shared KiB | blocks/SM (limit) | waves |", "|---|---|---:|---:|---:|---:|---:"
                 "|---:|---|---:|"]
        for k in self.kernels:
            def show(x, fmt="{}"):
                return "-" if x is None else fmt.format(x)
            grid = "-" if k.get("grid") is None else "x".join(map(str, k["grid"]))
            lines.append(f"| {k['label']} | {k['kernel']} | {grid} ({show(k['blocks'])}) | "
                         f"{show(k['warps'])} | {show(k['stages'])} | {show(k['regs'])} | "
                         f"{show(k['spills'])} | "
                         f"{show(None if k['shared'] is None else k['shared'] / 1024, '{:.1f}')}"
                         f" | {show(k['blocks_per_sm'])} ({k['limit']}) | "
                         f"{show(k['waves'], '{:.2f}')} |")
        return lines

    def write(self, out: str) -> None:
        with open(os.path.join(out, "limits.md"), "w") as f:
            f.write(self.markdown() + "\n")
        with open(os.path.join(out, "limits.json"), "w") as f:
            json.dump({"device": self.device_line, "limits": self.limits, "calls": self.calls,
                       "signature": self.signature, "profile": self.profile,
                       "kernels": self.kernels, "steps": self.steps, "skipped": self.skipped},
                      f, indent=1)


def main(argv=None) -> None:
    """The parts that run without the kernels' table (its CPU check: ``gpu_session.sh`` part
    ``kernels`` under ``DRY_RUN=1``): the eager call's host breakdown and the decode step host
    time, into ``--out``/limits.md. On the CPU the launch runs through Triton's interpreter
    (``TRITON_INTERPRET=1``) and the compiled kernels are skipped."""
    import argparse
    import platform
    p = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=0, help="shrink the model (CPU runs)")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cuda = args.device.startswith("cuda")
    name = f"GPU {torch.cuda.get_device_name()}" if cuda else f"CPU ({platform.machine()})"
    report = LimitsReport(name, kl.device_limits() if cuda else None)
    report.eager_call(args.context, warmup=max(args.iters // 10, 1), iters=args.iters,
                      device=args.device, profile_calls=args.iters)
    report.write(args.out)
    report.step_host(args.out, layers=args.layers, hidden=args.hidden, context=args.context,
                     steps=args.steps, warmup=2, rounds=2 if cuda else 1, device=args.device,
                     dtype=torch.bfloat16 if cuda else torch.float32)
    print(report.markdown())


if __name__ == "__main__":
    main()
