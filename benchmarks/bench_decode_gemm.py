"""The GEMMs of one decode step, alone: which GEMM choice streams the weights fastest.

A decode step of the 16-layer Llama-3.2-1B shape (``bench_model``'s) runs, per layer, the fused
QKV projection ``[b, 2048] x [2048, 3072]``, the output projection ``[b, 2048] x [2048, 2048]``,
the fused gate/up projection ``[b, 2048] x [2048, 16384]`` and the down projection
``[b, 8192] x [8192, 2048]``, then the LM head ``[b, 2048] x [2048, 128256]`` once. At b <= 64
every one of them is bound by reading its weight, so each is reported as the fraction of the
device copy bandwidth its weight bytes reach.

Each shape is timed as 16 calls over 16 distinct weights (one per layer: the step's weights do
not fit in L2, so neither do these), recorded in one device graph and replayed: launch gaps
are those of a captured step, and the time per call is the replay's over 16.

GEMM choices (``--choices``):
  ``cublas``       ``torch.nn.functional.linear`` as the model calls it (cuBLAS; the default)
  ``cublaslt``     the same under ``torch.backends.cuda.preferred_blas_library("cublaslt")``
  ``no_reduced``   cuBLAS with ``allow_bf16_reduced_precision_reduction = False`` (what
                   split-K may do with its partial sums)
  ``autotune``     ``torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)``:
                   Inductor's Triton GEMM templates against cuBLAS, per static shape

    python benchmarks/bench_decode_gemm.py --device cuda --out $OUT/gemm
    python benchmarks/bench_decode_gemm.py --device cpu --quick      # CPU check: tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from decode_roofline import copy_bandwidth

# name -> (K, N) of the 1B shape (bench_model.LLAMA_1B)
SHAPES = {"qkv": (2048, 3072), "o_proj": (2048, 2048), "gate_up": (2048, 16384),
          "down": (8192, 2048), "lm_head": (2048, 128256)}
CHOICES = ("cublas", "cublaslt", "no_reduced", "autotune")  # timed in this order
LAYERS = 16


def linear_for(choice: str):
    """The linear function of ``choice`` (module docstring): ``F.linear``, or for ``autotune``
    its Inductor compile; the cuBLAS switches of the other choices are ``_Settings``'."""
    if choice == "autotune":
        return torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
    return F.linear


class _Settings:
    """Sets the global cuBLAS switches of ``choice`` for the ``with`` body, then restores them."""

    def __init__(self, choice: str):
        self.choice = choice

    def __enter__(self):
        self.lib = torch.backends.cuda.preferred_blas_library()
        self.reduced = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        if self.choice == "cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        if self.choice == "no_reduced":
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

    def __exit__(self, *exc):
        torch.backends.cuda.preferred_blas_library(self.lib)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = self.reduced


def time_calls(fn, xs, ws, device, reps: int) -> float:
    """Seconds per ``fn(x, w)`` call: ``len(ws)`` calls recorded once and replayed ``reps``
    times on a GPU (median of 5 timings), or run eagerly on a CPU."""
    def body():
        return [fn(x, w) for x, w in zip(xs, ws)]
    for _ in range(3):
        body()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            body()
        return (time.perf_counter() - t0) / reps / len(ws)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    times = []
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps / len(ws))
    return sorted(times)[2]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--choices", nargs="+", choices=CHOICES, default=list(CHOICES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="CPU check: shapes / 64, 2 layers")
    ap.add_argument("--out", default="benchmarks/results/decode_gemm")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    scale, layers = (64, 2) if args.quick else (1, LAYERS)
    if args.quick:
        args.batches, args.reps = [1, 4], 2
    bandwidth = copy_bandwidth(device, 1 << 30 if not args.quick else 1 << 20)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; {torch.__version__}", flush=True)
    weights, results = {}, []
    for name, (k, n) in SHAPES.items():
        k, n = max(k // scale, 16), max(n // scale, 16)
        weights[name] = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5
                         for _ in range(1 if name == "lm_head" else layers)]
    os.makedirs(args.out, exist_ok=True)
    for choice in args.choices:  # autotune last: its compiles are the slow part
        if choice in ("cublaslt", "no_reduced") and device.type != "cuda":
            continue
        for name, ws in weights.items():
            n, k = ws[0].shape
            for b in args.batches:
                xs = [torch.randn(b, k, device=device, dtype=torch.bfloat16) for _ in ws]
                with _Settings(choice):
                    fn = linear_for(choice)
                    err = max((fn(x, w).double() - F.linear(x.double(), w.double())).abs()
                              .max().item() for x, w in zip(xs, ws))
                    sec = time_calls(fn, xs, ws, device, args.reps)
                nbytes = (n * k + b * k + b * n) * 2
                row = dict(shape=name, k=k, n=n, batch=b, choice=choice, us=sec * 1e6,
                           of_copy=nbytes / sec / bandwidth, max_abs_err=err)
                results.append(row)
                print(f"{name:8s} b={b:3d} {choice:10s} {sec * 1e6:8.2f} us "
                      f"{row['of_copy']:.2f} of copy  err {err:.2e}", flush=True)
                with open(os.path.join(args.out, "decode_gemm.json"), "w") as f:  # a cut run
                    json.dump(dict(bandwidth=bandwidth, torch=torch.__version__,  # keeps rows
                                   rows=results), f, indent=1)
            torch._dynamo.reset()
    # per step: the sum over shapes of calls x time, each choice against cuBLAS
    print("\n| batch | " + " | ".join(args.choices) + " |  (us per step, 16 layers + LM head)")
    print("|---|" + "---:|" * len(args.choices))
    for b in args.batches:
        cells = []
        for choice in args.choices:
            rows = [r for r in results if r["batch"] == b and r["choice"] == choice]
            us = sum(r["us"] * (1 if r["shape"] == "lm_head" else layers) for r in rows)
            cells.append(f"{us:.0f}" if rows else "-")
        print(f"| {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
