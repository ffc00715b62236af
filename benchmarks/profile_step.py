"""Where the host time of one step goes: cProfile of warm steps of ``bench_model``'s model.

    PYTHONPATH=. python benchmarks/profile_step.py --device cuda --mode piecewise --layers 16
    PYTHONPATH=. python benchmarks/profile_step.py --device cuda --mode graphs --step extend --tokens 64

Builds the same random-weight Llama-3.2-1B-shaped model and DECODE batch (or ``--step`` EXTEND /
MIXED batch of ``--tokens`` new tokens, ``bench_model.step_batch``) as
``benchmarks/bench_model.py``, warms the mode up (compile, capture), then profiles ``--steps``
steps (host plan included, as ``bench_model.paged_step`` runs it; one device sync per step) and
prints the functions with the largest own (``tottime``) and cumulative time. Host time only: on
a GPU the kernels run asynchronously, so a blocking call (a device-to-host read) shows as the
own time of the call that waits.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from compile.graphs import device as dev
from bench_model import build, decode_batch, make_forward, paged_step, step_batch
from bench_overhead import stub_kernels


def time_components(step, forward, steps: int) -> str:
    """Run ``steps`` steps with CPU-time timers around the host layers of a step.

    Times are the thread's CPU time (``time.thread_time``), so other processes on a shared
    machine do not count; on a GPU, launches are asynchronous and the host's CPU time is its
    wall time unless it blocks. Rows nest: the provider calls (``providers.Route``) run inside
    ``backend.forward``, which runs inside the split op's submodule; "Dynamo entry" is a
    ``PiecewiseModel``'s compiled call less the split graph it runs (guard evaluation and the
    graph's arguments). The step total is the median over steps, the rows are means per step.
    """
    import statistics
    import time
    from compile.backend.attention_backend import XPUAttentionBackend
    from compile.graphs import PiecewiseModel
    from compile.graphs.graph_wrapper import GraphWrapper
    from xpu_ops.providers import Route

    clock = time.thread_time
    totals: dict[str, list] = {}

    def timed(fn, label):
        def wrapper(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                entry = totals.setdefault(label, [0.0, 0])
                entry[0] += clock() - t0
                entry[1] += 1
        return wrapper

    patches = [(XPUAttentionBackend, "init_forward_metadata", "init_forward_metadata"),
               (GraphWrapper, "__call__", "piece (replay)"),
               (XPUAttentionBackend, "forward", "backend.forward"),
               (Route, "__call__", "provider (kernel launch)")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, label in patches:
        setattr(owner, name, timed(getattr(owner, name), label))
    pw = forward if isinstance(forward, PiecewiseModel) else getattr(forward, "forward", None)
    if isinstance(pw, PiecewiseModel):  # its compiled call and the split graphs inside
        pw.__dict__["compiled"] = timed(pw.__dict__["compiled"], "compiled call")
        for gm in pw.backend.split_gms:
            gm.forward = timed(gm.forward, "split graph")
            for name, value in list(gm.__dict__.items()):  # the attention submodules
                if name.startswith("submod_") and not isinstance(value, GraphWrapper):
                    gm.__dict__[name] = timed(value, "split op (attention submodule)")
    times, walls = [], []
    for _ in range(steps):
        t0, w0 = clock(), time.perf_counter()
        step()
        times.append(clock() - t0)
        walls.append(time.perf_counter() - w0)
    for owner, name, original in saved:
        setattr(owner, name, original)
    lines = [f"step {statistics.median(times) * 1e6:.0f} us thread CPU time, "
             f"{statistics.median(walls) * 1e6:.0f} us wall (medians; the device sync included)",
             "| component | calls/step | us/call | us/step |", "|---|---:|---:|---:|"]
    if "compiled call" in totals and "split graph" in totals:
        entry = totals["compiled call"][0] - totals["split graph"][0]
        totals["Dynamo entry (guards, arguments)"] = [entry, totals["compiled call"][1]]
    for label, (seconds, calls) in totals.items():
        lines.append(f"| {label} | {calls / steps:.0f} | {seconds / calls * 1e6:.1f} | "
                     f"{seconds / steps * 1e6:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    """Parse ``argv``, warm up, profile, print."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=str(dev.as_device()))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1, help="requests of a decode step")
    ap.add_argument("--step", choices=("decode", "extend", "mixed"), default="decode")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens of an extend/mixed step")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--mode", default="piecewise")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--kernels", choices=("real", "stub"), default="real",
                    help="stub: no-op attention and KV-store kernels (bench_overhead."
                         "stub_kernels), so the attention rows are host time only")
    ap.add_argument("--timers", action="store_true",
                    help="instead of cProfile: CPU-time us per call of the Dynamo entry, the "
                         "piece runners, the split op's backend.forward, init_forward_metadata "
                         "and the provider calls (no profiler overhead)")
    args = ap.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    if args.kernels == "stub":
        stub_kernels()
    model = build(args)
    ids, fb = (decode_batch(model, args.batch, args.context) if args.step == "decode"
               else step_batch(model, args.step, args.tokens, args.context))
    forward = make_forward(model, args.mode)
    run = paged_step(forward, ids, fb)

    def step():
        run()
        dev.synchronize(fb.device)

    with torch.inference_mode():
        for _ in range(5):
            step()
        if args.timers:
            print(time_components(step, forward, args.steps))
            return
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        prof.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
        what = f"b={args.batch}" if args.step == "decode" else f"{args.step} T={args.tokens}"
        print(f"### {args.mode}, {what}, {args.steps} steps, sorted by {key}")
        print(buf.getvalue())


if __name__ == "__main__":
    main()
