"""Kernel by kernel: where the device time of one decode step goes, against the bytes moved.

    python benchmarks/profile_decode.py --device cuda --batches 1 64 --out benchmarks/results
    python benchmarks/profile_decode.py --device cuda --mode dense --batches 1 64 --out ...
    python benchmarks/profile_decode.py --device cpu --quick --out /tmp/profile   # CPU check

Builds ``bench_model``'s random-weight Llama-3.2-1B-shaped model and DECODE batch (context
``--context``), warms ``--mode`` up (compile, capture; ``dense``: the gpt-fast-style peer), then
runs ``torch.profiler`` over ``--steps`` steps (on a GPU, ``graphs`` and ``dense`` steps are
graph replays) and groups the device kernels by name: calls and microseconds per step, share of
the step's kernel time. On the CPU the "kernels" are the leaf operators (self time).

Bytes: one more step of the same compiled model, uncaptured and profiled with shapes, links each
kernel to the operator that launched it; the operator's tensors give the bytes (``op_bytes``):
exact for matrix products, the argument sizes otherwise (an upper bound for gathers; attention
counts its whole KV pool, which ``bench_model``'s batch sizes to the tokens read plus under one
page per request). Inductor's Triton kernels are launched under a record of their own name with
their buffers as arguments, each read or written once; those bytes count only where the
uncaptured step runs the same Inductor graphs (``SAME_INDUCTOR_GRAPHS``: piece graphs fuse and
name kernels differently). An operator that launches several kernels gives its bytes to the
longest of them (a split-K GEMM's main kernel, not its reduction). Kernels without bytes show
"-".
Writes ``profile_decode_b{b}.md`` and ``.json`` per batch under ``--out``; prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench_model import (MODES, PEERS, build, decode_batch, dense_step, make_forward,
                         paged_step, step_seconds)
from compile.engine.cli_args import positive_int
from compile.graphs import device as dev
from decode_roofline import copy_bandwidth
from dense_baseline import GQA_LAYOUTS

ELEMENT_BYTES = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8, "long int": 8,
                 "int": 4, "short": 2, "bool": 1, "unsigned char": 1, "signed char": 1,
                 "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}
PROFILER_DTYPES = {torch.bfloat16: "c10::BFloat16", torch.float16: "c10::Half",
                   torch.float32: "float"}
# mode -> the uncaptured mode whose profiled step gives the bytes: the same operators; for the
# modes in SAME_INDUCTOR_GRAPHS also the same Inductor graphs (piece graphs name their fused
# kernels differently from whole-model graphs, so the others take operator bytes only)
UNCAPTURED = {"eager": "eager", "compiled": "compiled", "graphs_compiled": "compiled",
              "piecewise": "compiled", "graphs": "compiled", "graphs_addmm": "compiled"}
SAME_INDUCTOR_GRAPHS = ("compiled", "graphs_compiled", "dense")
MATMULS = {"aten::mm": 0, "aten::bmm": 0, "aten::addmm": 1}  # op -> index of its first matrix
# CPU operators that allocate or make views: no data moved, not kernels
METADATA_OPS = {"aten::empty", "aten::empty_strided", "aten::view", "aten::_unsafe_view",
                "aten::_reshape_alias", "aten::as_strided", "aten::alias", "aten::real",
                "aten::resolve_conj", "aten::resize_", "aten::to", "aten::is_same_size",
                "aten::_local_scalar_dense", "aten::slice", "aten::select", "aten::unsqueeze",
                "aten::squeeze", "aten::expand", "aten::permute", "aten::transpose", "aten::t",
                "aten::detach", "aten::lift_fresh", "aten::split", "aten::chunk"}
QUICK = dict(layers=2, hidden=128, context=32, batches=[1, 4], steps=3)


def op_bytes(name: str, shapes: list, dtypes: list) -> int | None:
    """Bytes an operator reads and writes, from its profiled argument shapes and dtypes.

    Matrix products: ``A [.., M, K]``, ``B [.., K, N]`` read, ``C [.., M, N]`` written (and an
    ``addmm`` bias read). Other operators: the sum of their tensor arguments. None when no
    argument is a tensor of a known dtype.
    """
    tensors = [(s, ELEMENT_BYTES[d]) for s, d in zip(shapes, dtypes)
               if d in ELEMENT_BYTES and s and all(isinstance(x, int) for x in s)]
    if not tensors:
        return None
    if name in MATMULS and len(shapes) >= MATMULS[name] + 2:
        i = MATMULS[name]
        a, b = shapes[i], shapes[i + 1]
        numel = math.prod(a) + math.prod(b) + math.prod(a[:-1]) * b[-1]
        numel += math.prod(shapes[0]) if i else 0  # addmm's bias
        return numel * ELEMENT_BYTES.get(dtypes[i], 2)
    return sum(math.prod(s) * e for s, e in tensors)


def is_device(event) -> bool:
    return event.device_type in (DeviceType.CUDA, DeviceType.XPU, DeviceType.PrivateUse1)


def activities(device: str) -> list:
    extra = {"cuda": ProfilerActivity.CUDA, "xpu": getattr(ProfilerActivity, "XPU", None)}
    return [ProfilerActivity.CPU] + ([extra[device]] if extra.get(device) else [])


def cpu_leaves(events) -> list:
    """Operators (``ns::name``) that call no other operator and touch data: the CPU's kernels
    (Inductor's C++ kernels are not operators and do not appear)."""
    def is_op(e) -> bool:
        return not is_device(e) and "::" in e.name and e.name not in METADATA_OPS
    return [e for e in events if is_op(e) and not any(is_op(c) for c in e.cpu_children)]


def kernel_times(step, device: str, steps: int) -> dict[str, list]:
    """``{kernel name: [calls, microseconds]}`` summed over ``steps`` profiled steps."""
    with torch.inference_mode(), profile(activities=activities(device)) as prof:
        for _ in range(steps):
            step()
            dev.synchronize(device)
    events = prof.events()
    kernels = [e for e in events if is_device(e)] if device != "cpu" else cpu_leaves(events)
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        out[e.name][0] += 1
        out[e.name][1] += e.time_range.elapsed_us() if device != "cpu" else e.self_cpu_time_total
    return out


def launching_op(event, kernel: str | None):
    """The nearest enclosing event with profiled shapes that launched ``kernel``: an operator
    (``ns::name``) or Inductor's launch record of a Triton kernel (named like the kernel, its
    buffers as arguments; None: operators only)."""
    while event is not None and not (event.input_shapes and ("::" in event.name
                                                             or event.name == kernel)):
        event = event.cpu_parent
    return event


def kernel_bytes(step, device: str, assumed_dtype: str = "c10::BFloat16", *,
                 inductor_records: bool = True) -> dict[str, int]:
    """``{kernel name: bytes in one step}`` for the kernels whose launching operator's bytes
    are known (``op_bytes``; an operator that launches several kernels gives them to the
    longest); one profiled step with shapes. ``assumed_dtype`` (a profiler dtype name) stands
    for every tensor where the profiler records no dtypes; ``inductor_records=False`` ignores
    Inductor's launch records (their kernels get no bytes)."""
    with torch.inference_mode(), profile(activities=activities(device), record_shapes=True) as p:
        step()
    if device == "cpu":
        launches = [(e, e.name, e.self_cpu_time_total) for e in cpu_leaves(p.events())]
    else:
        launches = [(e, k.name, k.duration) for e in p.events()
                    if not is_device(e) for k in e.kernels]
    by_op: dict[tuple, tuple[object, list]] = {}  # (thread, start, name) names an event
    unknown = set()
    for event, name, us in launches:
        op = launching_op(event, name if inductor_records else None)
        if op is None:
            unknown.add(name)
        else:
            key = (op.thread, op.time_range.start, op.name)
            by_op.setdefault(key, (op, []))[1].append((us, name))
    out: dict[str, int] = defaultdict(int)
    for op, launched in by_op.values():
        # torch versions whose profiler records no dtypes: every tensor as the model's dtype
        dtypes = getattr(op, "input_dtypes", None) or [assumed_dtype] * len(op.input_shapes)
        n = op_bytes(op.name, op.input_shapes, dtypes)
        if n is None:
            unknown.update(name for _, name in launched)
        else:
            out[max(launched)[1]] += n  # the longest kernel moves the operator's bytes
    return {k: v for k, v in out.items() if k not in unknown}


def profile_rows(times: dict, nbytes: dict, steps: int, bandwidth: float) -> list[dict]:
    """One row per kernel, slowest first: calls and us per step, share of the kernel time,
    bytes per step, GB/s and the fraction of the copy bandwidth (None where bytes are unknown)."""
    total = sum(us for _, us in times.values())
    rows = []
    for name, (calls, us) in times.items():
        n = nbytes.get(name)
        rate = None if n is None or us == 0 else n / (us / steps * 1e-6)
        rows.append(dict(kernel=name, calls=calls / steps, us=us / steps, share=us / total,
                         bytes=n, gb_s=None if rate is None else rate / 1e9,
                         of_copy=None if rate is None else rate / bandwidth))
    return sorted(rows, key=lambda r: -r["us"])


def markdown(rows: list[dict], head: str, width: int = 90) -> str:
    """The rows as a Markdown table under ``head`` (kernel names cut to ``width``)."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [head, "", "| kernel | calls/step | us/step | share | MB/step | GB/s | of copy |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = r["kernel"] if len(r["kernel"]) <= width else r["kernel"][:width - 3] + "..."
        mb = None if r["bytes"] is None else r["bytes"] / 1e6
        lines.append(f"| `{name.replace('|', '/')}` | {r['calls']:.0f} | {r['us']:.1f} | "
                     f"{r['share']:.1%} | {fmt(mb, '.2f')} | {fmt(r['gb_s'], '.0f')} | "
                     f"{fmt(r['of_copy'], '.2f')} |")
    return "\n".join(lines) + "\n"


def profile_batch(model, b: int, args, bandwidth: float) -> str:
    """Profile ``--mode`` at batch ``b``; write and return the Markdown."""
    ids, fb = decode_batch(model, b, args.context)
    torch._dynamo.reset()
    if args.mode == "dense":
        step = dense_step(model, b, args.context, args.dense_gqa)
    else:
        step = paged_step(make_forward(model, args.mode), ids, fb)
    seconds, _ = step_seconds(step, args.device, warmup=5, steps=10)  # warm-up, capture
    times = kernel_times(step, args.device, args.steps)
    # Only now the uncaptured forward: making a paged forward sets up the shared model for it
    # (``make_forward`` switches its split op on or off), which would break ``step``.
    if args.mode == "dense":  # bytes: the same Inductor kernels without the device graph
        uncaptured = dense_step(model, b, args.context, args.dense_gqa, compile_mode=None)
    else:
        uncaptured = paged_step(make_forward(model, UNCAPTURED.get(args.mode, "compiled")), ids, fb)
    nbytes = kernel_bytes(uncaptured, args.device, PROFILER_DTYPES[args.dtype],
                          inductor_records=args.mode in SAME_INDUCTOR_GRAPHS)
    rows = profile_rows(times, nbytes, args.steps, bandwidth)
    kernel_us = sum(r["us"] for r in rows)
    known = [r for r in rows if r["bytes"] is not None]
    known_us, known_bytes = sum(r["us"] for r in known), sum(r["bytes"] for r in known)
    head = (f"### {args.mode} decode step, b={b}, context {args.context}, {args.layers} layers "
            f"({args.device}, torch {torch.__version__})\n\nStep {seconds * 1e6:.0f} us "
            f"(median, to the device sync); kernels {kernel_us:.0f} us per step, "
            f"{sum(r['calls'] for r in rows):.0f} launches; copy bandwidth "
            f"{bandwidth / 1e9:.0f} GB/s; {args.steps} profiled steps. Kernels of known bytes: "
            f"{known_us:.0f} us, {known_bytes / 1e6:.1f} MB per step "
            f"({known_bytes / max(known_us, 1e-9) / 1e3:.0f} GB/s).")
    if kernel_us < 0.5 * seconds * 1e6:  # host gaps, or kernels the profiler did not see
        head += (f" The kernels cover only {kernel_us / (seconds * 1e6):.0%} of the step: the "
                 "rest is device idle time (host-bound) or kernels the profiler did not record.")
    text = markdown(rows, head)
    out = Path(args.out) / f"profile_decode_b{b}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(
        dict(batch=b, mode=args.mode, step_us=seconds * 1e6, rows=rows), indent=1))
    return text


def parse_args(argv=None) -> argparse.Namespace:
    """Options; ``--quick`` overrides the sizes with ``QUICK`` (a CPU check)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=str(dev.as_device()), choices=("cpu", "cuda", "xpu"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--mode", default="graphs", choices=MODES + PEERS)
    ap.add_argument("--dense-gqa", choices=GQA_LAYOUTS, default="pack",
                    help="GQA layout of the dense peer (--mode dense; see bench_model)")
    ap.add_argument("--layers", type=positive_int, default=16)
    ap.add_argument("--hidden", type=int, default=0, help="0: the 1B shape (see bench_model)")
    ap.add_argument("--batches", type=positive_int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=positive_int, default=1024)
    ap.add_argument("--steps", type=positive_int, default=10, help="profiled steps")
    ap.add_argument("--quick", action="store_true", help=f"CPU check: {QUICK}")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    args.dtype = getattr(torch, args.dtype)
    return args


def main(argv=None) -> None:
    """Parse ``argv``, profile every batch, print the tables."""
    args = parse_args(argv)
    model = build(args)
    bandwidth = copy_bandwidth(args.device, (64 if args.device == "cpu" else 2048) << 20)
    for b in args.batches:
        print(profile_batch(model, b, args, bandwidth), flush=True)


if __name__ == "__main__":
    main()
