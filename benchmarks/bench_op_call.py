"""Whole-call latency of the eager op calls against their peers, and compiled decode host time.

Three tables, every figure measured in this process (host plus device, medians):

1. ``flash_attn_with_kvcache`` decode: ``b`` requests of ``--context`` cached tokens in a paged
   cache (``--page-size``), one query token each, against torch SDPA's eager call on the same
   keys stored contiguously (``[b, Hkv, context, D]``, ``enable_gqa=True``) and FlashInfer's
   ``BatchDecodeWithPagedKVCacheWrapper.run`` on the same pages (planned once, outside the
   timing, as a serving engine does; reported as missing where ``flashinfer`` does not import).
2. ``store_kv_cache`` of one decode token per request against the two ``index_copy_`` calls that
   write the same K and V rows into the flat caches; ``merge_state_v2`` of two decode states
   against the same merge written as four PyTorch calls.
3. The floor of an eager op call under public APIs (``floor_rows``): (a) one dispatcher round
   trip into a no-op Python kernel (an empty ``torch.library.custom_op`` with a kernel for the
   device, and the same through ``torch.library.Library`` with ``flash_attn_with_kvcache``'s
   22-argument schema, as ``xpu_ops._registration.define_op`` registers it), (b) one launch of
   an empty Triton kernel through ``kernel[grid](...)`` with the plain decode entry's 15 runtime
   arguments (10 tensors, 5 ints; also with its 29 constexprs), and (c) their sum against
   SDPA's whole call and the 1.25x target, plus the two measured as one call (the 22-argument op
   whose kernel launches the empty kernel). On the CPU the empty kernel runs through Triton's
   interpreter (a smoke test of the rows, not a floor).
4. A decode step of the Llama-3.2-1B-shaped model (``--layers``, ``--hidden`` to shrink it):
   eager against ``compile_model`` (``torch.compile`` through Inductor, no device graphs), step
   time and host time per step (until ``forward`` returns), at each of ``--batches``.

A call's latency is one call followed by a device synchronisation (``sync(); t0; fn(); sync();
t1``), so it is host plus device time, the figure an eager decode layer pays; tables 1 to 3
report the median over ``--iters`` such calls after ``--warmup`` calls, with the ratio to each
peer. Shapes (Llama-3.2-1B: Hq 32, Hkv 8, D 64) are the same on every device; on the CPU use
``--context 256`` or less and a shrunken model for a quick run.

    python benchmarks/bench_op_call.py --device cuda --out-dir DIR          # the H200 tables
    python benchmarks/bench_op_call.py --device cpu --dtype float32 --context 256 \\
        --layers 2 --hidden 256 --batches 1 8                               # CPU check
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import xpu_ops
from compile.graphs import device as dev
from bench_model import (build, decode_batch, make_forward, paged_step,  # benchmarks/ on sys.path
                         step_seconds)

try:
    import triton
    import triton.language as tl
except ImportError:  # the floor's Triton rows are reported missing
    triton = None

RESULTS = Path(__file__).parent / "results"
HQ, HKV, D = 32, 8, 64  # Llama-3.2-1B attention shape


def latency_us(fn: Callable[[], object], device: torch.device, warmup: int,
               iters: int) -> dict:
    """``{"us": median microseconds of one call plus a device synchronisation, "host_us":
    median microseconds until the call returns}`` (the host part: checks, dispatch, launch)."""
    for _ in range(warmup):
        fn()
    times, host = [], []
    for _ in range(iters):
        dev.synchronize(device)
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        dev.synchronize(device)
        times.append((time.perf_counter_ns() - t0) / 1e3)
        host.append((t1 - t0) / 1e3)
    return {"us": statistics.median(times), "host_us": statistics.median(host)}


def decode_inputs(b: int, context: int, page_size: int, dtype: torch.dtype,
                  device: torch.device) -> dict:
    """Random decode inputs: ``q [b, Hq, D]``, a paged cache with shuffled pages holding each
    request's ``context`` keys, its page table and lengths, and the same keys contiguous."""
    g = torch.Generator().manual_seed(0)
    pages_per_req = -(-context // page_size)
    num_pages = b * pages_per_req
    k_cache = torch.randn(num_pages, page_size, HKV, D, generator=g).to(device, dtype)
    v_cache = torch.randn(num_pages, page_size, HKV, D, generator=g).to(device, dtype)
    table = torch.randperm(num_pages, generator=g).view(b, pages_per_req).to(torch.int32)
    keys = k_cache.cpu()[table.long()].flatten(1, 2)[:, :context]   # [b, context, Hkv, D]
    vals = v_cache.cpu()[table.long()].flatten(1, 2)[:, :context]
    return dict(
        q=torch.randn(b, HQ, D, generator=g).to(device, dtype), k_cache=k_cache, v_cache=v_cache,
        page_table=table.to(device), cache_seqlens=torch.full((b,), context, dtype=torch.int32,
                                                              device=device),
        cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32, device=device),
        k_dense=keys.transpose(1, 2).contiguous().to(device),  # [b, Hkv, context, D]
        v_dense=vals.transpose(1, 2).contiguous().to(device))


