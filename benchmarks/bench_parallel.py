"""Decode tokens/s of the 1B-shape Llama under tensor parallelism, and the KV memory per rank
under decode context parallelism; one process per GPU under ``torchrun``.

    # the 2-GPU run (nvidia-h200-x2; NVLink multicast stays off, KINDS.md):
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --nproc-per-node 1 benchmarks/bench_parallel.py --device cuda --out $OUT/tp1
    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py --device cuda --tp 2 --out $OUT/tp2
    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py --device cuda --dcp 2 --out $OUT/dcp2
    # a CPU check of the script (gloo, tiny shapes, seconds):
    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py --quick --tp 2

Each run builds the Llama-3.2-1B shape with random weights (``bench_model.LLAMA_1B``, N(0,
0.02), one seed, so every rank starts from the same full model and shards it), puts ``--batch``
requests of ``--context`` prompt tokens through the engine's chunked prefill, then decodes
``--new-tokens`` tokens each. Reported (rank 0, ``<out>.json`` and stdout): steady-state decode
tokens/s (``EngineStats.decode_split``: the first ``--warmup-steps`` decode steps of each batch
size, where compilation and capture happen, left out), the KV pool's bytes per rank, the bytes
per token of context per rank, and ``servable_tokens``: how many tokens of context the same
``--kv-gib`` per rank holds (DCP=2 halves the bytes per token, so it doubles them).
Targets: TP=2 decode tokens/s at b=64 >= 1.6x TP=1; DCP=2 servable tokens = 2x.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_model import LLAMA_1B, build  # noqa: E402
from compile.backend.parallel_state import init_parallel, process_group_scope  # noqa: E402
from compile.engine.engine import Engine, SamplingParams  # noqa: E402
from compile.models.tensor_parallel import tensor_parallel  # noqa: E402



def build_model(args, device: torch.device):
    """``bench_model.build``'s model (N(0, 0.02) weights from seed 0, so every rank starts from
    the same full model); ``--quick``: 2 layers of hidden size 128."""
    layers, hidden = (2, 128) if args.quick else (LLAMA_1B["num_hidden_layers"], 0)
    return build(SimpleNamespace(layers=layers, hidden=hidden, dtype=getattr(torch, args.dtype),
                                 device=device))


def forward_of(model, mode: str):
    """The engine's forward for ``--mode`` (as ``python -m compile generate --mode``)."""
    from compile.__main__ import make_forward
    return make_forward(model, mode)


def pool_bytes(pool) -> int:
    """Bytes of every K and V buffer of an MHA pool."""
    return sum(t.numel() * t.element_size() for t in [*pool.k_buffer, *pool.v_buffer])


def run(args) -> dict:
    """One measurement on this rank; returns its row."""
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    backend = "gloo" if device.type == "cpu" else "nccl"
    parallel = init_parallel(args.tp, args.dcp, backend=backend)
    model = tensor_parallel(build_model(args, device), parallel.tp)
    tokens = args.batch * (args.context + args.new_tokens)
    engine = Engine(model, forward=forward_of(model, args.mode), page_size=args.page_size,
                    max_running=args.batch, max_context_len=args.context + args.new_tokens,
                    max_total_tokens=tokens + args.page_size * args.dcp * args.batch,
                    chunked_prefill_size=args.chunked_prefill_size, parallel=parallel)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.context),
                            generator=gen).tolist()
    engine.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens))
    _, steady = engine.stats.decode_split(args.warmup_steps)
    pool = engine.token_to_kv_pool
    per_token = pool_bytes(pool) / pool.size / args.dcp   # one token's share on this rank
    return dict(tp=args.tp, dcp=args.dcp, mode=args.mode, batch=args.batch,
                context=args.context, device=str(device), dtype=args.dtype,
                decode_tokens_per_s=steady.tokens / max(steady.seconds, 1e-9),
                decode_steps=steady.steps, kv_pool_bytes_per_rank=pool_bytes(pool),
                kv_bytes_per_token_per_rank=per_token,
                servable_tokens=int(args.kv_gib * 2**30 // per_token))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--mode", default="graphs", choices=("eager", "compile", "piecewise",
                                                        "graphs"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--kv-gib", type=float, default=64.0,
                   help="KV memory per rank that servable_tokens is computed for")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, eager, b=4, context 16 (a CPU check of the script)")
    p.add_argument("--out", default=None, help="write <out>.json (rank 0)")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.mode, args.batch, args.context, args.new_tokens = "eager", 4, 16, 8
        args.dtype, args.warmup_steps, args.page_size = "float32", 2, 4
    if args.dcp > 1 and args.mode == "graphs":
        args.mode = "piecewise"   # DCP steps are not captured whole (dcp_attention)
    with process_group_scope():
        row = run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(row, indent=1))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(f"{args.out}.json").write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
