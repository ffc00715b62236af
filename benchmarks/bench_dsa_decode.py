"""Decode of a DeepSeek-V3.2-shaped model: sparse MLA (DSA, the indexer's top-k) against the
same model with dense MLA, whole-step graphs.

Two zoo models with random weights and DeepSeek-V3.2's attention shapes (hidden 7168, 128 heads,
q LoRA 1536, latent R 512 + rope r 64, nope 128, v 128; indexer 64 heads of 128, top-k 2048),
``--layers`` layers with dense MLPs of ``--intermediate`` (the MoE is left out: this compares
attention): ``DeepseekV32ForCausalLM`` on a ``DSATokenToKVPool`` with the
``DSAAttentionBackend`` (``sparse``) and ``DeepseekV2ForCausalLM`` of the same shapes on an MLA
pool with ``XPUAttentionBackend`` (``dense``: ``flash_mla_decode`` over every key). The caches
of ``b`` requests hold ``--context`` random tokens each (latent rows and fp8 index keys written
directly, no prefill); every step decodes one token per request at that length.

Per batch size and model: median ms per step (``bench_model.step_seconds``: warm-up excluded,
device synchronised, host plan inside the step), tokens/s, and the bytes a step must read at
least (weights once, plus per layer the latent rows attended: ``min(context, topk)`` for
sparse, ``context`` for dense; plus the index keys for sparse), as a fraction of the device's
copy bandwidth measured in the same run.

    python benchmarks/bench_dsa_decode.py --device cuda                 # 8k context, graphs
    python benchmarks/bench_dsa_decode.py --device cpu --quick          # CPU check, tiny
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch

import xpu_ops
from compile.backend import XPUAttentionBackend
from compile.backend.dsa_backend import DSAAttentionBackend
from compile.batch import (DSATokenToKVPool, ForwardBatch, ForwardMode, MLATokenToKVPool,
                           PageAllocator, ReqToTokenPool)
from compile.engine.cli_args import DTYPES, CliParser, non_negative_int, positive_int
from compile.engine.model_runner import ModelRunnerInfo
from compile.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from compile.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM
from bench_model import make_forward, paged_step, step_seconds
from decode_roofline import copy_bandwidth

RESULTS = Path(__file__).parent / "results"
V32_SHAPES = dict(vocab_size=129280, hidden_size=7168, num_attention_heads=128,
                  q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                  qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840)
INDEXER = dict(index_n_heads=64, index_head_dim=128)
QUICK = dict(layers=2, context=40, topk=16, batches=[1, 2], intermediate=64, warmup=1,
             steps=2)
QUICK_SHAPES = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, q_lora_rank=32,
                    kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
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


def decode_batch(model, b: int, context: int, page_size: int):
    """``(input_ids [b], ForwardBatch)``: ``b`` requests of ``context`` random cached tokens
    (latent rows, and index keys for a DSA model) decoding one token each."""
    cfg, param = model.config, next(model.parameters())
    device, dtype = param.device, param.dtype
    pages = -(-(context + 1) // page_size)
    num_pages = b * pages + 1
    req_pool = ReqToTokenPool(b, pages * page_size, device)
    args = (num_pages * page_size, page_size, dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
            cfg.num_hidden_layers, device)
    sparse = hasattr(cfg, "index_head_dim")
    pool = (DSATokenToKVPool(*args, index_head_dim=cfg.index_head_dim) if sparse
            else MLATokenToKVPool(*args))
    alloc = PageAllocator(num_pages, page_size, device)
    loc = torch.cat([alloc.alloc_extend(req_pool, r, 0, context + 1)[-1:] for r in range(b)])
    gen = torch.Generator(device="cpu").manual_seed(1)
    slots = torch.arange(page_size, num_pages * page_size, device=device)
    for layer in range(cfg.num_hidden_layers):
        kv = pool.get_key_buffer(layer)
        kv.copy_(torch.randn(kv.shape, generator=gen).to(device, dtype))
        if sparse:
            keys = torch.randn(slots.shape[0], cfg.index_head_dim, generator=gen).to(device,
                                                                                    dtype)
            xpu_ops.store_index_k_cache(pool.get_index_k_with_scale_buffer(layer), slots, keys)
    runner = ModelRunnerInfo(
        model_config=SimpleNamespace(context_len=pages * page_size,
                                     num_attention_heads=cfg.num_attention_heads,
                                     index_topk=getattr(cfg, "index_topk", None)),
        tp_size=1, device=device, page_size=page_size, req_to_token_pool=req_pool,
        token_to_kv_pool=pool, kv_cache_dtype=dtype)
    seq_lens = torch.full((b,), context + 1, dtype=torch.int32)
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=b,
                      req_pool_indices=torch.arange(b, device=device),
                      seq_lens=seq_lens.to(device), seq_lens_cpu=seq_lens, out_cache_loc=loc,
                      positions=torch.full((b,), context, device=device))
    fb.attn_backend = (DSAAttentionBackend if sparse else XPUAttentionBackend)(runner)
    fb.token_to_kv_pool, fb.req_to_token_pool = pool, req_pool
    ids = torch.randint(0, cfg.vocab_size, (b,), device=device)
    return ids, fb


def min_bytes(model, b: int, context: int) -> int:
    """Bytes one decode step reads at least: the weights once, and per layer and request the
    latent rows attended (``min(context + 1, topk)`` sparse) plus, sparse, every index key."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    keys = context + 1
    row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * next(model.parameters()).element_size()
    topk = getattr(cfg, "index_topk", None)
    per_layer = row * (min(keys, topk) if topk else keys)
    if topk:
        per_layer += keys * (cfg.index_head_dim + 4)
    return weights + b * cfg.num_hidden_layers * per_layer


def rows(args, bandwidth: float) -> list[dict]:
    out = []
    for sparse in (True, False):
        model = build(args, sparse)
        for mode in args.modes:
            for b in args.batches:  # a graph runner keeps one backend: a forward per batch
                ids, fb = decode_batch(model, b, args.context, args.page_size)
                forward = make_forward(model, mode)
                step, host = step_seconds(paged_step(forward, ids, fb), args.device,
                                          args.warmup, args.steps)
                floor = min_bytes(model, b, args.context) / bandwidth
                out.append(dict(model="sparse" if sparse else "dense", mode=mode, b=b,
                                ms=step * 1e3, host_ms=host * 1e3, tokens_per_s=b / step,
                                bandwidth_fraction=floor / step))
                print(json.dumps(out[-1]), flush=True)
        del model
    return out


def markdown(rows_: list[dict], args) -> str:
    head = (f"DeepSeek-V3.2 shapes, {args.layers} layers, context {args.context}, top-k "
            f"{args.topk}, {args.dtype}, page {args.page_size}")
    lines = [head, "", "| model | mode | b | ms/step | host ms | tokens/s | of copy bw |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['mode']} | {r['b']} | {r['ms']:.3f} | {r['host_ms']:.3f} | "
              f"{r['tokens_per_s']:.1f} | {r['bandwidth_fraction']:.2f} |" for r in rows_]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = CliParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu", "xpu"))
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES)
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
    ap.add_argument("--out", default=None, help="directory for dsa_decode.{md,json}")
    args = ap.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    args.dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(args.device, (64 if args.device == "cpu" else 2048) << 20)
    table = rows(args, bandwidth)
    text = markdown(table, args)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "dsa_decode.md").write_text(text)
        (out / "dsa_decode.json").write_text(json.dumps(table, indent=1))
    return table


if __name__ == "__main__":
    main()
