"""Host time per decode step of the Llama-3.2-1B-shaped model in ``compiled`` mode (Inductor, no
device graphs) and eager: the figure behind the target "compiled mode host time per 16-layer
decode step <= 3 ms".

Method: the step is ``bench_model.paged_step`` (the host plan, ``init_forward_metadata``, then
``forward``), as the engine runs it, timed by ``bench_model.step_times``. Each step starts with
the device idle (synchronised); its host time is the wall time until the step returns
(``time.perf_counter``): launches are asynchronous, so that is the host's work as long as
nothing inside the step waits for the device. That is checked, not assumed: one step runs
under ``torch.cuda.set_sync_debug_mode("warn")``, which warns at every synchronising call,
and the warnings are counted (``syncs``; None off CUDA). Beside it: the launching thread's
CPU time over the same interval (``time.thread_time``: excludes time the thread was
descheduled) and the step time until the device finishes. Medians over ``steps`` steps after
``warmup`` (the first compiles), best of ``rounds`` rounds (the host's speed drifts within a
run).

    python benchmarks/compiled_step_host.py --device cuda                  # 16 layers, b=1
    python benchmarks/compiled_step_host.py --device cpu --layers 2 --hidden 128 --context 32
"""

from __future__ import annotations

import argparse
import warnings
from typing import Callable, Optional

import torch

from compile.graphs import device as dev
from bench_model import build, decode_batch, make_forward, paged_step, step_times

TARGET_MS = 3.0  # compiled mode host time per 16-layer decode step


def time_step(step: Callable[[], object], device: torch.device, warmup: int,
              steps: int) -> dict:
    """Median milliseconds of ``step``: ``host`` (until it returns), ``cpu`` (the thread's
    CPU time over the same interval) and ``step`` (until the device finishes)."""
    return {k: v * 1e3 for k, v in step_times(step, device, warmup, steps).items()}


def count_syncs(step: Callable[[], object], device: torch.device) -> Optional[int]:
    """Synchronising calls in one ``step`` (``torch.cuda.set_sync_debug_mode``); None off
    CUDA, where there is no such check."""
    if device.type != "cuda":
        return None
    dev.synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    dev.synchronize(device)
    return sum("synchroniz" in str(w.message).lower() for w in seen)


def step_host_rows(layers: int = 16, hidden: int = 0, batch: int = 1, context: int = 1024,
                   modes=("compiled", "eager"), warmup: int = 5, steps: int = 30,
                   rounds: int = 2, device: str = "cuda", dtype=torch.bfloat16,
                   on_row: Callable[[list], object] = lambda rows: None) -> list[dict]:
    """One row per mode: ``{"mode", "layers", "batch", "context", "host", "cpu", "step" (ms),
    "syncs"}``; ``on_row(rows)`` after each (a run cut short keeps what it measured)."""
    model = build(argparse.Namespace(layers=layers, hidden=hidden, dtype=dtype, device=device))
    ids, fb = decode_batch(model, batch, context)
    rows = []
    with torch.inference_mode():
        for mode in modes:
            torch._dynamo.reset()
            step = paged_step(make_forward(model, mode), ids, fb)
            best = min((time_step(step, fb.device, warmup, steps) for _ in range(rounds)),
                       key=lambda r: r["host"])
            rows.append(dict(mode=mode, layers=layers, batch=batch, context=context, **best,
                             syncs=count_syncs(step, fb.device)))
            print(f"    {mode} step: {rows[-1]}", flush=True)
            on_row(rows)
    torch._dynamo.reset()
    return rows


def step_host_table(rows: list[dict]) -> str:
    """Markdown: a row per mode, the target judged on the ``compiled`` row."""
    if not rows:
        return ""
    r0 = rows[0]
    lines = [f"Decode step host time, Llama-3.2-1B shape, {r0['layers']} layers, b={r0['batch']}, "
             f"context {r0['context']} (median ms per step; host: wall time until the step "
             "returns, the device idle at its start; thread CPU: the launching thread's CPU "
             "time over that interval; syncs: synchronising calls in one step, from "
             "torch.cuda.set_sync_debug_mode, so 0 means the host time holds no device wait):",
             "", "| mode | host ms | thread CPU ms | step ms (device done) | syncs | target |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        target = (f"<= {TARGET_MS:g} ms: {'yes' if r['host'] <= TARGET_MS else 'no'}"
                  if r["mode"] == "compiled" and r["layers"] == 16 else "-")
        syncs = "-" if r["syncs"] is None else str(r["syncs"])
        lines.append(f"| {r['mode']} | {r['host']:.2f} | {r['cpu']:.2f} | {r['step']:.2f} | "
                     f"{syncs} | {target} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=0, help="shrink the model (CPU runs)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--modes", nargs="+", default=["compiled", "eager"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    rows = step_host_rows(args.layers, args.hidden, args.batch, args.context, args.modes,
                          args.warmup, args.steps, device=args.device,
                          dtype=getattr(torch, args.dtype))
    print(step_host_table(rows))


if __name__ == "__main__":
    main()
