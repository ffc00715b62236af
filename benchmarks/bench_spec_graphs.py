"""Speculative steps of a 1B-class Llama (random weights), eager and as whole-step graphs: ms
per step of tree target verify, tree draft decode and draft extend at each batch size.

Per step the host plan (the metadata build) is inside the timed step, as in serving.
``eager``: ``init_forward_metadata`` then the model. ``graphs``: ``GraphRunner(model)`` (its step
buffers refilled in place, one device graph per request bucket with the model's layers as
written inside the capture). Every request has ``--context`` cached tokens; a tree verify step
has ``--draft-tokens`` drafts per request under a random tree mask, a tree draft decode step
``--topk`` branches at draft step 0 of a ``--spec-steps`` round, a draft extend step
``--draft-tokens`` new tokens per request (DRAFT_EXTEND_V2). Each row also reports the largest
difference between the two modes' logits (they compute the same step).

    python benchmarks/bench_spec_graphs.py --device cuda            # the H200 table
    python benchmarks/bench_spec_graphs.py --device cpu --quick     # CPU check (emulated graphs)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from compile.batch import ForwardBatch, ForwardMode, SpecInfo
from compile.engine.cli_args import DTYPES, positive_int
from compile.graphs import GraphRunner
from bench_model import build, step_seconds
from paged_batches import paged_batch

KINDS = ("verify_tree", "draft_decode_tree", "draft_extend")
QUICK = dict(layers=1, hidden=64, context=16, batches=[1, 2], warmup=1, iters=2)


def _tree(gen: torch.Generator, d: int) -> torch.Tensor:
    """A random tree mask ``[D, D]``: draft i sees its ancestors and itself."""
    mask = torch.eye(d, dtype=torch.bool)
    for i in range(1, d):
        mask[i] |= mask[int(torch.randint(0, i, (1,), generator=gen))]
    return mask


def spec_batch(model, kind: str, b: int, args) -> ForwardBatch:
    """A ``kind`` batch of ``b`` requests over ``args.context`` cached tokens each (metadata
    not built)."""
    cfg, param = model.config, next(model.parameters())
    d, topk, steps = args.draft_tokens, args.topk, args.spec_steps
    new = topk * steps if kind == "draft_decode_tree" else d
    fb = paged_batch([new] * b, args.context, ForwardMode.EXTEND,
                     num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                     head_dim=cfg.head_dim, num_layers=cfg.num_hidden_layers,
                     dtype=param.dtype, device=param.device)
    if kind == "draft_extend":
        fb.forward_mode = ForwardMode.DRAFT_EXTEND_V2
        fb.spec_info = SpecInfo(topk=1, num_tokens_per_req=d)
        return fb
    fb.seq_lens, fb.seq_lens_cpu = fb.seq_lens - new, fb.seq_lens_cpu - new  # the prefix
    fb.seq_lens_sum -= b * new
    fb.extend_seq_lens = fb.extend_prefix_lens = fb.extend_seq_lens_cpu = None
    fb.extend_prefix_lens_cpu = fb.extend_num_tokens = None
    if kind == "verify_tree":
        gen = torch.Generator().manual_seed(b)
        trees = torch.stack([_tree(gen, d) for _ in range(b)]).to(param.device)
        fb.forward_mode = ForwardMode.TARGET_VERIFY
        fb.spec_info = SpecInfo(topk=topk, draft_token_num=d, custom_mask=trees)
    else:  # the round's slots, (b, topk, steps)
        fb.forward_mode = ForwardMode.DECODE
        fb.spec_info = SpecInfo(topk=topk, spec_steps=steps)
        fb.positions = fb.positions[::steps]
    return fb


def row(model, kind: str, b: int, args) -> dict:
    """Eager and graph ms per step of one ``kind`` batch of ``b`` requests."""
    fb = spec_batch(model, kind, b, args)
    tokens = fb.positions.shape[0]
    ids = torch.randint(0, model.config.vocab_size, (tokens,), device=fb.device)
    runner = GraphRunner(model, batch_sizes=(b,), draft_token_num=args.draft_tokens,
                         speculative_num_steps=args.spec_steps, topk=args.topk,
                         emulate_graphs=fb.device.type == "cpu")
    assert runner.can_run(fb), kind

    def eager():
        fb.attn_backend.init_forward_metadata(fb)
        return model(ids, fb.positions, fb)

    def graphs():
        return runner(ids, fb.positions, fb)

    out = dict(kind=kind, batch=b, tokens=tokens)
    for name, step in (("eager", eager), ("graphs", graphs)):
        seconds, host = step_seconds(step, fb.device, args.warmup, args.iters)
        out[f"{name}_ms"], out[f"{name}_host_ms"] = seconds * 1e3, host * 1e3
    with torch.inference_mode():  # a replay against eager, on the same cache contents
        out["max_abs_diff"] = (graphs().float() - eager().float()).abs().max().item()
    out["graph_replays"], out["speedup"] = runner.replays, out["eager_ms"] / out["graphs_ms"]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_spec_graphs.py", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--layers", type=positive_int, default=16)
    p.add_argument("--hidden", type=int, default=0, help="hidden size (0: Llama-3.2-1B's)")
    p.add_argument("--context", type=positive_int, default=1024)
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 32])
    p.add_argument("--draft-tokens", type=positive_int, default=8)
    p.add_argument("--topk", type=positive_int, default=4)
    p.add_argument("--spec-steps", type=positive_int, default=3)
    p.add_argument("--kinds", choices=KINDS, nargs="+", default=list(KINDS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=positive_int, default=20)
    p.add_argument("--quick", action="store_true",
                   help=f"tiny shapes for a CPU check (defaults {QUICK}, float32)")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    return p


def main(argv=None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:  # QUICK's values become the defaults; flags given still win
        parser.set_defaults(**QUICK, dtype="float32")
        args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    model = build(args)
    rows = [row(model, kind, b, args) for kind in args.kinds for b in args.batches]
    print("| kind | b | tokens | eager ms | graphs ms | speedup | graphs host ms | max diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['batch']} | {r['tokens']} | {r['eager_ms']:.3f} | "
              f"{r['graphs_ms']:.3f} | {r['speedup']:.2f}x | {r['graphs_host_ms']:.3f} | "
              f"{r['max_abs_diff']:.2e} |")
    if args.out is not None:
        args.out.write_text(json.dumps(dict(device=args.device, rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
