"""Prefill/decode disaggregation on one device: KV transfer time per request against its prefill.

Two processes share the device (``cuda:0``, or the CPU): rank 0 runs a prefill engine
(``Engine(disaggregation="prefill")``), rank 1 a decode engine in ``--decode-mode`` (default
``graphs``: whole-step decode graphs, captured on GPUs) with its own page size. Prompts of each
``--prompt-lens`` length go to the prefill engine one at a time, each prefilled in one step; its
KV is then sent (``compile.engine.disaggregation``) while the next prompt prefills. A first
prompt of each length warms up (compilation, capture) and is left out of the table. Rank 1 then
runs one ordinary engine (``--decode-mode``, the decode page size) on every prompt and the
greedy tokens must be equal (exit 1 otherwise).

Per measured request: prefill ms (the prefill engine's step: the forward and the first token's
sampling, packing excluded), pack ms (gathering the request's KV out of the pool into
contiguous send buffers, on the wire's device), transfer ms (decode side: from posting the
payload's receives until the KV is written into its own pages) and the payload's MiB; the
table gives medians per prompt length. Transport: NCCL when ``--transfer-backend`` is ``nccl``,
or ``auto`` and two NCCL ranks on the one GPU pass ``--probe-nccl``'s check (NCCL has refused
two ranks on one device, "Duplicate GPU detected"); otherwise gloo, through host copies (the
pack copies device to host, the write host to device). The two processes time-slice the GPU:
the prefill of one request may wait for a decode step of the other process.

    python benchmarks/bench_disaggregation.py --device cuda --out /tmp/disagg   # the GPU table
    python benchmarks/bench_disaggregation.py --device cpu --quick --out /tmp/d  # CPU check

Writes ``disaggregation.json`` (settings, per-request rows, the table's rows, token check) and
``disaggregation.md`` into ``--out``; ``make_results_page.py`` shows the json's table as the
``disagg`` part of ``gpu_session.sh``.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from compile.engine import Engine, SamplingParams
from compile.engine.cli_args import DTYPES, CliParser, page_size, positive_int
from compile.engine.cli_disagg import free_port
from compile.engine.forwards import MODES, make_forward
from compile.models import LlamaForCausalLM, ModelConfig

# SmolLM2-135M (the CLI's default model) at random weights
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True)
# the tiny model of --quick: positions for the default --prompt-lens (2048) and new tokens
QUICK = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=4096)
TIMEOUT_S = 120  # a transfer that waits longer than this fails (the process group's timeout)


def build_model(quick: bool, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """The benchmark's Llama at random weights (the same on both ranks: seeded)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig(**(QUICK if quick else SMOLLM2_135M)), dtype=dtype,
                             device=device).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15 if quick else 0.02)
    return model


def prompts(args, vocab: int) -> list[list[int]]:
    """One warm-up prompt per length, then ``--repeats`` prompts per length (random ids)."""
    g = torch.Generator().manual_seed(1)
    lens = list(args.prompt_lens) + [n for _ in range(args.repeats) for n in args.prompt_lens]
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def engine_sizes(args, all_prompts: list[list[int]], ps: int) -> dict:
    """Engine sizes that hold every prompt at once, each prefilled in one step."""
    longest = max(len(p) for p in all_prompts)
    total = sum(len(p) + args.new_tokens for p in all_prompts)
    return dict(page_size=ps, max_running=len(all_prompts),
                max_context_len=longest + args.new_tokens, max_total_tokens=total + ps * len(
                    all_prompts), chunked_prefill_size=longest)


def _prefill_rank(args, model, all_prompts, sampling) -> dict:
    engine = Engine(model, forward=make_forward(model, args.prefill_mode,
                                                inductor=args.inductor),
                    disaggregation="prefill", **engine_sizes(args, all_prompts, args.page_size))
    rows, st, role = [], engine.stats, engine.disagg
    for prompt in all_prompts:
        before = (st.prefill_seconds, role.pack_seconds)
        req = engine.add_requests([prompt], sampling)[0]
        while engine.waiting or engine.running:
            engine.step()
        pack = role.pack_seconds - before[1]
        rows.append(dict(rid=req.rid, prompt_len=len(prompt), pack_ms=1e3 * pack,
                         prefill_ms=1e3 * (st.prefill_seconds - before[0] - pack)))
    role.close()
    return dict(rows=rows, errors=role.errors, wire=str(role.wire))


