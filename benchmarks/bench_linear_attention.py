"""Gated-delta-net ops at Qwen3-Next's layer shape: decode, target verify and prefill.

Cases (Hk = 16, Hv = 32, K = V = 128, conv over 2 Hk K + Hv V = 8192 channels, width 4):
  ``decode``   ``fused_recurrent_gated_delta_rule`` with one token for each of ``b`` requests
               and ``causal_conv1d_update``: bound by reading and writing each request's state
               once (``bytes_moved``), reported as a fraction of the device copy bandwidth
               measured in the same run
  ``verify``   the recurrence over ``b`` requests x 4 draft tokens with intermediate states
               (written once per token: ``4 x`` the state bytes more)
  ``prefill``  ``chunk_gated_delta_rule`` and ``causal_conv1d_fn`` over requests of ``L``
               tokens: matrix work (``flops``), reported as TFLOP/s

Providers: ``triton`` and ``reference`` (plain PyTorch on the device, the peer), and
flash-linear-attention's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``
when the ``fla`` package imports (reported as missing otherwise). Times are medians of
``triton.testing.do_bench`` on a GPU; on a CPU (``--quick``: tiny shapes, reference only) of
``time.perf_counter`` runs.

    python benchmarks/bench_linear_attention.py --device cuda --out $OUT/gdn
    python benchmarks/bench_linear_attention.py --device cpu --quick --out /tmp/gdn
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import xpu_ops
from decode_roofline import copy_bandwidth

SHAPE = dict(hk=16, hv=32, k=128, v=128, width=4)
QUICK_SHAPE = dict(hk=1, hv=2, k=16, v=16, width=4)


def bytes_moved(case: str, b: int, tokens: int, s: dict) -> int:
    """Bytes a perfect kernel moves: every state read and written once (float32), intermediate
    states written once per token, q/k/v/o and the conv rows in bf16 once."""
    state = s["hv"] * s["k"] * s["v"] * 4
    rows = tokens * (2 * s["hk"] * s["k"] + 2 * s["hv"] * s["v"]) * 2
    inter = tokens * state if case == "verify" else 0
    return 2 * b * state + inter + rows


def flops(tokens: int, s: dict, chunk: int = 64) -> int:
    """Chunked form, per token and value head: S^T k, S^T q and the state update (3 K V
    multiply-adds) plus the in-chunk products k k^T, q k^T (2 C K) and their use (2 C V)."""
    per_head = 3 * s["k"] * s["v"] + 2 * chunk * s["k"] + 2 * chunk * s["v"]
    return 2 * tokens * s["hv"] * per_head


def _inputs(lens, s, device, gen):
    total = sum(lens)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(torch.bfloat16).to(device)  # noqa
    q, k, v = rand(total, s["hk"], s["k"]), rand(total, s["hk"], s["k"]), rand(total, s["hv"], s["v"])
    g = torch.nn.functional.logsigmoid(torch.randn(total, s["hv"], generator=gen) + 3).to(device)
    beta = torch.rand(total, s["hv"], generator=gen).to(device)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=device)
    states = torch.randn(len(lens), s["hv"], s["k"], s["v"], generator=gen).to(device) * 0.1
    slots = torch.arange(len(lens), dtype=torch.int32, device=device)
    return q, k, v, g, beta, cu, states, slots


def calls(case: str, b: int, length: int, s: dict, device, gen) -> dict:
    """``{name: zero-argument call}`` of one case (the ops mutate their states in place)."""
    lens = [length] * b
    q, k, v, g, beta, cu, states, slots = _inputs(lens, s, device, gen)
    dim = 2 * s["hk"] * s["k"] + s["hv"] * s["v"]
    x = torch.randn(sum(lens), dim, generator=gen).to(torch.bfloat16).to(device)
    weight = torch.randn(dim, s["width"], generator=gen).to(torch.bfloat16).to(device)
    conv = torch.randn(b, dim, s["width"] - 1, generator=gen).to(torch.bfloat16).to(device)
    init = torch.ones(b, dtype=torch.bool, device=device)
    if case == "prefill":
        return {"gdn": lambda: xpu_ops.chunk_gated_delta_rule(q, k, v, g, beta, None, states,
                                                              slots, init, cu),
                "conv": lambda: xpu_ops.causal_conv1d_fn(x, weight, None, conv, cu, slots, init)}
    inter = (torch.empty(b, length, s["hv"], s["k"], s["v"], device=device)
             if case == "verify" else None)
    xs = x.view(b, length, dim)
    return {"gdn": lambda: xpu_ops.fused_recurrent_gated_delta_rule(
                q, k, v, g, beta, None, states, slots, cu, intermediate_states=inter),
            "conv": lambda: xpu_ops.causal_conv1d_update(xs, conv, weight, None,
                                                         conv_state_indices=slots)}


def median_seconds(fn, device) -> float:
    """Median seconds of ``fn()``: ``triton.testing.do_bench`` on a GPU, else 5 timed runs."""
    if device.type != "cpu":
        import triton.testing
        return triton.testing.do_bench(fn, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fla_calls(case: str, b: int, length: int, s: dict, device, gen) -> dict:
    """flash-linear-attention's GDN kernels on the same shapes (batch of one packed sequence),
    or ``{}`` when ``fla`` does not import."""
    try:
        from fla.ops.gated_delta_rule import (chunk_gated_delta_rule,
                                              fused_recurrent_gated_delta_rule)
    except ImportError:
        return {}
    q, k, v, g, beta, cu, states, _ = _inputs([length] * b, s, device, gen)
    rep = s["hv"] // s["hk"]
    q, k = q.repeat_interleave(rep, 1)[None], k.repeat_interleave(rep, 1)[None]
    fn = chunk_gated_delta_rule if case == "prefill" else fused_recurrent_gated_delta_rule
    return {"gdn": lambda: fn(q, k, v[None], g[None], beta[None], initial_state=states,
                              output_final_state=True, cu_seqlens=cu.long(),
                              use_qk_l2norm_in_kernel=True)}


def run(args) -> list[dict]:
    device = torch.device(args.device)
    s = QUICK_SHAPE if args.quick else SHAPE
    cases = ([("decode", 2, 1), ("verify", 2, 4), ("prefill", 1, 32)] if args.quick else
             [("decode", 1, 1), ("decode", 32, 1), ("decode", 256, 1), ("verify", 32, 4),
              ("prefill", 1, 4096), ("prefill", 8, 1024)])
    bandwidth = copy_bandwidth(device, 1 << 24 if args.quick else 1 << 30)
    rows = []
    for case, b, length in cases:
        gen = torch.Generator().manual_seed(0)
        for provider in args.providers:
            with xpu_ops.use_provider(provider):
                for op, fn in calls(case, b, length, s, device, gen).items():
                    rows.append(_row(case, b, length, s, provider, op, fn, device, bandwidth))
        for op, fn in fla_calls(case, b, length, s, device, gen).items():
            rows.append(_row(case, b, length, s, "fla", op, fn, device, bandwidth))
    return rows


def _row(case, b, length, s, provider, op, fn, device, bandwidth) -> dict:
    seconds = median_seconds(fn, device)
    tokens = b * length
    row = dict(case=case, b=b, tokens_per_request=length, provider=provider, op=op,
               us=seconds * 1e6)
    if op == "gdn":
        row["bandwidth_fraction"] = bytes_moved(case, b, tokens, s) / seconds / bandwidth
        row["tflops"] = flops(tokens, s) / seconds / 1e12
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU check)")
    parser.add_argument("--providers", nargs="+", default=None)
    parser.add_argument("--out", default=None, help="folder for linear_attention.json / .md")
    args = parser.parse_args(argv)
    if args.providers is None:
        args.providers = ["reference"] if args.device == "cpu" else ["triton", "reference"]
    rows = run(args)
    header = (f"device {torch.device(args.device).type}, torch {torch.__version__}, shape "
              f"{QUICK_SHAPE if args.quick else SHAPE}; fla "
              f"{'present' if any(r['provider'] == 'fla' for r in rows) else 'missing'}")
    lines = [header, "", "| case | b | tokens | provider | op | us | of copy BW | TFLOP/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['b']} | {r['tokens_per_request']} | {r['provider']} | "
                     f"{r['op']} | {r['us']:.1f} | {r.get('bandwidth_fraction', 0):.3f} | "
                     f"{r.get('tflops', 0):.3f} |")
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "linear_attention.json"), "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "linear_attention.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
