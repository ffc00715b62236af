"""Decode throughput of a Qwen3-Next-shaped hybrid model (gated-delta-net layers, three per
full-attention layer; random weights) beside a dense Llama of the same parameter count, both in
``--mode graphs`` (``full_and_piecewise``: whole-step decode graphs, pieces for prefill).

Both models run through ``compile.engine.Engine``, one engine per model for every batch
size (one pool, one graph runner capturing a whole-step graph per request bucket): ``b``
requests of ``--context`` random prompt tokens are prefilled, then decoded for
``--new-tokens`` steps; a step's time is the engine's (model, metadata, sampling and its one
host sync), the steady-state figure leaves out the first two decode steps of each batch size
(compilation, capture; ``EngineStats.decode_split``). Each row also counts Dynamo's graph
breaks (0 expected) and the runner's whole-step graph replays while it ran. ``--out`` gets
``hybrid_decode.md`` and ``.json`` (rewritten after every row; the results page's ``hybrid``
part). Decode reads the weights once per step and, per request, the hybrid model's
full-attention KV (``context`` tokens of a quarter of the layers) plus its linear layers'
fixed-size state; the dense model reads the KV of every layer. The MLP is dense in both (the
hybrid model's sparse MoE, written densely in the zoo, would run every expert).

    python benchmarks/bench_hybrid_decode.py --device cuda --out /tmp/hybrid  # the GPU table
    python benchmarks/bench_hybrid_decode.py --device cpu --quick --no-inductor --emulate-graphs
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch

from compile.backend import kv_layout, linear_layout
from compile.engine import Engine, EngineStats, SamplingParams
from compile.engine.cli_args import DTYPES, CliParser, positive_int
from compile.graphs import full_and_piecewise
from compile.models import LlamaForCausalLM, ModelConfig
from compile.models.qwen3_next import Qwen3NextForCausalLM
from compile.models.qwen3_next_config import Qwen3NextConfig

# Qwen3-Next-80B-A3B's attention and linear-attention shapes, a dense MLP, fewer layers
HYBRID = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
              num_attention_heads=16, num_key_value_heads=2, head_dim=256,
              partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_num_key_heads=16,
              linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
              max_position_embeddings=8192)
QUICK = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)


def hybrid_model(shape: dict, dtype, device) -> Qwen3NextForCausalLM:
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**shape), dtype=dtype, device=device).eval()
    _randomize(model)
    return model


def dense_model(shape: dict, params: int, dtype, device) -> LlamaForCausalLM:
    """A Llama with the hybrid's hidden size, layers, vocabulary and attention shapes whose
    MLP width makes its parameter count ``params`` (as close as a multiple of 64 allows)."""
    base = dict(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                num_hidden_layers=shape["num_hidden_layers"],
                num_attention_heads=shape["num_attention_heads"],
                num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
                max_position_embeddings=shape.get("max_position_embeddings", 8192))
    h, n = base["hidden_size"], base["num_hidden_layers"]
    with torch.device("meta"):
        probe = LlamaForCausalLM(ModelConfig(**base, intermediate_size=64))
    rest = sum(p.numel() for p in probe.parameters()) - n * 3 * h * 64
    inter = max(64, round((params - rest) / (n * 3 * h) / 64) * 64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig(**base, intermediate_size=inter), dtype=dtype,
                             device=device).eval()
    _randomize(model)
    return model


def _randomize(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.02)


def make_engine(model, forward, max_b: int, context: int, new_tokens: int) -> Engine:
    """One engine per model for every batch size (as a server: one pool, one graph runner
    capturing a whole-step graph per request bucket)."""
    return Engine(model, forward=forward, page_size=16, max_running=max_b,
                  max_context_len=context + new_tokens + 1,
                  max_total_tokens=max_b * (context + new_tokens + 16),
                  chunked_prefill_size=max(context, 256))


def graph_breaks() -> int:
    """Dynamo's graph breaks so far in this process (``counters["graph_break"]``)."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def decode_rate(engine: Engine, b: int, context: int, new_tokens: int) -> dict:
    """Steady-state decode tokens/s and ms per step of ``b`` requests at ``context`` tokens,
    the graph breaks, whole-step captures and replays of that generation."""
    model, runner = engine.model, engine.forward
    g = torch.Generator().manual_seed(b)
    prompts = [torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist()
               for _ in range(b)]
    engine.stats = EngineStats()
    breaks, captures, replays = graph_breaks(), runner.captures, runner.replays
    engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
    _, steady = engine.stats.decode_split(warmup_steps=2)
    ms = 1e3 * steady.seconds / max(steady.steps, 1)
    return dict(batch=b, steps=steady.steps, ms_per_step=ms,
                tokens_per_s=steady.tokens / steady.seconds if steady.seconds else 0.0,
                graph_breaks=graph_breaks() - breaks, captures=runner.captures - captures,
                replays=runner.replays - replays)


def model_facts(model, dtype) -> dict:
    """Parameters, KV bytes per token and state bytes per request (0 without linear layers)."""
    layout, linear = kv_layout(model), linear_layout(model)
    per_token = (len(layout.cache_layer_ids) * layout.head_num
                 * (layout.head_dim + layout.v_head_dim) * dtype.itemsize)
    return dict(params=sum(p.numel() for p in model.parameters()), kv_bytes_per_token=per_token,
                state_bytes_per_request=0 if linear is None else linear.state_bytes(dtype))


