"""Decode throughput of a 1B-class Llama (random weights) in five modes, a dense-cache peer and
the memory roofline, plus compile times.

Modes: ``eager`` (the model as written), ``compiled`` (``compile.graphs.compiled_model.compile_model(
model, fullgraph=True)``: ``torch.compile``, Inductor, no graphs), ``piecewise``
(``compile.graphs.piecewise.PiecewiseModel``: Inductor pieces, device graph per token bucket,
attention eager between them), ``graphs`` (the serving path, ``python -m compile --mode graphs``:
``compile.graphs.graph_runner.full_and_piecewise``; the decode steps timed here replay whole-step
graphs recorded through the piecewise model), ``graphs_compiled`` (the same whole-step decode
graphs recorded through ``compile_model`` instead: the earlier ``--mode graphs``,
kept for the A/B), ``graphs_addmm`` (``graphs`` with the pieces compiled the earlier way:
Inductor's residual ``addmm`` kept, ``full_and_piecewise(model, unfuse_addmm=False)``; the A/B of
``compile/graphs/inductor_passes.py``).
Peer: ``dense`` (``dense_baseline.DenseLlama``: the same weights in a gpt-fast-style model with a
static ``[b, Hkv, max_len, D]`` cache, SDPA under a mask of the valid positions, compiled with
``torch.compile(mode="reduce-overhead", fullgraph=True)``), timed in the same process.
Roofline: ``b`` tokens per (weights + KV bytes of one step) / (device copy bandwidth measured at
the start of the run), ``decode_roofline``; each mode is also reported as a fraction of it.

Throughput: decode tokens/s = b / median step time (steps after warm-up, device synchronised;
the host plan, the metadata build, is inside the timed step, as in serving; the builds per step
are counted and reported). Every step decodes one token per request at a cache length of
``--context`` tokens.
Extend and mixed steps (``--steps-tokens``, ``--step-modes``): ms per step of ``T`` new tokens,
4 requests extending ``T / 4`` tokens each, or one ``T - 7``-token prefill chunk beside 7 decoding
requests (MIXED), over ``--context`` cached tokens per request (``paged_batches.py``).
Compile time: first compiled call with an empty Inductor cache (cold) and again in the same
process after ``torch._dynamo.reset()`` with the cache filled (warm), through
``compile_model(model, fullgraph=True)`` (every layer traced and compiled).
Host time: per step, until ``forward`` returns (before the device sync).

    python benchmarks/bench_model.py --device cuda              # the H200 table and plot
    python benchmarks/bench_model.py --device cpu --quick       # CPU check: 2 tiny layers
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch._dynamo.utils import counters

from compile.graphs import device as dev
from compile.engine.cli_args import DTYPES, CliParser, non_negative_int, positive_int
from compile.engine.cli_models import pick_device
from compile.batch import ForwardBatch, ForwardMode
from compile.graphs import GraphRunner, PiecewiseModel, compile_model, full_and_piecewise
from compile.models import LlamaForCausalLM, ModelConfig
from compile.graphs.split_op import enable_split_op
from bench_model_report import write_results
from decode_roofline import copy_bandwidth, roofline_tokens_per_s
from dense_baseline import GQA_LAYOUTS, DenseLlama, compile_dense
from paged_batches import paged_batch, step_lens

RESULTS = Path(__file__).parent / "results"
# Llama-3.2-1B shapes
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192)
MODES = ("eager", "compiled", "piecewise", "graphs", "graphs_compiled",
         "graphs_addmm")  # this project's
PEERS = ("dense",)
# --quick: what the flags become (a CPU check of every mode in about a minute)
QUICK = dict(layers=2, hidden=128, context=32, batches=[1, 4], warmup=1, steps=3,
             compile_layers=0, steps_tokens=[16])


def build(args):
    cfg = dict(LLAMA_1B, num_hidden_layers=args.layers)
    if args.hidden:
        cfg.update(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                   head_dim=args.hidden // 32, vocab_size=32000)
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig(**cfg), dtype=args.dtype, device=args.device).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model


def paged_decode_batch(b: int, context: int, *, num_heads: int, num_kv_heads: int,
                       head_dim: int, num_layers: int, dtype: torch.dtype, device,
                       page_size: int = 16) -> ForwardBatch:
    """Pools, backend and one DECODE ``ForwardBatch`` of ``b`` requests, each with ``context``
    cached tokens plus the one being decoded (metadata not yet initialised)."""
    return paged_batch([1] * b, context, ForwardMode.DECODE, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, num_layers=num_layers,
                       dtype=dtype, device=device, page_size=page_size)


def decode_batch(model, b: int, context: int, page_size: int = 16):
    """``(input_ids [b], forward_batch)``: a DECODE batch for ``model`` (``paged_decode_batch``
    with the model's shapes)."""
    cfg, param = model.config, next(model.parameters())
    fb = paged_decode_batch(b, context, num_heads=cfg.num_attention_heads,
                            num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                            num_layers=cfg.num_hidden_layers, dtype=param.dtype,
                            device=param.device, page_size=page_size)
    ids = torch.randint(0, cfg.vocab_size, (b,), device=param.device)
    return ids, fb


def make_forward(model, mode: str):
    """The forward of ``mode`` over ``model``. It switches the model's attention layers to the
    split op (piecewise modes) or back (the others), so a forward made earlier over the same
    model must not run after it (a ``PiecewiseModel`` raises ``RuntimeError``)."""
    enable_split_op(model, False)  # PiecewiseModel switches the layers back on for itself
    if mode == "eager":
        return model
    if mode == "compiled":
        return compile_model(model, fullgraph=True)
    if mode == "piecewise":
        return PiecewiseModel(model)
    if mode == "graphs":
        return full_and_piecewise(model)
    if mode == "graphs_addmm":
        return full_and_piecewise(model, unfuse_addmm=False)
    if mode == "graphs_compiled":
        return GraphRunner(model, forward=compile_model(model, fullgraph=True))
    raise ValueError(f"bench_model: mode {mode!r} is unknown; expected one of {MODES}.")


def paged_step(forward, ids, fb) -> Callable[[], object]:
    """One step of this project's model as the engine runs it: the host plan (unless
    ``forward`` builds it itself: ``builds_metadata``, the graph runner), then ``forward``."""
    builds = getattr(forward, "builds_metadata", False)

    def step():
        if not builds:
            fb.attn_backend.init_forward_metadata(fb)
        return forward(ids, fb.positions, fb)
    return step


def dense_step(model, b: int, context: int, gqa: str,
               compile_mode: str | None = "reduce-overhead") -> Callable[[], object]:
    """One decode step of the dense peer of ``model`` compiled with ``compile_mode``: ``b``
    requests, the token at position ``context`` (cache of ``context + 1`` positions, the same
    K/V bytes as the paged step)."""
    dense = compile_dense(DenseLlama.from_paged(model, b, context + 1, gqa), compile_mode)
    device = next(model.parameters()).device
    idx = torch.randint(0, model.config.vocab_size, (b, 1), device=device)
    input_pos = torch.tensor([context], device=device)

    def step():
        torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are not read
        return dense(idx, input_pos)
    return step


def step_times(step, device, warmup: int, steps: int) -> dict:
    """Median seconds of ``step()`` over ``steps`` calls after ``warmup``, each started with the
    device idle: ``step`` until the device finishes, ``host`` until ``step`` returns (launches
    are asynchronous on GPUs, so ``host`` close to ``step`` means the step is bound by host
    work), ``cpu`` the calling thread's CPU time over the ``host`` interval (time the thread
    was descheduled excluded)."""
    times, host, cpu = [], [], []
    with torch.inference_mode():
        for i in range(warmup + steps):
            dev.synchronize(device)
            c0, t0 = time.thread_time(), time.perf_counter()
            step()
            t1, c1 = time.perf_counter(), time.thread_time()
            dev.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                host.append(t1 - t0)
                cpu.append(c1 - c0)
    return dict(step=statistics.median(times), host=statistics.median(host),
                cpu=statistics.median(cpu))


def step_seconds(step, device, warmup: int, steps: int) -> tuple[float, float]:
    """Median ``(step, host)`` seconds of ``step()`` (``step_times``)."""
    t = step_times(step, device, warmup, steps)
    return t["step"], t["host"]


def compile_times(model, ids, fb) -> tuple[float, float]:
    """(cold, warm) seconds of the first compiled call, fresh cache then filled cache, through
    ``compile_model(model, fullgraph=True)``."""
    out = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        for _ in range(2):
            torch._dynamo.reset()
            compiled = compile_model(model, fullgraph=True)
            fb.attn_backend.init_forward_metadata(fb)
            t0 = time.perf_counter()
            with torch.inference_mode():
                compiled(ids, fb.positions, fb)
            dev.synchronize(fb.device)
            out.append(time.perf_counter() - t0)
    return out[0], out[1]


def hidden_size(text: str) -> int:
    """argparse type: 0 (the 1B shape) or a multiple of 64 (32 heads of ``hidden // 32``
    features, an even number for the rotary embedding)."""
    value = non_negative_int(text)
    if value % 64:
        raise argparse.ArgumentTypeError(f"expected 0 or a multiple of 64, got {value}")
    return value


def build_parser(prog=None) -> argparse.ArgumentParser:
    """bench_model's options; errors are one line on stderr, exit status 2 (``CliParser``)."""
    ap = CliParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=str(dev.as_device()), choices=("cpu", "cuda", "xpu"))
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    ap.add_argument("--layers", type=positive_int, default=16)
    ap.add_argument("--hidden", type=hidden_size, default=0,
                    help="shrink the model (smoke runs): 0 or a multiple of 64")
    ap.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--modes", nargs="+", choices=MODES + PEERS, default=list(MODES + PEERS),
                    metavar="MODE", help=f"any of {', '.join(MODES + PEERS)}")
    ap.add_argument("--dense-gqa", choices=GQA_LAYOUTS, default="pack",
                    help="the dense peer's GQA: pack (query heads as rows, K/V read once) or "
                         "repeat (gpt-fast's repeat_interleave of K/V)")
    ap.add_argument("--copy-mib", type=positive_int, default=0,
                    help="MiB per side of the copy that measures the roofline's bandwidth "
                         "(default: 2048 on a GPU, 64 on the CPU)")
    ap.add_argument("--quick", action="store_true",
                    help="CPU check: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                   for k, v in QUICK.items()))
    ap.add_argument("--steps-tokens", type=positive_int, nargs="*", default=[16, 64, 256, 1024],
                    metavar="T", help="tokens of the extend and mixed steps timed after the "
                    "decode table (none: skip them); mixed steps need T >= 8")
    ap.add_argument("--step-modes", nargs="+", choices=("compiled", "piecewise", "graphs"),
                    default=None, metavar="MODE",
                    help="modes of the extend/mixed table: compiled, piecewise, graphs "
                         "(default: compiled and graphs, those of them in --modes)")
    ap.add_argument("--context", type=positive_int, default=1024)
    ap.add_argument("--warmup", type=non_negative_int, default=5)
    ap.add_argument("--steps", type=positive_int, default=30)
    ap.add_argument("--rounds", type=positive_int, default=1,
                    help="measure each (mode, batch) this many times, report the fastest")
    ap.add_argument("--compile-layers", type=non_negative_int, default=30,
                    help="layers of the model whose compile time is measured (0: skip)")
    ap.add_argument("--compile-only", action="store_true",
                    help="skip the decode table, measure only the compile times (printed, no "
                         "result files; repeat in fresh processes: a second cold compile in "
                         "one process reuses Inductor's in-memory code caches)")
    ap.add_argument("--out", default=str(RESULTS / "bench_model"))
    return ap


def parse_args(argv=None, prog=None) -> argparse.Namespace:
    """Parsed and checked options (``args.dtype`` a ``torch.dtype``); a bad value or an
    unavailable ``--device`` exits with one line on stderr, status 2."""
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    args.copy_mib = args.copy_mib or (64 if args.device == "cpu" else 2048)
    try:
        pick_device(args.device)
    except RuntimeError as e:
        ap.error(str(e))
    if args.context >= LLAMA_1B["max_position_embeddings"]:  # the decoded token is at --context
        ap.error(f"argument --context: expected at most "
                 f"{LLAMA_1B['max_position_embeddings'] - 1} (max_position_embeddings - 1), "
                 f"got {args.context}")
    args.dtype = getattr(torch, args.dtype)
    if args.step_modes is None:
        args.step_modes = [m for m in ("compiled", "graphs") if m in args.modes]
    return args


def main(argv=None, prog=None):
    """Parse ``argv`` (default ``sys.argv[1:]``; ``prog`` names the command in errors), run the
    table, write results."""
    args = parse_args(argv, prog)
    if args.compile_only:
        args.batches = []
    model = build(args) if args.batches else None
    bandwidth = copy_bandwidth(args.device, args.copy_mib << 20) if args.batches else None
    if bandwidth:
        print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s", flush=True)
    rows = [decode_row(model, b, args, bandwidth) for b in args.batches]
    if rows and not args.compile_only:  # the decode table on disk before the slower parts
        write_results(args, rows, None, bandwidth)
    steps = step_rows(model, args) if args.batches and args.step_modes else []
    compile_s = None
    if args.compile_layers:
        cargs = argparse.Namespace(**{**vars(args), "layers": args.compile_layers})
        big = build(cargs)
        compile_s = {"compile_model": compile_times(big, *decode_batch(big, 8, 64))}
        print(f"compile {args.compile_layers} layers (compile_model): cold "
              f"{compile_s['compile_model'][0]:.1f} s, warm {compile_s['compile_model'][1]:.1f} s "
              f"(load average {os.getloadavg()[0]:.2f})", flush=True)
    if args.compile_only:  # no decode table: the figures are printed above, no result files
        return
    write_results(args, rows, compile_s, bandwidth, steps)


def device_allocations(device) -> int | None:
    """Device memory allocation and free calls made so far by the caching allocator (CUDA's
    ``num_device_alloc + num_device_free``; None elsewhere): a step that makes any pays their
    host time, which a warm allocator avoids."""
    if torch.device(device).type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return stats.get("num_device_alloc", 0) + stats.get("num_device_free", 0)


def counting_builds(backend) -> list:
    """Count ``backend.build_metadata`` calls (one per metadata build) into the returned list."""
    builds, build = [], backend.build_metadata

    def counted(fb, graph=False):
        builds.append(1)
        return build(fb, graph)
    backend.build_metadata = counted
    return builds


def step_batch(model, kind: str, tokens: int, context: int):
    """``(input_ids [tokens], forward_batch)`` of an EXTEND or MIXED step
    (``paged_batches.step_lens``) over ``context`` cached tokens per request."""
    cfg, param = model.config, next(model.parameters())
    mode = ForwardMode.EXTEND if kind == "extend" else ForwardMode.MIXED
    fb = paged_batch(step_lens(kind, tokens), context, mode,
                     num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                     head_dim=cfg.head_dim, num_layers=cfg.num_hidden_layers,
                     dtype=param.dtype, device=param.device)
    return torch.randint(0, cfg.vocab_size, (tokens,), device=param.device), fb


def step_rows(model, args) -> list[dict]:
    """``{"step": kind, "tokens": T, mode: tokens/s, f"{mode}_ms": ms}`` per extend and mixed
    step of ``--steps-tokens`` (mixed: T >= 8), for every mode of ``--step-modes``. Each mode
    is compiled once and then runs every step size, as in serving (``graphs``: pieces captured
    per token bucket; ``compiled``: ``compile_model``, dynamic after its first recompile)."""
    sizes = [(kind, t) for kind in ("extend", "mixed") for t in args.steps_tokens
             if kind == "extend" or t >= 8]
    rows = [{"step": kind, "tokens": t} for kind, t in sizes]
    for name in args.step_modes:
        torch._dynamo.reset()
        forward = make_forward(model, name)
        for row in rows:
            ids, fb = step_batch(model, row["step"], row["tokens"], args.context)
            seconds, _ = min(step_seconds(paged_step(forward, ids, fb), fb.device, args.warmup,
                                          args.steps) for _ in range(args.rounds))
            row[name], row[f"{name}_ms"] = row["tokens"] / seconds, seconds * 1e3
            print(f"{row['step']} T={row['tokens']} {name}: {seconds * 1e3:.2f} ms "
                  f"({row[name]:.0f} tok/s)", flush=True)
    return rows


def decode_row(model, b: int, args, bandwidth: float) -> dict:
    """``{"batch": b, mode: tokens/s, f"{mode}_host_ms": ..., "roofline": tokens/s}`` for every
    mode of ``--modes`` at batch ``b``, each freshly compiled."""
    ids, fb = decode_batch(model, b, args.context)
    row = {"batch": b, "roofline": roofline_tokens_per_s(model, b, args.context, bandwidth)}
    for mode in args.modes:
        torch._dynamo.reset()
        skips = counters["inductor"]["cudagraph_skips"]
        builds = counting_builds(fb.attn_backend)
        step = (dense_step(model, b, args.context, args.dense_gqa) if mode == "dense"
                else paged_step(make_forward(model, mode), ids, fb))
        # Best of --rounds medians: the GPU machine's host speed drifts within a run, and a
        # host-bound mode (eager, compiled, piecewise) would otherwise carry that drift.
        allocs = device_allocations(fb.device)
        seconds, host = min(step_seconds(step, fb.device, args.warmup, args.steps)
                            for _ in range(args.rounds))
        if allocs is not None:  # device malloc/free calls per step (host time, not in kernels)
            row[f"{mode}_device_allocs"] = ((device_allocations(fb.device) - allocs)
                                            / ((args.warmup + args.steps) * args.rounds))
        row[mode], row[f"{mode}_host_ms"] = b / seconds, host * 1e3
        if mode != "dense":  # metadata builds per step (expected: one)
            row[f"{mode}_builds"] = len(builds) / ((args.warmup + args.steps) * args.rounds)
        if mode == "dense" and fb.device.type != "cpu":  # Inductor skips graphs silently
            row["dense_graph_skips"] = counters["inductor"]["cudagraph_skips"] - skips
            if row["dense_graph_skips"]:
                print(f"b={b} dense: WARNING: Inductor did not capture the step as a device "
                      "graph (counters['inductor']['cudagraph_skips']); its figure has none")
        builds_line = (f", {row[f'{mode}_builds']:g} metadata builds/step"
                       if mode != "dense" else "")
        if f"{mode}_device_allocs" in row:
            builds_line += f", {row[f'{mode}_device_allocs']:g} device mallocs+frees/step"
        print(f"b={b} {mode}: {row[mode]:.1f} tok/s (step {seconds * 1e3:.2f} ms, host "
              f"{host * 1e3:.2f} ms, {row[mode] / row['roofline']:.2f} of the roofline"
              f"{builds_line})", flush=True)
    return row


if __name__ == "__main__":
    main()