def _decode_rank(args, model, all_prompts, sampling) -> dict:
    forward = make_forward(model, args.decode_mode, inductor=args.inductor)
    sizes = engine_sizes(args, all_prompts, args.decode_page_size)
    engine = Engine(model, forward=forward, disaggregation="decode", **sizes)
    engine.generate([])
    got = engine.disagg.outputs()
    log = [dict(rid=rid, prompt_len=n, bytes=b, transfer_ms=1e3 * s)
           for rid, n, b, s in engine.disagg.transfer_log]
    graphs = {k: getattr(forward, k, 0) for k in ("captures", "replays")}
    want = one_engine(args, model, all_prompts, sampling, sizes)
    return dict(log=log, got=[got.get(i) for i in range(len(all_prompts))], want=want,
                errors=engine.disagg.errors, graphs=graphs,
                decode_steps=engine.stats.decode_steps)


def one_engine(args, model, all_prompts, sampling, sizes: dict) -> list[list[int]]:
    """Greedy tokens of one ordinary engine in ``--decode-mode``: each prompt prefilled in a
    step of its own (as on the prefill rank), then all decoded together."""
    torch._dynamo.reset()
    engine = Engine(model, forward=make_forward(model, args.decode_mode,
                                                inductor=args.inductor), **sizes)
    reqs = []
    for prompt in all_prompts:
        reqs += engine.add_requests([prompt], sampling)
        engine.step()
    while engine.has_work():
        engine.step()
    return [r.output_ids for r in reqs]