def build_parser() -> argparse.ArgumentParser:
    ap = CliParser(prog="bench_hybrid_decode.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda", "xpu"))
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    ap.add_argument("--layers", type=positive_int, default=None,
                    help="decoder layers (a multiple of 4: three linear per full layer; default "
                         f"{HYBRID['num_hidden_layers']}, --quick {QUICK['num_hidden_layers']})")
    ap.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=positive_int, default=1024)
    ap.add_argument("--new-tokens", type=positive_int, default=32)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU check)")
    ap.add_argument("--no-inductor", action="store_true",
                    help="pieces run as Dynamo traced them (CPU check without compiling)")
    ap.add_argument("--emulate-graphs", action="store_true",
                    help="capture emulated graphs (TapeGraph: CPU check of the whole-step graph path)")
    ap.add_argument("--out", default=None,
                    help="folder for hybrid_decode.md and .json (the results page's 'hybrid' "
                         "part: benchmarks/results/<kind>/hybrid/)")
    return ap


def markdown(rows: list[dict], args, env: str) -> str:
    """A row per batch size: both models' tokens/s and ms per step, their ratio, graph breaks,
    then each model's size, KV bytes per token and state bytes per request."""
    by = {(r["model"], r["batch"]): r for r in rows}
    lines = [f"# bench_hybrid_decode: Qwen3-Next-shaped hybrid against a dense model of the "
             f"same size, --mode graphs, context {args.context}", "", env, "",
             "| batch | hybrid tokens/s | dense tokens/s | hybrid / dense | hybrid ms/step | "
             "dense ms/step | graph breaks (hybrid, dense) | graph replays (hybrid, dense) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b in dict.fromkeys(r["batch"] for r in rows):
        h, d = by.get(("hybrid", b)), by.get(("dense", b))
        cell = (lambda r, k, f: "-" if r is None else format(r[k], f))
        ratio = (f"{h['tokens_per_s'] / d['tokens_per_s']:.2f}"
                 if h and d and d["tokens_per_s"] else "-")
        lines.append(f"| {b} | {cell(h, 'tokens_per_s', '.0f')} | "
                     f"{cell(d, 'tokens_per_s', '.0f')} | {ratio} | "
                     f"{cell(h, 'ms_per_step', '.2f')} | {cell(d, 'ms_per_step', '.2f')} | "
                     f"{cell(h, 'graph_breaks', 'd')}, {cell(d, 'graph_breaks', 'd')} | "
                     f"{cell(h, 'replays', 'd')}, {cell(d, 'replays', 'd')} |")
    lines += ["", "| model | params (M) | KV bytes/token | state bytes/request |",
              "|---|---:|---:|---:|"]
    for name in dict.fromkeys(r["model"] for r in rows):
        r = next(r for r in rows if r["model"] == name)
        lines.append(f"| {name} | {r['params'] / 1e6:.1f} | {r['kv_bytes_per_token']} | "
                     f"{r['state_bytes_per_request']} |")
    lines += ["", f"Steady state: the decode steps after the first two of each batch size "
              f"({args.new_tokens} new tokens per request; layers: {args.layers_used}, "
              f"{args.dtype}, page size 16). Graph breaks: Dynamo's count while that batch ran "
              f"(0 expected: decode replays whole-step graphs, extend runs compiled pieces)."]
    return "\n".join(lines) + "\n"


def env_line(device: torch.device) -> str:
    """Device, torch and Triton versions of this run."""
    try:
        import triton
        tri = f"Triton {triton.__version__}"
    except ImportError:
        tri = "no Triton"
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else torch.xpu.get_device_name(device) if device.type == "xpu" else "CPU")
    return f"{name}, torch {torch.__version__}, {tri}"


def save(out: Optional[Path], rows: list[dict], args, env: str) -> None:
    """``hybrid_decode.md`` and ``.json`` in ``out`` (rewritten after every row, so a run cut
    short keeps the rows it measured)."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "hybrid_decode.md").write_text(markdown(rows, args, env), encoding="utf-8")
    (out / "hybrid_decode.json").write_text(json.dumps(dict(env=env, args=vars(args) | dict(
        out=str(out)), rows=rows), indent=1), encoding="utf-8")


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    shape = dict(QUICK if args.quick else HYBRID)
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    args.layers_used = shape["num_hidden_layers"]
    hybrid = hybrid_model(shape, dtype, device)
    facts = {"hybrid": model_facts(hybrid, dtype)}
    dense = dense_model(shape, facts["hybrid"]["params"], dtype, device)
    facts["dense"] = model_facts(dense, dtype)
    engines = {}
    for name, model in (("hybrid", hybrid), ("dense", dense)):
        forward = full_and_piecewise(model, inductor=not args.no_inductor,
                                     emulate_graphs=args.emulate_graphs)
        engines[name] = make_engine(model, forward, max(args.batches), args.context,
                                    args.new_tokens)
    env, out = env_line(device), (Path(args.out) if args.out else None)
    rows = []
    for b in args.batches:  # both models per batch size: a run cut short keeps pairs
        for name, engine in engines.items():
            rows.append(dict(model=name, **facts[name],
                             **decode_rate(engine, b, args.context, args.new_tokens)))
            print(json.dumps(rows[-1]), flush=True)
            save(out, rows, args, env)
    text = markdown(rows, args, env)
    print(text)
    return rows


if __name__ == "__main__":
    main()
