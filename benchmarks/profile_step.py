"""Where the host time of one decode step goes: cProfile of warm steps of ``bench_model``'s model.

    PYTHONPATH=. python benchmarks/profile_step.py --device cuda --mode piecewise --layers 16

Builds the same random-weight Llama-3.2-1B-shaped model and DECODE batch as
``benchmarks/bench_model.py``, warms the mode up (compile, capture), then profiles ``--steps``
steps (host plan included, one device sync per step) and prints the functions with the largest
own (``tottime``) and cumulative time. Host time only: on a GPU the kernels run asynchronously.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from compile.graphs import device as dev
from bench_model import build, decode_batch, make_forward
from bench_overhead import stub_kernels


def time_components(step, steps: int) -> str:
    """Run ``steps`` steps with wall-clock timers around the host layers of a step.

    Rows nest: the provider calls (``providers.Route``) run inside ``backend.forward``; the step
    total is the median over steps, the rows are means per step.
    """
    import statistics
    import time
    from compile.backend.attention_backend import XPUAttentionBackend
    from compile.graphs.graph_wrapper import GraphWrapper
    from xpu_ops.providers import Route

    totals: dict[str, list] = {}

    def timed(owner, name, label):
        original = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                entry = totals.setdefault(label, [0.0, 0])
                entry[0] += time.perf_counter() - t0
                entry[1] += 1
        setattr(owner, name, wrapper)
        return original

    saved = [(XPUAttentionBackend, "init_forward_metadata",
              timed(XPUAttentionBackend, "init_forward_metadata", "init_forward_metadata")),
             (GraphWrapper, "__call__", timed(GraphWrapper, "__call__", "piece (replay)")),
             (XPUAttentionBackend, "forward",
              timed(XPUAttentionBackend, "forward", "backend.forward (split op body)")),
             (Route, "__call__", timed(Route, "__call__", "provider (kernel launch)"))]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    for owner, name, original in saved:
        setattr(owner, name, original)
    lines = [f"step {statistics.median(times) * 1e6:.0f} us median (host + final sync)",
             "| component | calls/step | us/call | us/step |", "|---|---:|---:|---:|"]
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
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--mode", default="piecewise")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--kernels", choices=("real", "stub"), default="real",
                    help="stub: no-op attention and KV-store kernels (bench_overhead."
                         "stub_kernels), so the attention rows are host time only")
    ap.add_argument("--timers", action="store_true",
                    help="instead of cProfile: wall-clock us per call of the piece runners, the "
                         "split op's backend.forward, init_forward_metadata and the provider "
                         "calls (no profiler overhead)")
    args = ap.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    if args.kernels == "stub":
        stub_kernels()
    model = build(args)
    ids, fb = decode_batch(model, args.batch, args.context)
    forward = make_forward(model, args.mode)

    def step():
        fb.attn_backend.init_forward_metadata(fb)
        forward(ids, fb.positions, fb)
        dev.synchronize(fb.device)

    with torch.inference_mode():
        for _ in range(5):
            step()
        if args.timers:
            print(time_components(step, args.steps))
            return
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        prof.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
        print(f"### {args.mode}, b={args.batch}, {args.steps} steps, sorted by {key}")
        print(buf.getvalue())


if __name__ == "__main__":
    main()
