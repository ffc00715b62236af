"""Decode attention as a model's graph replays it: split counts and tiles timed on the device.

``do_bench`` of one small decode launch times the host launcher (tens of microseconds) rather
than the kernel (a few), so a split sweep through it cannot rank split counts at small batches.
Here ``--layers`` launches of the Triton launcher (one per layer, each on its own KV cache, so
the L2 does not keep a cache from one launch to the next, as in a model) are captured in one
device graph; a replay's time over ``--layers`` is the device time per layer, launch gaps of a
graph included, as in ``bench_model``'s ``graphs`` mode. Rows: every (batch, context) of
``--batches`` x ``--contexts``; columns: the planned split count (``auto``, with what
``plan_splits`` chose) and each forced count of ``--splits``, then the tile configs of
``--configs`` (``BLOCK_M,BLOCK_N,warps,stages``) at the planned split count. Also the fraction
of the copy bandwidth (K/V bytes read once per layer over the time).

    python benchmarks/bench_decode_graph.py --device cuda --out benchmarks/results/decode_graph
    python benchmarks/bench_decode_graph.py --device cpu --quick      # CPU check (interpreter)

Shapes: Llama-3.2-1B's attention (Hq 32, Hkv 8, D 64), bf16, page 16 (``--page-size``),
shuffled pages, one query token per request at the context length.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import torch

from xpu_ops.triton import paged_attention as pa

HQ, HKV, D = 32, 8, 64


def make_layers(b: int, context: int, page_size: int, layers: int, device, dtype,
                table_tokens: int = 0):
    """``layers`` independent paged caches of ``b`` requests of ``context`` keys, shuffled
    pages; one shared q, page table and metadata (as one decode step's layers share them). The
    page table is ``table_tokens`` wide when that is more (a serving graph's table: as wide as
    the request pool; the split plan sees that capacity), its extra entries page 0."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    pages_per = -(-context // page_size)
    num_pages = b * pages_per + 1
    table = (torch.randperm(num_pages - 1, generator=gen)[: b * pages_per] + 1).int()
    width = max(pages_per, -(-table_tokens // page_size))
    table = torch.cat([table.view(b, pages_per),
                       torch.zeros(b, width - pages_per, dtype=torch.int32)], 1).to(device)
    caches = [(torch.randn(num_pages, page_size, HKV, D, generator=gen).to(device, dtype),
               torch.randn(num_pages, page_size, HKV, D, generator=gen).to(device, dtype))
              for _ in range(layers)]
    q = torch.randn(b, HQ, D, generator=gen).to(device, dtype)
    lens = torch.full((b,), context, dtype=torch.int32, device=device)
    cu = torch.arange(b + 1, dtype=torch.int32, device=device)
    return dict(q=q, caches=caches, table=table, lens=lens, cu=cu, page_size=page_size)


def launches(w, num_splits=None, config=None):
    """One step's attention: one launcher call per layer into its own output."""
    outs = [torch.empty_like(w["q"]) for _ in w["caches"]]
    kv_len = w["table"].shape[1] * w["page_size"]

    def run():
        for (k, v), out in zip(w["caches"], outs):
            pa.paged_attention(w["q"], k, v, out, w["lens"], w["cu"], page_table=w["table"],
                               cu_seqlens_k=None, max_seqlen_q=1, max_kv_len=kv_len, qv=None,
                               q_descale=None, k_descale=None, v_descale=None, sinks=None,
                               softmax_scale=1 / math.sqrt(D), window_left=-1, window_right=0,
                               softcap=0.0, num_splits=num_splits, config=config,
                               return_lse=False)
    return run, outs


def graph_us_per_layer(run, device, layers: int, replays: int) -> float:
    """Median microseconds per layer of a replayed graph of ``run`` (on the CPU: of ``run``)."""
    run()  # compile, warm up
    if device.type != "cuda":
        times = []
        for _ in range(replays):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6 / layers
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times) / layers


def kv_bytes(b: int, context: int, elem: int) -> int:
    """K and V bytes one layer reads: ``2 * b * context * Hkv * D * elem``."""
    return 2 * b * context * HKV * D * elem


def parse_config(text: str, default) -> object:
    """``BLOCK_M,BLOCK_N,warps,stages`` as the default config with those tiles (its kernel
    paths kept)."""
    bm, bn, warps, stages = (int(x) for x in text.split(","))
    return dataclasses.replace(default, block_m=bm, block_n=bn, num_warps=warps,
                               num_stages=stages)


def row(b: int, context: int, args, bandwidth: float) -> dict:
    """Times of one (batch, context): planned, each forced split count, each config."""
    device = torch.device(args.device)
    w = make_layers(b, context, args.page_size, args.layers, device, args.dtype,
                    args.table_tokens)
    cfg = pa.default_config(w["q"], w["caches"][0][1], 1, HKV, page_size=args.page_size)
    grid_m = pa.cdiv(HQ // HKV, cfg.block_m)
    elem, pad = w["q"].element_size(), max(16, pa.next_pow2(D))
    planned, _ = pa.plan_splits(device, grid_m * b * HKV, w["table"].shape[1] * args.page_size,
                                cfg.block_n, decode=True,
                                resident=pa.decode_resident(device, cfg, pad, pad, elem, elem))
    out = dict(batch=b, context=context, planned_splits=planned, us={})
    ref = None
    variants = [("auto", {})] + [(f"s={s}", dict(num_splits=s)) for s in args.splits]
    variants += [(f"cfg={c}", dict(config=parse_config(c, cfg))) for c in args.configs]
    for name, kw in variants:
        run, outs = launches(w, **kw)
        out["us"][name] = graph_us_per_layer(run, device, args.layers, args.replays)
        if ref is None:
            ref = [o.clone() for o in outs]
        else:  # every variant computes the same attention
            err = max((o.float() - r.float()).abs().max().item() for o, r in zip(outs, ref))
            out.setdefault("max_diff", {})[name] = err
    out["of_copy"] = {k: kv_bytes(b, context, w["q"].element_size()) / (us * 1e-6) / bandwidth
                      for k, us in out["us"].items()}
    return out


def copy_bandwidth(device, mib: int) -> float:
    """Device copy bandwidth (bytes/s, read plus write) of a ``mib`` MiB buffer."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - t0)


def markdown(rows: list[dict], head: str) -> str:
    names = list(rows[0]["us"])
    lines = [head, "", "| b | context | planned splits | " + " | ".join(f"{n} us" for n in names)
             + " | best | auto of copy |", "|---" * (len(names) + 5) + "|"]
    for r in rows:
        best = min(r["us"], key=r["us"].get)
        lines.append(f"| {r['batch']} | {r['context']} | {r['planned_splits']} | "
                     + " | ".join(f"{r['us'][n]:.2f}" for n in names)
                     + f" | {best} | {r['of_copy']['auto']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--configs", nargs="*", default=["16,64,2,4", "16,32,2,4", "16,64,4,4",
                                                     "16,16,2,8", "16,128,4,3"],
                    help="BLOCK_M,BLOCK_N,warps,stages tile configs at the planned splits")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=16, help="launches per graph")
    ap.add_argument("--table-tokens", type=int, default=0,
                    help="page-table capacity in tokens (0: the context; a serving graph's is "
                         "the request pool's, e.g. 8192)")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="CPU check: tiny sizes")
    ap.add_argument("--out", default=None, help="directory for decode_graph.{md,json}")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.splits = [1, 2], [48], [1, 4]
        args.configs, args.layers, args.replays = ["16,16,1,1"], 2, 1
    args.dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device, 64 if device.type == "cpu" else 1024)
    rows = []
    for b in args.batches:
        for context in args.contexts:
            rows.append(row(b, context, args, bandwidth))
            r = rows[-1]
            print(f"b={b} ctx={context} planned {r['planned_splits']}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["us"].items()), flush=True)
    props = (torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    head = (f"### Decode attention per layer in a replayed graph ({props}, torch "
            f"{torch.__version__}, page {args.page_size}, table "
            f"{args.table_tokens or 'as long as the context'}, {args.layers} launches per "
            f"graph, Hq {HQ}, Hkv {HKV}, D {D}; copy {bandwidth / 1e9:.0f} GB/s)")
    text = markdown(rows, head)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode_graph.md").write_text(text)
        (out / "decode_graph.json").write_text(json.dumps(
            [dict(r, us=r["us"]) for r in rows], indent=1, default=str))
    return rows


if __name__ == "__main__":
    main()