def _worker(rank: int, args, port: int, backend: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(args.device)
    if device.type != "cpu":
        device = torch.device(device.type, 0)
        getattr(torch, device.type).set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    model = build_model(args.quick, getattr(torch, args.dtype), device)
    all_prompts = prompts(args, model.config.vocab_size)
    sampling = SamplingParams(max_new_tokens=args.new_tokens)
    run = _prefill_rank if rank == 0 else _decode_rank
    result = run(args, model, all_prompts, sampling)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _nccl_pair(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    try:
        dist.init_process_group("nccl", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))
        t = torch.full((4,), float(rank), device="cuda")
        (dist.send if rank == 0 else dist.recv)(t, 1 - rank)
        torch.cuda.synchronize()
        why = "" if rank == 0 or t.eq(0).all() else "received wrong values"
        dist.destroy_process_group()
    except Exception as e:  # the probe reports any refusal
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    Path(out_dir, f"nccl{rank}.txt").write_text(why or "ok")


def probe_nccl() -> str:
    """``ok`` when two NCCL ranks on ``cuda:0`` exchange a tensor, else why not (45 s at most)."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_nccl_pair, args=(free_port(), tmp), nprocs=2, join=False,
                                 start_method="spawn")
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=45)
        try:
            while not ctx.join(timeout=1):
                if datetime.datetime.now() > deadline:
                    return "timed out after 45 s (the NCCL pair hung)"
        except mp.ProcessException as e:
            return f"a probe process failed: {' '.join(str(e).split())[:300]}"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        said = [Path(tmp, f"nccl{r}.txt").read_text() for r in range(2)
                if Path(tmp, f"nccl{r}.txt").is_file()]
        return next((s for s in said if s != "ok"), "ok" if len(said) == 2 else "no answer")


def summarize(rows: list[dict]) -> list[dict]:
    """Medians per prompt length of the measured rows."""
    out = []
    for n in sorted({r["prompt_len"] for r in rows}):
        mine = [r for r in rows if r["prompt_len"] == n]
        med = {k: statistics.median(r[k] for r in mine)
               for k in ("prefill_ms", "pack_ms", "transfer_ms", "bytes")}
        out.append(dict(prompt_len=n, requests=len(mine), mib=med["bytes"] / 2**20,
                        prefill_ms=med["prefill_ms"], pack_ms=med["pack_ms"],
                        transfer_ms=med["transfer_ms"],
                        moved_over_prefill=(med["pack_ms"] + med["transfer_ms"])
                        / max(med["prefill_ms"], 1e-9)))
    return out


def markdown(result: dict) -> str:
    """The results table with a line of settings."""
    s = result["settings"]
    lines = ["# Disaggregation: KV transfer against prefill per request", "",
             f"{s['model']}, {s['dtype']}; prefill {s['prefill_mode']} page {s['page_size']} -> "
             f"decode {s['decode_mode']} page {s['decode_page_size']}, both processes on "
             f"{s['device']}; transport {result['backend']} (NCCL on one card: "
             f"{result['nccl_probe']}); greedy tokens equal to one engine's: "
             f"{'yes' if result['tokens_equal'] else 'NO'} ({result['requests_equal'][0]} of "
             f"{result['requests_equal'][1]} requests); decode graphs "
             f"{result['graphs']['captures']} captured, {result['graphs']['replays']} replays.",
             "", "| prompt tokens | requests | KV MiB | prefill ms | pack ms | transfer ms "
             "| (pack + transfer) / prefill |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["table"]:
        lines.append(f"| {r['prompt_len']} | {r['requests']} | {r['mib']:.2f} | "
                     f"{r['prefill_ms']:.2f} | {r['pack_ms']:.2f} | {r['transfer_ms']:.2f} | "
                     f"{r['moved_over_prefill']:.2f} |")
    return "\n".join(lines) + "\n"


def merge(args, ranks: list[dict], backend: str, probe: str) -> dict:
    """The result record of a run from both ranks' outputs."""
    pre, dec = ranks
    n_warm = len(args.prompt_lens)
    sent = {r["rid"]: r for r in dec["log"]}
    rows = [dict(r, bytes=sent[r["rid"]]["bytes"], transfer_ms=sent[r["rid"]]["transfer_ms"])
            for r in pre["rows"][n_warm:] if r["rid"] in sent]
    same = sum(g == w for g, w in zip(dec["got"], dec["want"]))
    equal = same == len(dec["want"]) and not pre["errors"] and not dec["errors"]
    settings = {k: getattr(args, k) for k in ("device", "dtype", "prefill_mode", "decode_mode",
                                              "page_size", "decode_page_size", "new_tokens",
                                              "prompt_lens", "repeats", "inductor")}
    settings["model"] = ("tiny Llama (2 layers, random weights)" if args.quick
                         else "SmolLM2-135M-shaped Llama (random weights)")
    return dict(settings=settings, backend=backend, wire=pre["wire"], nccl_probe=probe,
                tokens_equal=equal, requests_equal=[same, len(dec["want"])], errors={"prefill": pre["errors"], "decode": dec["errors"]},
                graphs=dec["graphs"], decode_steps=dec["decode_steps"], rows=rows,
                table=summarize(rows))


def build_parser() -> CliParser:
    ap = CliParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "xpu", "cpu"), default="cuda")
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--quick", action="store_true", help="a tiny 2-layer model (CPU check)")
    ap.add_argument("--prompt-lens", type=positive_int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--repeats", type=positive_int, default=2,
                    help="measured prompts per length (after one warm-up prompt)")
    ap.add_argument("--new-tokens", type=positive_int, default=16)
    ap.add_argument("--page-size", type=page_size, default=16, help="prefill engine's")
    ap.add_argument("--decode-page-size", type=page_size, default=16)
    ap.add_argument("--prefill-mode", choices=MODES, default="graphs")
    ap.add_argument("--decode-mode", choices=MODES, default="graphs")
    ap.add_argument("--inductor", action="store_true",
                    help="compile pieces with Inductor (default: Dynamo's eager backend; graphs "
                         "are captured on GPUs either way)")
    ap.add_argument("--transfer-backend", choices=("auto", "gloo", "nccl"), default="auto")
    ap.add_argument("--probe-nccl", action="store_true",
                    help="check whether two NCCL ranks work on the one GPU (auto: then use it)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/scratch/disagg"))
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    probe = probe_nccl() if args.probe_nccl and args.device == "cuda" else "not probed"
    backend = args.transfer_backend
    if backend == "auto":
        backend = "nccl" if probe == "ok" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args, free_port(), backend, tmp), nprocs=2, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    result = merge(args, ranks, backend, probe)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "disaggregation.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "disaggregation.md").write_text(markdown(result))
    print(markdown(result))
    if not result["tokens_equal"]:
        print(f"bench_disaggregation: tokens differ from one engine's or requests failed "
              f"({result['errors']})", file=sys.stderr)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["tokens_equal"] else 1)