def flashinfer_run(w: dict, context: int, page_size: int) -> Optional[Callable[[], object]]:
    """FlashInfer's decode ``run`` on ``w``'s pages, planned here; None when it does not import
    or cannot plan on this device."""
    try:
        import flashinfer
    except Exception:
        return None
    b, pages = w["page_table"].shape
    device = w["q"].device
    indptr = torch.arange(0, (b + 1) * pages, pages, dtype=torch.int32, device=device)
    last = torch.full((b,), context - (pages - 1) * page_size, dtype=torch.int32, device=device)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    try:
        wrapper.plan(indptr, w["page_table"].flatten(), last, HQ, HKV, D, page_size,
                     data_type=w["q"].dtype, q_data_type=w["q"].dtype)
    except Exception as e:  # e.g. no kernels for this device or dtype
        print(f"flashinfer: plan failed ({type(e).__name__}: {e})")
        return None
    kv = (w["k_cache"], w["v_cache"])
    return lambda: wrapper.run(w["q"], kv)


def attention_row(args, device: torch.device) -> dict:
    """Table 1 for ``b = args.attention_batch``."""
    w = decode_inputs(args.attention_batch, args.context, args.page_size, args.dtype, device)
    q4 = w["q"].unsqueeze(2)  # [b, Hq, 1, D]
    calls = {
        "xpu_ops": lambda: xpu_ops.flash_attn_with_kvcache(
            w["q"], w["k_cache"], w["v_cache"], cache_seqlens=w["cache_seqlens"],
            page_table=w["page_table"], cu_seqlens_q=w["cu_seqlens_q"], max_seqlen_q=1,
            causal=True),
        "sdpa": lambda: F.scaled_dot_product_attention(q4, w["k_dense"], w["v_dense"],
                                                       enable_gqa=True),
        "flashinfer": flashinfer_run(w, args.context, args.page_size),
    }
    return {name: None if fn is None else latency_us(fn, device, args.warmup, args.iters)
            for name, fn in calls.items()}


def store_row(args, device: torch.device) -> dict:
    """Table 2: one new token per request into flat caches ``[slots, Hkv, D]``."""
    b, slots = args.attention_batch, 64 * 1024
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(slots, HKV, D, generator=g).to(device, args.dtype)
    v_cache = torch.randn(slots, HKV, D, generator=g).to(device, args.dtype)
    loc = torch.randperm(slots, generator=g)[:b].to(device)
    k = torch.randn(b, HKV, D, generator=g).to(device, args.dtype)
    v = torch.randn(b, HKV, D, generator=g).to(device, args.dtype)
    calls = {
        "xpu_ops": lambda: xpu_ops.store_kv_cache(k_cache, v_cache, loc, k, v),
        "index_copy_ x2": lambda: (k_cache.index_copy_(0, loc, k),
                                   v_cache.index_copy_(0, loc, v)),
    }
    return {name: latency_us(fn, device, args.warmup, args.iters) for name, fn in calls.items()}


def merge_row(args, device: torch.device) -> dict:
    """Table 2b: ``merge_state_v2`` of two decode states ``[b, Hq, D]`` (into given outputs)
    against the same merge in four PyTorch calls (``logaddexp``, two weights, a weighted sum)."""
    g = torch.Generator().manual_seed(2)
    b = args.attention_batch
    v_a, v_b = (torch.randn(b, HQ, D, generator=g).to(device, args.dtype) for _ in range(2))
    s_a, s_b = (torch.randn(b, HQ, generator=g).to(device) for _ in range(2))
    v_out, s_out = torch.empty_like(v_a), torch.empty_like(s_a)

    def torch_merge():
        s = torch.logaddexp(s_a, s_b)
        return ((s_a - s).exp().unsqueeze(-1) * v_a + (s_b - s).exp().unsqueeze(-1) * v_b), s
    calls = {"xpu_ops": lambda: xpu_ops.merge_state_v2(v_a, s_a, v_b, s_b, v_out, s_out),
             "torch (4 ops)": torch_merge}
    return {name: latency_us(fn, device, args.warmup, args.iters) for name, fn in calls.items()}

