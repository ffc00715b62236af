"""Decode of a DeepSeek-V3.2-shaped model: sparse MLA (DSA, the indexer's top-k) against the
same model with dense MLA, whole-step graphs.

Two zoo models with random weights and DeepSeek-V3.2's attention shapes (hidden 7168, 128 heads,
q LoRA 1536, latent R 512 + rope r 64, nope 128, v 128; indexer 64 heads of 128, top-k 2048),
``--layers`` layers with dense MLPs of ``--intermediate`` (the MoE is left out: this compares
attention): ``DeepseekV32ForCausalLM`` on a ``DSATokenToKVPool`` with the
``DSAAttentionBackend`` (``sparse``) and ``DeepseekV2ForCausalLM`` of the same shapes on an MLA
pool with ``XPUAttentionBackend`` (``dense``: ``flash_mla_decode``, split-KV, over every key);
``sparse_fp8`` is ``sparse`` over an fp8 latent cache (FlashMLA's 656-byte tokens).
One cache per model holds ``max(--batches)`` requests of ``--context`` random tokens each
(latent rows and fp8 index keys written directly on the device, no prefill); a batch of ``b``
decodes one token for each of its first ``b`` requests at that length, so one forward (one
compilation, one graph runner with a whole-step graph per batch bucket) serves every ``b``.

Per model, mode and ``b``: median ms per step (``bench_model.step_seconds``: warm-up excluded,
device synchronised, host plan inside the step), tokens/s, the seconds of the first step
(Dynamo, Inductor, Triton JIT, warm-up; the capture is the second), the graph breaks Dynamo
counted while the mode ran (0 expected: the compiled modes trace with ``fullgraph=True``, so a
break would also stop the run), the whole-step graph replays so far (0 where the device has no
graphs; in graphs mode on a GPU, proof that the timed steps replayed a captured graph), and
the bytes the step must read at least (``step_bytes``: weights, and the cache rows attended:
``min(context + 1, topk)`` latent rows plus every index key for sparse, every latent row for
dense), as a fraction of the device's copy bandwidth measured in the same process.
``--models`` picks the models, so each can run in its own process under a time limit; with
``--out`` each run writes ``dsa_decode_<model>.json`` (after each model) and rewrites
``dsa_decode.md`` from every model's file in that folder, with each sparse model's ratios to
dense (``make_results_page.py`` shows it as the ``dsa`` part).

    python benchmarks/bench_dsa_decode.py --device cuda                 # 8k context, graphs
    python benchmarks/bench_dsa_decode.py --device cuda --models dense --out $OUT/dsa
    python benchmarks/bench_dsa_decode.py --device cuda --models sparse --profile-batches 1 \\
        --out $OUT/dsa                              # also the kernels of a b = 1 step
    python benchmarks/bench_dsa_decode.py --device cpu --quick          # CPU check, tiny
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch._dynamo.utils import counters

import xpu_ops
from compile.backend import XPUAttentionBackend
from compile.backend.dsa_backend import DSAAttentionBackend
from compile.batch import (DSATokenToKVPool, ForwardBatch, ForwardMode, MLATokenToKVPool,
                           PageAllocator, ReqToTokenPool)
from compile.graphs import device as dev
from compile.engine.cli_args import DTYPES, CliParser, non_negative_int, positive_int
from compile.engine.model_runner import ModelRunnerInfo
from compile.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from compile.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM
from bench_model import make_forward, paged_step, step_seconds
from decode_roofline import copy_bandwidth
from profile_decode import kernel_times, markdown as kernel_markdown, profile_rows
from xpu_ops.mla_fp8_layout import fp8_token_bytes

MODELS = ("sparse", "sparse_fp8", "dense")
V32_SHAPES = dict(vocab_size=129280, hidden_size=7168, num_attention_heads=128,
                  q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                  qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840)
INDEXER = dict(index_n_heads=64, index_head_dim=128)
QUICK = dict(layers=2, context=40, topk=16, batches=[1, 2], intermediate=64, warmup=1,
             steps=2)
QUICK_SHAPES = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, q_lora_rank=32,
                    kv_lora_rank=128, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                    max_position_embeddings=256)
QUICK_INDEXER = dict(index_n_heads=4, index_head_dim=32)


def build(args, sparse: bool):
    """The ``sparse`` (V3.2, DSA) or dense-MLA model, random N(0, 0.02) weights."""
    shapes = QUICK_SHAPES if args.quick else V32_SHAPES
    common = dict(shapes, num_hidden_layers=args.layers, intermediate_size=args.intermediate)
    if sparse:
        cfg = DeepseekV32Config(**common, **(QUICK_INDEXER if args.quick else INDEXER),
                                index_topk=args.topk)
        model_class = DeepseekV32ForCausalLM
    else:
        cfg, model_class = DeepseekV2Config(**common), DeepseekV2ForCausalLM
    torch.manual_seed(0)
    model = model_class(cfg, dtype=args.dtype, device=args.device).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.02)
    return model


def decode_cache(model, max_b: int, context: int, page_size: int,
                 fp8: bool = False) -> SimpleNamespace:
    """Pools and one attention backend for ``max_b`` requests of ``context`` random cached
    tokens each (latent rows, and fp8 index keys for a DSA model, written directly on the
    device; ``fp8``: a DSA latent cache of FlashMLA fp8 tokens), decoding at position
    ``context``. Every batch size shares it (``decode_batch``), so one graph runner serves
    them all: a runner keeps the backend of its first step."""
    cfg, param = model.config, next(model.parameters())
    device, dtype = param.device, param.dtype
    rank, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    pages = -(-(context + 1) // page_size)
    num_pages = max_b * pages + 1
    req_pool = ReqToTokenPool(max_b, pages * page_size, device)
    args = (num_pages * page_size, page_size, torch.float8_e4m3fn if fp8 else dtype, rank, rope,
            cfg.num_hidden_layers, device)
    sparse = hasattr(cfg, "index_head_dim")
    pool = (DSATokenToKVPool(*args, index_head_dim=cfg.index_head_dim) if sparse
            else MLATokenToKVPool(*args))
    alloc = PageAllocator(num_pages, page_size, device)
    loc = torch.cat([alloc.alloc_extend(req_pool, r, 0, context + 1)[-1:]
                     for r in range(max_b)])
    gen = torch.Generator(device=device).manual_seed(1)
    slots = torch.arange(page_size, num_pages * page_size, device=device)
    for layer in range(cfg.num_hidden_layers):
        rows = torch.randn(num_pages * page_size, 1, rank + rope, generator=gen, device=device,
                           dtype=dtype)
        pool.set_mla_kv_buffer(layer, torch.arange(rows.shape[0], device=device),
                               rows[..., :rank], rows[..., rank:])
        if sparse:
            keys = torch.randn(slots.shape[0], cfg.index_head_dim, generator=gen, device=device,
                               dtype=dtype)
            xpu_ops.store_index_k_cache(pool.get_index_k_with_scale_buffer(layer), slots, keys)
    runner = ModelRunnerInfo(
        model_config=SimpleNamespace(context_len=pages * page_size,
                                     num_attention_heads=cfg.num_attention_heads,
                                     index_topk=getattr(cfg, "index_topk", None)),
        tp_size=1, device=device, page_size=page_size, req_to_token_pool=req_pool,
        token_to_kv_pool=pool, kv_cache_dtype=pool.dtype)
    backend = (DSAAttentionBackend if sparse else XPUAttentionBackend)(runner)
    return SimpleNamespace(pool=pool, req_pool=req_pool, backend=backend, loc=loc,
                           context=context, vocab=cfg.vocab_size, device=device)


def decode_batch(cache: SimpleNamespace, b: int):
    """``(input_ids [b], ForwardBatch)``: the first ``b`` requests of ``cache`` decoding one
    token each."""
    device, context = cache.device, cache.context
    seq_lens = torch.full((b,), context + 1, dtype=torch.int32)
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=b,
                      req_pool_indices=torch.arange(b, device=device),
                      seq_lens=seq_lens.to(device), seq_lens_cpu=seq_lens,
                      out_cache_loc=cache.loc[:b].clone(),
                      positions=torch.full((b,), context, device=device))
    fb.attn_backend, fb.token_to_kv_pool = cache.backend, cache.pool
    fb.req_to_token_pool = cache.req_pool
    ids = torch.randint(0, cache.vocab, (b,), device=device)
    return ids, fb


def step_bytes(model, b: int, context: int, fp8: bool = False) -> dict:
    """Bytes one decode step must read at least, ``{"weights", "cache"}``: every weight once
    but the embedding table (``b`` rows of it), and per layer and request the cache rows
    attended: ``min(context + 1, topk)`` latent rows and every fp8 index key (``Di + 4`` bytes:
    the indexer scores all keys) for sparse MLA, all ``context + 1`` latent rows for dense;
    a latent row is ``R + r`` values, or with ``fp8`` FlashMLA's fp8 token bytes. Logits and
    top-k scratch are not counted (a fused indexer need not store them)."""
    cfg = model.config
    size = next(model.parameters()).element_size()
    embed = model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += (b - embed.shape[0]) * embed.shape[1] * embed.element_size()
    keys = context + 1
    dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    row = fp8_token_bytes(dim, cfg.kv_lora_rank) if fp8 else dim * size
    topk = getattr(cfg, "index_topk", None)
    per_layer = row * min(keys, topk) + keys * (cfg.index_head_dim + 4) if topk else row * keys
    return dict(weights=weights, cache=b * cfg.num_hidden_layers * per_layer)


def timed_rows(model, name: str, mode: str, cache, args, bandwidth: float,
               done=None) -> list[dict]:
    """One row per batch size of ``model`` in ``mode``: one forward (so one compilation and
    one graph runner) over every batch size; its first step (tracing, compilation, Triton
    JIT, warm-up) timed apart; graph breaks counted by Dynamo over the mode so far (every
    row ends with the count of the whole mode). ``done(rows of this mode so far)`` after each
    row, so a run cut by a time limit keeps the batch sizes it finished."""
    breaks0 = sum(counters["graph_break"].values())
    forward = make_forward(model, mode)
    out = []
    for b in args.batches:
        ids, fb = decode_batch(cache, b)
        step = paged_step(forward, ids, fb)
        t0 = time.perf_counter()
        with torch.inference_mode():
            step()
        dev.synchronize(args.device)
        first = time.perf_counter() - t0
        sec, host = step_seconds(step, args.device, max(args.warmup - 1, 0), args.steps)
        if b in args.profile_batches and args.out:
            write_profile(Path(args.out), f"{name} {mode} b={b}", step, args, sec)
        nbytes = step_bytes(model, b, args.context, fp8=name == "sparse_fp8")
        out.append(dict(model=name, mode=mode, b=b, ms=sec * 1e3, host_ms=host * 1e3,
                        tokens_per_s=b / sec, first_step_s=first,
                        weight_bytes=nbytes["weights"], cache_bytes=nbytes["cache"],
                        bandwidth_fraction=sum(nbytes.values()) / bandwidth / sec,
                        copy_gbps=round(bandwidth / 1e9),
                        graph_replays=getattr(forward, "replays", 0)))
        breaks = sum(counters["graph_break"].values()) - breaks0
        for row in out:
            row["graph_breaks"] = breaks
        print(json.dumps(out[-1]), flush=True)
        if done is not None:
            done(out)
    return out


def write_profile(out: Path, label: str, step, args, seconds: float) -> None:
    """The kernels of ``args.profile_steps`` more steps under the profiler (replays of the
    captured graph in graphs mode), slowest first, as ``profile_<label>.md`` in ``out``."""
    steps = args.profile_steps
    rows_ = profile_rows(kernel_times(step, args.device, steps), {}, steps, 1.0)
    kernel_us = sum(r["us"] for r in rows_)
    head = (f"#### Kernels of one {label} step ({args.device}, {args.layers} layers, context "
            f"{args.context}, top-k {args.topk})\n\nStep {seconds * 1e6:.0f} us (median of the "
            f"timed steps); kernels {kernel_us:.0f} us per step, "
            f"{sum(r['calls'] for r in rows_):.0f} launches; {steps} profiled steps.")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{label.replace(' ', '_').replace('=', '')}.md").write_text(
        kernel_markdown(rows_, head))


def rows(args, bandwidth: float, done=None) -> list[dict]:
    """Every model's rows; ``done(rows so far)`` after each row (so a run cut by a time
    limit keeps the rows it finished)."""
    out = []
    for name in args.models:
        t0 = time.perf_counter()
        model = build(args, name != "dense")
        cache = decode_cache(model, max(args.batches), args.context, args.page_size,
                             fp8=name == "sparse_fp8")
        dev.synchronize(args.device)
        print(f"{name}: model and cache built in {time.perf_counter() - t0:.1f} s", flush=True)
        for mode in args.modes:
            before = list(out)
            out += timed_rows(model, name, mode, cache, args, bandwidth,
                              done and (lambda mode_rows: done(before + mode_rows)))
        del model, cache
    return out


def config(args) -> dict:
    """What a row's figures depend on besides model, mode and b (keys of the merged table)."""
    return dict(layers=args.layers, context=args.context, topk=args.topk,
                dtype=str(args.dtype).replace("torch.", ""), page_size=args.page_size,
                intermediate=args.intermediate, quick=bool(args.quick))


