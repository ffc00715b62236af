"""Op-call rows of ``bench_attention.py --kernels-table``: what one decode attention call costs.

Shapes of ``bench_op_call.py`` (Llama-3.2-1B attention: Hq 32, Hkv 8, D 64; page 16; bf16), one
request of ``context`` keys:

- eager call: one call followed by a device synchronisation (host plus device time, the figure
  an eager decode layer pays), median over ``iters`` after ``warmup`` (``bench_op_call``'s
  ``latency_us``); the ``triton`` op against torch SDPA on the same keys stored contiguously
  (``enable_gqa``) and FlashInfer's decode wrapper (planned once, outside the timing); packed
  ``q [1, Hq, D]`` with ``cu_seqlens_q``, then the 4-D ``q [1, 1, Hq, D]`` form (the op builds
  no ``cu_seqlens_q`` per call) against the same SDPA figure;
- inside a CUDA graph: ``layers`` calls, each on its own copy of the cache (as a model's
  layers), captured once; the replay's device time (CUDA events over ``replays`` replays) per
  call, for the ``triton`` op and SDPA.

Every figure is measured in the calling process, on the device the header names.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

import xpu_ops


def graph_us(fns: list[Callable[[], object]], replays: int = 50) -> float:
    """Microseconds of device time per call of ``fns`` captured together in one CUDA graph
    (warmed up on a side stream first, as capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(fns))


def _layer_calls(context: int, page: int, layers: int, device) -> dict:
    """``{"triton": [fn per layer], "sdpa": [...]}`` over ``layers`` independent caches."""
    from bench_op_call import decode_inputs  # benchmarks/ on sys.path (bench_attention)
    calls: dict[str, list] = {"triton": [], "sdpa": []}
    for _ in range(layers):
        w = decode_inputs(1, context, page, torch.bfloat16, device)
        out = torch.empty_like(w["q"])
        calls["triton"].append(lambda w=w, out=out: xpu_ops.flash_attn_with_kvcache(
            w["q"], w["k_cache"], w["v_cache"], cache_seqlens=w["cache_seqlens"],
            page_table=w["page_table"], cu_seqlens_q=w["cu_seqlens_q"], max_seqlen_q=1,
            causal=True, out=out))
        q4 = w["q"].unsqueeze(2)
        calls["sdpa"].append(lambda w=w, q4=q4: F.scaled_dot_product_attention(
            q4, w["k_dense"], w["v_dense"], enable_gqa=True))
    return calls


def triton_calls(w: dict) -> dict[str, Callable[[], object]]:
    """The eager decode call of the rows on ``bench_op_call.decode_inputs``' ``w`` (under the
    caller's provider): ``packed`` (``q [b, Hq, D]`` with ``cu_seqlens_q``) and ``4-D``
    (``q [b, 1, Hq, D]``, no ``cu_seqlens_q``)."""
    q_4d = w["q"].unsqueeze(1)
    return {"packed": lambda: xpu_ops.flash_attn_with_kvcache(
                w["q"], w["k_cache"], w["v_cache"], cache_seqlens=w["cache_seqlens"],
                page_table=w["page_table"], cu_seqlens_q=w["cu_seqlens_q"], max_seqlen_q=1,
                causal=True),
            "4-D": lambda: xpu_ops.flash_attn_with_kvcache(
                q_4d, w["k_cache"], w["v_cache"], cache_seqlens=w["cache_seqlens"],
                page_table=w["page_table"], causal=True)}


def call_rows(context: int = 1024, page: int = 16, layers: int = 16, warmup: int = 50,
              iters: int = 300, device: str = "cuda") -> list[dict]:
    """The three rows: ``{"workload", "unit", "triton", "sdpa", "flashinfer"}`` in microseconds
    (None: the peer could not run here), with the ``triton`` provider selected for the op; the
    graph row (the last) only on CUDA (elsewhere its figures are None: a CPU smoke run)."""
    from bench_op_call import decode_inputs, flashinfer_run, latency_us
    device = torch.device(device)
    w = decode_inputs(1, context, page, torch.bfloat16, device)
    q4 = w["q"].unsqueeze(2)
    eager: dict[str, Optional[float]] = {}
    forms = triton_calls(w)
    with xpu_ops.use_provider("triton"):
        fns = {"triton": forms["packed"],
               "sdpa": lambda: F.scaled_dot_product_attention(q4, w["k_dense"], w["v_dense"],
                                                              enable_gqa=True),
               "flashinfer": flashinfer_run(w, context, page)}
        for name, fn in fns.items():
            eager[name] = None if fn is None else _guarded(
                lambda fn=fn: latency_us(fn, device, warmup, iters)["us"], name)
        eager_4d = _guarded(lambda: latency_us(forms["4-D"], device, warmup, iters)["us"],
                            "triton 4-D")
        graphed = {name: _guarded(lambda fns=fns_: graph_us(fns), f"{name} graph")
                   if device.type == "cuda" else None
                   for name, fns_ in _layer_calls(context, page, layers, device).items()}
    return [dict(workload=f"eager decode call b=1, ctx {context} (host + device)", unit="us",
                 **eager),
            dict(workload=f"eager decode call b=1, ctx {context}, 4-D q [1, 1, Hq, D] without "
                          "cu_seqlens_q (host + device)", unit="us", triton=eager_4d,
                 sdpa=eager["sdpa"], flashinfer=None),
            dict(workload=f"the packed call inside a CUDA graph ({layers} calls on {layers} caches, "
                          "device time per call)", unit="us", flashinfer=None, **graphed)]


def _guarded(measure: Callable[[], float], name: str) -> Optional[float]:
    try:
        return measure()
    except Exception as e:  # a peer that cannot run here is reported as missing
        print(f"    {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def calls_table(rows: list[dict], header: str) -> str:
    """Markdown: microseconds per call and the peer / triton ratios (> 1: triton faster)."""
    def us(x):
        return "missing" if x is None else f"{x:.1f}"

    def ratio(r, p):
        return "-" if not (r.get(p) and r.get("triton")) else f"{r[p] / r['triton']:.2f}"
    lines = [header, "", "| workload | triton us | SDPA us | FlashInfer us | x sdpa | "
             "x flashinfer | target |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        target = "<= 2x SDPA: " + ("yes" if r.get("sdpa") and r.get("triton")
                                   and r["triton"] <= 2 * r["sdpa"] else "no") \
            if r["workload"].startswith("eager") else "-"
        lines.append(f"| {r['workload']} | {us(r.get('triton'))} | {us(r.get('sdpa'))} | "
                     f"{us(r.get('flashinfer'))} | {ratio(r, 'sdpa')} | "
                     f"{ratio(r, 'flashinfer')} | {target} |")
    return "\n".join(lines)