# The floor rows' empty Triton kernels: the plain decode entry's 15 runtime arguments
# (_paged_attention_plain_kernel: 10 tensors, 5 ints), without and with its 29 constexprs.
if triton is not None:
    @triton.jit
    def _empty_kernel(t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, i0, i1, i2, i3, i4):
        pass

    @triton.jit
    def _empty_kernel_constexprs(
        t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, i0, i1, i2, i3, i4,
        C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
        C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr,
        C8: tl.constexpr, C9: tl.constexpr, C10: tl.constexpr, C11: tl.constexpr,
        C12: tl.constexpr, C13: tl.constexpr, C14: tl.constexpr, C15: tl.constexpr,
        C16: tl.constexpr, C17: tl.constexpr, C18: tl.constexpr, C19: tl.constexpr,
        C20: tl.constexpr, C21: tl.constexpr, C22: tl.constexpr, C23: tl.constexpr,
        C24: tl.constexpr, C25: tl.constexpr, C26: tl.constexpr, C27: tl.constexpr,
        C28: tl.constexpr,
    ):
        pass

# The plain decode entry's constexprs at the H200 row's shape (values as a decode layer binds
# them: 7 strides, scale, softcap, window, split floor, then tiles and flags).
_FLOOR_CONSTEXPRS = (2048, 64, 8192, 512, 64, 2048, 64, 0.125, 0.0, -1, 0, 4, 16, 64, 64, 64,
                     16, 4, 8, 64, 64, False, 4, None, False, True, True, False, False)
_FLOOR_LIBS: list = []  # keeps the floor ops' libraries alive


