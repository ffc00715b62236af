"""Host cost of one replayed whole-step DECODE graph: microseconds and dispatched aten ops.

A replayed decode step of ``GraphRunner`` (``--mode graphs``) does on the host what its graph
cannot: ``StepBuffers.load`` (the step's inputs copied into the fixed buffers, plus whatever
attention metadata is still built on the host) and the replay call. Rows per batch size:

    load             ``StepBuffers.load`` of the step (what the runner calls before a replay)
    runner step      ``GraphRunner.__call__`` of a replayed step; on the CPU the captured
                     emulated graph's replay is a no-op here (a device graph's replay is one
                     host call), so the row is the runner's own host work

each as microseconds (``--stat`` over ``--repeats`` of the mean of ``--iters`` calls, after a
warm-up) and as aten ops dispatched per call (``xpu_ops.testing.counted_ops``: every op on any
device, host tensors included). Model: ``bench_model``'s Llama shapes with ``--layers`` layers and
random weights; ``--page-size`` tokens per page; ``--pad`` padded requests in the bucket.

    PYTHONPATH=. python benchmarks/bench_step_host.py --device cpu --batches 1 8 32
    PYTHONPATH=. python benchmarks/bench_step_host.py --device cuda
"""

from __future__ import annotations

import argparse
import collections
import platform
import statistics
import time

import torch

from compile.graphs import GraphRunner
from compile.graphs import device as dev
from xpu_ops.testing import counted_ops
from bench_model import build, decode_batch  # benchmarks/ is on sys.path when run as a script


class _NoReplay:
    """Stands in for a captured CPU emulated graph: a replay that costs one call."""

    def replay(self) -> None:
        pass


def replayed_runner(model, ids, fb, device, pad: int = 0):
    """A ``GraphRunner`` over ``model`` with ``fb``'s bucket (``pad`` requests more than the
    batch) captured (warm-up, capture), its CPU replay a no-op (``_NoReplay``)."""
    emulate = device.type == "cpu"
    runner = GraphRunner(model, batch_sizes=(fb.batch_size + pad,), emulate_graphs=emulate)
    for _ in range(2):
        runner(ids, fb.positions, fb)
    if emulate:
        for entry in runner.graph.entries.values():
            entry.graph = _NoReplay()
    return runner


def time_us(fn, device, iters: int, repeats: int, stat) -> float:
    for _ in range(max(iters // 10, 5)):
        fn()
    means = []
    for _ in range(repeats):
        dev.synchronize(device)
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        dev.synchronize(device)
        means.append((time.perf_counter_ns() - t0) / iters / 1e3)
    return stat(means)


def count_ops(fn) -> collections.Counter:
    with counted_ops() as counts:
        fn()
    return counts


def rows(args):
    device = torch.device(args.device)
    model = build(args)
    stat = min if args.stat == "min" else statistics.median
    for b in args.batches:
        ids, fb = decode_batch(model, b, args.context, args.page_size)
        runner = replayed_runner(model, ids, fb, device, args.pad)
        desc = next(iter(runner.buffers.bound))
        calls = {
            "load": lambda: runner.buffers.load(desc, ids, fb.positions, fb, 1, 1),
            "runner step": lambda: runner(ids, fb.positions, fb),
        }
        for name, fn in calls.items():
            ops = count_ops(fn)
            yield (b, name, time_us(fn, device, args.iters, args.repeats, stat),
                   sum(ops.values()), ops)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256, help="hidden size (0: Llama-3.2-1B's)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pad", type=int, default=0, help="bucket = batch + pad (padded requests)")
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--stat", choices=("min", "median"), default="min")
    p.add_argument("--ops", action="store_true", help="print the ops of each row")
    args = p.parse_args()
    args.dtype = getattr(torch, args.dtype)
    name = (torch.cuda.get_device_name() if args.device.startswith("cuda")
            else platform.processor() or args.device)
    print(f"# bench_step_host: {name}, torch {torch.__version__}, page_size {args.page_size}, "
          f"context {args.context}, pad {args.pad}, {args.stat} of {args.repeats} x {args.iters}")
    print("| batch | call | host us/call | aten ops/call |\n|---:|---|---:|---:|")
    with torch.inference_mode():
        for b, call, us, n, ops in rows(args):
            print(f"| {b} | {call} | {us:.1f} | {n} |")
            if args.ops:
                print("  " + ", ".join(f"{k} x{v}" for k, v in sorted(ops.items())))


if __name__ == "__main__":
    main()