def size(nbytes: float) -> str:
    """``nbytes`` in decimal units, three significant digits: ``1.21 GB``, ``440 MB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def row_line(r: dict) -> str:
    return (f"| {r['model']} | {r['mode']} | {r['b']} | {r['ms']:.3f} | {r['tokens_per_s']:.1f} | "
            f"{size(r['cache_bytes'])} | {size(r['weight_bytes'])} | "
            f"{r['bandwidth_fraction']:.2f} | {r['graph_breaks']} | {r['graph_replays']} | "
            f"{r['first_step_s']:.1f} |")


def ratio_lines(rows_: list[dict]) -> list[str]:
    """Each sparse model against dense for every (mode, b) measured for both."""
    by = {(r["model"], r["mode"], r["b"]): r for r in rows_}
    pairs = [(by[k], by[("dense",) + k[1:]]) for k in by
             if k[0] != "dense" and ("dense",) + k[1:] in by]
    if not pairs:
        return []
    lines = ["", "| model | mode | b | tokens/s | dense tokens/s | speed / dense | cache read "
             "per step / dense |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {s['model']} | {s['mode']} | {s['b']} | {s['tokens_per_s']:.1f} | "
              f"{d['tokens_per_s']:.1f} | {s['tokens_per_s'] / d['tokens_per_s']:.2f} | "
              f"{size(s['cache_bytes'])} / {size(d['cache_bytes'])} "
              f"({s['cache_bytes'] / d['cache_bytes']:.2f}) |" for s, d in pairs]
    return lines


def markdown(runs: list[dict]) -> str:
    """One table per configuration over every ``{"config", "rows"}`` run given (the sparse
    and dense models may come from separate processes), and the sparse / dense ratios."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(json.dumps(run["config"], sort_keys=True), []).extend(run["rows"])
    text = []
    for key, rows_ in groups.items():
        c = json.loads(key)
        text += [f"DeepSeek-V3.2 shapes{' (--quick: tiny)' if c['quick'] else ''}, "
                 f"{c['layers']} layers (dense MLP {c['intermediate']}), context {c['context']}, "
                 f"top-k {c['topk']}, {c['dtype']}, page {c['page_size']}. Copy bandwidth (read + "
                 f"write, measured in each model's process): " + ", ".join(
                     f"{m} {gbps} GB/s" for m, gbps in dict(
                         (r["model"], r["copy_gbps"]) for r in rows_).items()) + ".",
                 "", "| model | mode | b | ms/step | tokens/s | cache read per step | weights "
                 "read | of copy bw | graph breaks | whole-step graph replays | first step "
                 "s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        text += [row_line(r) for r in rows_] + ratio_lines(rows_) + [""]
    return "\n".join(text)


def write(out: Path, table: list[dict], cfg: dict) -> str:
    """``dsa_decode_<model>.json`` per model of this run, then ``dsa_decode.md`` from every
    such file in ``out`` (so separate sparse and dense runs give one table). Returns the
    Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    for name in dict.fromkeys(r["model"] for r in table):
        run = dict(config=cfg, rows=[r for r in table if r["model"] == name])
        (out / f"dsa_decode_{name}.json").write_text(json.dumps(run, indent=1))
    runs = [json.loads((out / f"dsa_decode_{m}.json").read_text()) for m in MODELS
            if (out / f"dsa_decode_{m}.json").is_file()]
    text = markdown(runs)
    (out / "dsa_decode.md").write_text(text)
    return text


def main(argv=None):
    ap = CliParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu", "xpu"))
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=["sparse", "dense"],
                    help="which models to time, in this order (sparse_fp8: sparse over an fp8 "
                         "latent cache; run each in its own process with the same --out to "
                         "keep each under a time limit)")
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--intermediate", type=positive_int, default=18432)
    ap.add_argument("--context", type=positive_int, default=8192)
    ap.add_argument("--topk", type=positive_int, default=2048)
    ap.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--modes", nargs="+", choices=("eager", "compiled", "piecewise", "graphs"),
                    default=["graphs"])
    ap.add_argument("--page-size", type=positive_int, default=64)
    ap.add_argument("--warmup", type=non_negative_int, default=5)
    ap.add_argument("--steps", type=positive_int, default=30)
    ap.add_argument("--quick", action="store_true", help="CPU check: tiny shapes")
    ap.add_argument("--profile-batches", type=positive_int, nargs="*", default=[],
                    help="with --out: after timing these batch sizes, profile their kernels "
                         "(profile_<model>_<mode>_b<b>.md)")
    ap.add_argument("--profile-steps", type=positive_int, default=5)
    ap.add_argument("--out", default=None,
                    help="directory for dsa_decode_<model>.json and dsa_decode.md (the table "
                         "of every model's file there)")
    args = ap.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    args.dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(args.device, (64 if args.device == "cpu" else 2048) << 20)
    cfg = config(args)
    table = rows(args, bandwidth, (lambda t: write(Path(args.out), t, cfg)) if args.out else None)
    print(markdown([dict(config=cfg, rows=table)]))
    return table


if __name__ == "__main__":
    main()