def _floor_ops(device: torch.device, launch: Optional[Callable[[], object]]):
    """``(empty custom_op, 22-argument no-op op, 22-argument op launching the empty kernel)``
    packets, kernels registered for ``device``'s dispatch key only (once per process)."""
    ns = "xpu_ops_floor"
    if not _FLOOR_LIBS:
        @torch.library.custom_op(f"{ns}::noop", mutates_args=(), device_types=device.type)
        def noop(x: torch.Tensor) -> None:
            return None
        lib = torch.library.Library(ns, "FRAGMENT")
        key = {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU"}[device.type]
        lse = torch.empty(HQ, 0, dtype=torch.float32, device=device)
        schema = str(torch.ops.xpu_ops.flash_attn_with_kvcache.default._schema)
        schema = schema[schema.index("("):]  # the op's own 22 arguments, `out` mutated
        for name, body in (("noop22", None), ("launch22", launch)):
            lib.define(name + schema)

            def kernel(*args, _body=body):
                if _body is not None:
                    _body()
                return lse
            lib.impl(name, kernel, key)
            lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
        _FLOOR_LIBS.extend((noop, lib))
    ops = getattr(torch.ops, ns)
    return ops.noop.default, ops.noop22.default, ops.launch22.default


def floor_rows(args, device: torch.device, sdpa: Optional[dict]) -> dict:
    """Table 3: the public-API floor of one eager decode call (see the module docstring);
    ``sdpa``: table 1's SDPA row, for the ratios."""
    w = decode_inputs(args.attention_batch, args.context, args.page_size, args.dtype, device)
    b, pages = w["page_table"].shape
    q = w["q"]
    lse = torch.empty(HQ, q.shape[0], dtype=torch.float32, device=device)
    part = torch.empty(4 * q.shape[0] * HQ * (D + 1), dtype=torch.float32, device=device)
    counters = torch.zeros(b * HKV, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    tensors = (q, w["k_cache"], w["v_cache"], out, lse, part, counters, w["cache_seqlens"],
               w["page_table"], w["cu_seqlens_q"])
    ints = (pages, q.shape[0], w["k_cache"].shape[0], 1, pages * args.page_size)
    grid = (1, b * HKV, 4)
    launches = {}
    if triton is not None:
        plain, wide = _empty_kernel, _empty_kernel_constexprs
        if device.type == "cpu":  # Triton's interpreter: a smoke test of the rows, no floor
            from xpu_ops.triton._common import _interpreted
            plain, wide = _interpreted(plain.fn), _interpreted(wide.fn)
        launches = {"plain": lambda: plain[grid](*tensors, *ints),
                    "constexprs": lambda: wide[grid](*tensors, *ints, *_FLOOR_CONSTEXPRS)}
    noop1, noop22, launch22 = _floor_ops(device, launches.get("constexprs"))
    op_args = (q, w["k_cache"], w["v_cache"], w["cache_seqlens"], w["page_table"],
               w["cu_seqlens_q"], out, None, None, None, None, None, None, None, 1, D ** -0.5,
               True, -1, 0, 0.0, 0, False)

    def timed(fn):
        return latency_us(fn, device, args.warmup, args.iters)
    rows = {"a": timed(lambda: noop1(q)), "a22": timed(lambda: noop22(*op_args))}
    if launches:
        rows["b"] = timed(launches["plain"])
        rows["b29"] = timed(launches["constexprs"])
        rows["c22"] = timed(lambda: launch22(*op_args))
    rows["sdpa"] = sdpa
    if triton is not None:  # the real entry's count, to see that (b29) still matches it
        from xpu_ops.triton.paged_attention_kernel import _paged_attention_plain_kernel as real
        params = real.params
        rows["plain_entry_args"] = {"runtime": sum(not p.is_constexpr for p in params),
                                    "constexpr": sum(bool(p.is_constexpr) for p in params)}
    return rows


def model_rows(args, on_row: Callable[[list[dict]], object] = lambda rows: None) -> list[dict]:
    """Table 4: eager and ``compile_model`` decode steps (ms), with host ms per step;
    ``on_row(rows)`` after each batch size."""
    if not args.batches:
        return []
    model = build(argparse.Namespace(layers=args.layers, hidden=args.hidden, dtype=args.dtype,
                                     device=str(args.device)))
    rows = []
    for b in args.batches:
        ids, fb = decode_batch(model, b, args.context)
        row = {"batch": b}
        for mode in ("eager", "compiled"):
            torch._dynamo.reset()
            forward = make_forward(model, mode)
            step, host = step_seconds(paged_step(forward, ids, fb), fb.device, args.model_warmup,
                                      args.steps)
            row[mode], row[f"{mode}_host"] = step * 1e3, host * 1e3
        rows.append(row)
        on_row(rows)
        print(f"b={b}: eager {row['eager']:.2f} ms (host {row['eager_host']:.2f}), "
              f"compile_model {row['compiled']:.2f} ms (host {row['compiled_host']:.2f})",
              flush=True)
    return rows


def _ratio(a: Optional[dict], b: Optional[dict]) -> str:
    return "missing" if a is None or b is None else f"{a['us'] / b['us']:.2f}x"


def _us(x: Optional[dict]) -> str:
    return ("missing (not importable here) | missing" if x is None
            else f"{x['us']:.1f} | {x['host_us']:.1f}")


def floor_report(floor: dict) -> list[str]:
    """Table 3's lines: the rows, then the sums against SDPA's call and the 1.25x target."""
    sdpa = floor.get("sdpa")
    labels = {
        "a": "(a) empty torch.library.custom_op, 1 tensor, no-op device kernel",
        "a22": "(a22) no-op kernel, flash_attn_with_kvcache's 22-argument schema "
               "(Library.impl at the device key, as define_op)",
        "b": "(b) empty Triton kernel, kernel[grid](...), 15 runtime args (10 tensors, 5 ints)",
        "b29": "(b29) the same + the plain entry's 29 constexprs",
        "c22": "(c22) the 22-argument op whose kernel launches (b29), one call",
    }
    out = ["", "Floor of one eager decode call under public APIs (same timing; SDPA: table 1):",
           "", "| call | us | host us | it / SDPA |", "|---|---:|---:|---:|"]
    for key, label in labels.items():
        if key in floor:
            out.append(f"| {label} | {_us(floor[key])} | {_ratio(floor[key], sdpa)} |")
        else:
            out.append(f"| {label} | missing (triton does not import) | missing | missing |")
    if "plain_entry_args" in floor:
        counts = floor["plain_entry_args"]
        out.append(f"\n_paged_attention_plain_kernel now: {counts['runtime']} runtime, "
                   f"{counts['constexpr']} constexpr arguments.")
    if sdpa is None or "b" not in floor:
        return out
    target = 1.25 * sdpa["us"]
    out.append("")
    for name, a, b in (("(a) host + (b)", "a", "b"), ("(a22) host + (b29)", "a22", "b29")):
        total = floor[a]["host_us"] + floor[b]["us"]
        verdict = "within" if total <= target else "above"
        out.append(f"- {name}: {total:.1f} us = {total / sdpa['us']:.2f}x SDPA's "
                   f"{sdpa['us']:.1f} us; {verdict} the 1.25x target ({target:.1f} us).")
    return out


def report(args, attention: dict, store: dict, merge: dict, models: list[dict],
           floor: Optional[dict] = None) -> str:
    """The Markdown tables."""
    name = (torch.cuda.get_device_name(args.device) if args.device.type == "cuda"
            else platform.processor() or args.device.type)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    b = args.attention_batch
    out = [f"# bench_op_call: {name}, torch {torch.__version__}, Triton {triton_version}, "
           f"{args.dtype}, {torch.get_num_threads()} CPU threads, provider of "
           f"flash_attn_with_kvcache: {_provider(args.device)}\n",
           f"Decode b={b}, context {args.context}, page {args.page_size}, Hq {HQ}, Hkv {HKV}, "
           f"D {D}; median us per call + sync over {args.iters} calls (host: until the call "
           "returns).\n",
           "| call | us | host us | xpu_ops / it |", "|---|---:|---:|---:|"]
    for peer in ("xpu_ops", "sdpa", "flashinfer"):
        label = {"xpu_ops": "xpu_ops.flash_attn_with_kvcache", "sdpa": "torch SDPA (contiguous "
                 "K/V)", "flashinfer": "FlashInfer BatchDecodeWithPagedKVCacheWrapper.run"}[peer]
        out.append(f"| {label} | {_us(attention[peer])} | "
                   f"{_ratio(attention['xpu_ops'], attention[peer])} |")
    out += ["", f"store_kv_cache, {b} token(s) into [65536, {HKV}, {D}]:", "",
            "| call | us | host us | xpu_ops / it |", "|---|---:|---:|---:|"]
    for peer, us in store.items():
        out.append(f"| {peer} | {_us(us)} | {_ratio(store['xpu_ops'], us)} |")
    out += ["", f"merge_state_v2, [{b}, {HQ}, {D}] states into given outputs:", "",
            "| call | us | host us | xpu_ops / it |", "|---|---:|---:|---:|"]
    for peer, us in merge.items():
        out.append(f"| {peer} | {_us(us)} | {_ratio(merge['xpu_ops'], us)} |")
    if floor:
        out += floor_report(floor)
    if models:
        out += ["", f"Decode step, {args.layers} layers, hidden {args.hidden or 2048}, context "
                f"{args.context} (ms per step, median of {args.steps}; host: until forward "
                "returns):", "",
                "| batch | eager ms | eager host ms | compile_model ms | compile_model host ms "
                "| compile_model / eager |", "|---:|---:|---:|---:|---:|---:|"]
        for r in models:
            out.append(f"| {r['batch']} | {r['eager']:.2f} | {r['eager_host']:.2f} | "
                       f"{r['compiled']:.2f} | {r['compiled_host']:.2f} | "
                       f"{r['compiled'] / r['eager']:.2f} |")
    return "\n".join(out) + "\n"


def _provider(device: torch.device) -> str:
    from xpu_ops.__main__ import describe_choice
    from xpu_ops import providers
    return describe_choice("flash_attn_with_kvcache", device.type,
                           providers.forced_provider()).split()[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=str(dev.as_device()))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=1024, help="cached tokens per request")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--attention-batch", type=int, default=1, help="b of tables 1 and 2")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=0, help="shrink the model (CPU runs)")
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64],
                   help="batch sizes of table 3 (none: skip it)")
    p.add_argument("--model-warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help="skip table 3 (the public-API floor rows)")
    p.add_argument("--out-dir", default=None,
                   help="write bench_op_call.md and bench_op_call.json into this directory")
    args = p.parse_args(argv)
    args.device, args.dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    with torch.inference_mode():
        attention = attention_row(args, args.device)
        store = store_row(args, args.device)
        merge = merge_row(args, args.device)
        floor = floor_rows(args, args.device, attention["sdpa"]) if args.floor else None
    write(args, attention, store, merge, [], floor)  # each table is written when it is done
    models = model_rows(args, lambda rows: write(args, attention, store, merge, rows, floor))
    print(write(args, attention, store, merge, models, floor))


def write(args, attention: dict, store: dict, merge: dict, models: list[dict],
          floor: Optional[dict] = None) -> str:
    """The report; also ``bench_op_call.md`` and ``.json`` under ``--out-dir`` when given."""
    text = report(args, attention, store, merge, models, floor)
    if args.out_dir:
        out = Path(args.out_dir) / "bench_op_call"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(text)
        out.with_suffix(".json").write_text(json.dumps(
            {"attention_us": attention, "store_us": store, "merge_us": merge, "floor_us": floor,
             "model_ms": models,
             "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    return text


if __name__ == "__main__":
    main()
