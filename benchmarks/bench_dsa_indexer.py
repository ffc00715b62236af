"""The DSA indexer ops at DeepSeek-V3.2's sizes (64 index heads, D = 128, block 64, top-2048):
time per call of each provider, as a fraction of the device's ceilings measured in this run.

Cases (``--cases``):
  ``paged``    ``fp8_paged_mqa_logits``, decode (``next_n = 1``) of ``b`` requests of ``context``
               keys: bound by reading the cache, ``b * context * (D + 4)`` bytes, plus writing
               the float32 logits, ``b * context * 4`` bytes
  ``ragged``   ``fp8_mqa_logits``, an extend of ``b`` new tokens over ``context`` cached ones:
               ``2 * b * H * D * keys`` FLOPs with ``keys`` the causal total
  ``topk``     ``fast_topk_v2`` over ``b`` rows of ``context`` float32 logits: one read of the
               row is ``b * context * 4`` bytes (the Triton kernel reads it 5 times: 4 radix
               passes of 8 bits and the compaction); the decode rows (b = 1, 8, 32 at 8192)
               are the DSA decode step's, one program per row
Ceilings: device copy bandwidth (``decode_roofline.copy_bandwidth``) and a bf16 matmul's
TFLOP/s, both measured first. Peers: every provider that runs on the device (``reference``,
``triton``, ``sgl_kernel`` where installed); DeepGEMM is not a dependency and is not timed.

    python benchmarks/bench_dsa_indexer.py --device cuda --out $OUT/dsa
    python benchmarks/bench_dsa_indexer.py --device cpu --quick          # CPU check: tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import xpu_ops
from xpu_ops import providers
from decode_roofline import copy_bandwidth

HEADS, DIM, BLOCK, TOPK = 64, 128, 64, 2048
FULL = {"paged": [(1, 65536), (32, 16384), (128, 8192)], "ragged": [(2048, 8192), (8192, 0)],
        "topk": [(1, 8192), (8, 8192), (32, 8192), (32, 65536), (128, 16384)]}
QUICK = {"paged": [(2, 256)], "ragged": [(64, 64)], "topk": [(4, 4096)]}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def time_call(fn, device, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls, each timed to a device sync, after 3."""
    times = []
    for i in range(reps + 3):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_tflops(device, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n ** 3 / time_call(lambda: a @ a, device, 10) / 1e12


def _paged_inputs(device, b, context):
    width = -(-context // BLOCK)
    cache = torch.zeros(b * width, BLOCK, 1, DIM + 4, dtype=torch.uint8, device=device)
    xpu_ops.store_index_k_cache(cache, torch.arange(b * width * BLOCK, device=device),
                                torch.randn(b * width * BLOCK, DIM, device=device))
    table = torch.randperm(b * width, device=device).to(torch.int32).view(b, width)
    lens = torch.full((b,), context, dtype=torch.int32, device=device)
    q = torch.randn(b, 1, HEADS, DIM, device=device).to(torch.float8_e4m3fn)
    w = torch.randn(b, HEADS, device=device)
    call = (q, cache, w, lens, table, None, context)
    return (lambda: xpu_ops.fp8_paged_mqa_logits(*call)), b * context * (DIM + 8), 0


def _ragged_inputs(device, b, prefix):
    keys = prefix + b
    q = torch.randn(b, HEADS, DIM, device=device).to(torch.float8_e4m3fn)
    k = torch.randn(keys, DIM, device=device).to(torch.float8_e4m3fn)
    scale = torch.rand(keys, device=device) + 0.1
    w = torch.randn(b, HEADS, device=device)
    ks = torch.zeros(b, dtype=torch.int32, device=device)
    ke = torch.arange(b, dtype=torch.int32, device=device) + prefix + 1
    flops = 2 * HEADS * DIM * int((ke - ks).sum())
    return (lambda: xpu_ops.fp8_mqa_logits(q, (k, scale), w, ks, ke)), b * keys * 4, flops


def _topk_inputs(device, b, context):
    score = torch.randn(b, context, device=device)
    lens = torch.full((b,), context, dtype=torch.int32, device=device)
    return (lambda: xpu_ops.fast_topk_v2(score, lens, min(TOPK, context))), b * context * 4, 0


INPUTS = {"paged": _paged_inputs, "ragged": _ragged_inputs, "topk": _topk_inputs}
OPS = {"paged": "fp8_paged_mqa_logits", "ragged": "fp8_mqa_logits", "topk": "fast_topk"}


def run(device, cases, sizes, reps) -> list[dict]:
    """One row per (case, size, provider): seconds, GB/s and TFLOP/s with their fractions."""
    bandwidth = copy_bandwidth(device, 1 << 28 if device.type != "cpu" else 1 << 22)
    peak = matmul_tflops(device, 8192 if device.type != "cpu" else 512)
    rows = []
    for case in cases:
        for b, context in sizes[case]:
            fn, nbytes, flops = INPUTS[case](device, b, context)
            for name, reason in providers.candidates(OPS[case], device.type):
                if reason is not None:
                    rows.append(dict(case=case, b=b, context=context, provider=name,
                                     skipped=reason))
                    continue
                with xpu_ops.use_provider(name):
                    seconds = time_call(fn, device, reps)
                rows.append(dict(case=case, b=b, context=context, provider=name,
                                 ms=seconds * 1e3, gbps=nbytes / seconds / 1e9,
                                 bw_fraction=nbytes / seconds / bandwidth,
                                 tflops=flops / seconds / 1e12,
                                 flop_fraction=flops / seconds / 1e12 / peak))
    return [dict(copy_gbps=bandwidth / 1e9, matmul_tflops=peak)] + rows


def markdown(rows) -> str:
    head = rows[0]
    lines = [f"copy {head['copy_gbps']:.0f} GB/s, bf16 matmul {head['matmul_tflops']:.0f} "
             f"TFLOP/s; torch {torch.__version__}", "",
             "| case | b | context | provider | ms | GB/s (of copy) | TFLOP/s (of matmul) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows[1:]:
        if "skipped" in r:
            lines.append(f"| {r['case']} | {r['b']} | {r['context']} | {r['provider']} | "
                         f"skipped: {r['skipped']} | | |")
            continue
        lines.append(f"| {r['case']} | {r['b']} | {r['context']} | {r['provider']} | "
                     f"{r['ms']:.3f} | {r['gbps']:.0f} ({r['bw_fraction']:.0%}) | "
                     f"{r['tflops']:.1f} ({r['flop_fraction']:.0%}) |")
    return "\n".join(lines)


def case_main(doc: str, inputs: dict, run, quick, full, argv=None) -> None:
    """The command line of a case benchmark (this one, bench_flash_mla): ``--cases`` of
    ``inputs``, ``run(device, cases, quick or full shapes, reps)`` for the rows, their table
    printed and, with ``--out``, written as results.json and results.md."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cases", nargs="+", default=list(inputs), choices=list(inputs))
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU check)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None, help="folder for results.json and results.md")
    args = parser.parse_args(argv)
    rows = run(torch.device(args.device), args.cases, quick if args.quick else full, args.reps)
    table = markdown(rows)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(table + "\n")


def main(argv=None) -> None:
    case_main(__doc__, INPUTS, run, QUICK, FULL, argv)


if __name__ == "__main__":
    main()
