"""The main job's eager decode against ``transformers``' eager ``generate``, same prompts, one process.

Both decode the main job's prompts (``python -m compile generate``'s defaults, chat template
applied) with SmolLM2-135M-Instruct from the same weights, greedily, for ``--max-new-tokens``
tokens each with the stop tokens ignored, so both run the same number of batch-``b`` decode
steps (``b`` = the number of prompts):

- engine: ``compile.engine.engine.Engine`` in eager mode (the main job's path: paged KV cache, the
  default provider of each op); per step the time of each ``engine.step()`` that only decodes
  (model forward, host metadata and sampling).
- transformers: one left-padded batch through ``model.generate`` (its default dynamic cache and
  attention implementation); per step ``(t(N) - t(1)) / (N - 1)`` with ``t(n)`` the time of a
  ``generate`` of ``n`` new tokens (so the prefill cancels).

Rounds alternate the two (``--rounds``); the table reports each side's median and the ratio
engine tokens/s over transformers tokens/s (>= 1: the engine is at least as fast).

    PYTHONPATH=. python benchmarks/bench_cpu_decode.py --threads 1 --clock cpu   # the CPU figure

(``PYTHONPATH=.``: without it, run from a worktree, the editable install imports ``/work/main``'s
``compile`` and ``xpu_ops``.) The engine's model comes from ``from_hf`` (row-major linear
weights, as the ``transformers`` model holds them); ``--layouts row col`` adds an engine row
whose model stores them column-major (``from_hf(cpu_column_major=True)``), timed in the same
rounds.

``--clock cpu`` times this thread's CPU time instead of wall time: with ``--threads 1`` every
op runs on the calling thread, so the figure leaves out the time other processes hold the
cores (wall time on the shared 2-core machine moves by +-30 % between runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

from compile.__main__ import DEFAULT_PROMPTS, encode_prompts
from compile.engine.cli_models import load_model
from compile.engine import Engine, SamplingParams
from compile.models import from_hf


#: ``--layouts`` names: the ``cpu_column_major`` argument of ``from_hf`` each one passes.
LAYOUTS = {"row": False, "col": True}


def engine_step_seconds(model, prompt_ids: list[list[int]], new_tokens: int,
                        page_size: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per decode step of the eager engine over ``prompt_ids`` (stops ignored): the
    ``clock`` time of each ``engine.step()`` that prefilled nothing, averaged."""
    longest = max(len(p) for p in prompt_ids) + new_tokens
    total = sum(len(p) + new_tokens for p in prompt_ids)
    engine = Engine(model, page_size=page_size, max_running=len(prompt_ids),
                    max_context_len=longest,
                    max_total_tokens=total + page_size * len(prompt_ids))
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=())
    for p in prompt_ids:
        engine.add_request(p, sampling)
    seconds, steps = 0.0, 0
    while engine.has_work():
        prefilled = engine.stats.prefill_tokens
        t0 = clock()
        engine.step()
        if engine.stats.prefill_tokens == prefilled:  # a decode step
            seconds, steps = seconds + clock() - t0, steps + 1
    return seconds / max(steps, 1)


def hf_step_seconds(hf_model, prompt_ids: list[list[int]], new_tokens: int,
                    clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per decode step of ``transformers``' ``generate`` on one left-padded batch."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.zeros(len(prompt_ids), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompt_ids):
        ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1

    def generate(n: int) -> float:
        t0 = clock()
        hf_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, pad_token_id=0)
        return clock() - t0
    return (generate(new_tokens) - generate(1)) / (new_tokens - 1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["row"],
                   help="engine rows: linear weights row-major (from_hf's default) and/or "
                        "column-major (cpu_column_major=True)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: this thread's CPU time (with --threads 1 all the work runs on it; "
                        "robust on a shared machine, where wall time includes waiting)")
    args = p.parse_args(argv)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_model, tokenizer = load_model(None, dtype=torch.float32)
    hf_model.eval()
    models = {name: from_hf(hf_model, dtype=torch.float32, device=torch.device("cpu"),
                            cpu_column_major=LAYOUTS[name]) for name in args.layouts}
    prompt_ids = encode_prompts(tokenizer, list(DEFAULT_PROMPTS))
    engine_s, hf_s = {name: [] for name in models}, []
    with torch.inference_mode():
        for model in models.values():  # warm-up
            engine_step_seconds(model, prompt_ids, 4, args.page_size)
        hf_step_seconds(hf_model, prompt_ids, 4)
        for _ in range(args.rounds):
            for name, model in models.items():
                engine_s[name].append(engine_step_seconds(
                    model, prompt_ids, args.max_new_tokens, args.page_size, clock))
            hf_s.append(hf_step_seconds(hf_model, prompt_ids, args.max_new_tokens, clock))
    report(args, len(prompt_ids), engine_s, hf_s)


def report(args, b: int, engine_s: dict[str, list[float]], hf_s: list[float]) -> None:
    """Print the table (one engine row per layout, then transformers), each engine row's
    tokens/s ratio to transformers, every round's time and the load average at the end."""
    hf = statistics.median(hf_s)
    from xpu_ops import providers
    provider = providers.select("flash_attn_with_kvcache", torch.device("cpu")).provider
    print(f"# bench_cpu_decode: SmolLM2-135M-Instruct, {b} prompts, {args.max_new_tokens} new "
          f"tokens each, torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
          f"provider {provider}, {args.clock} clock\n")
    print("| decode (batch {}) | ms/step | tokens/s |\n|---|---:|---:|".format(b))
    for name, times in engine_s.items():
        eng = statistics.median(times)
        print(f"| engine, eager, {name}-major weights | {eng * 1e3:.1f} | {b / eng:.1f} |")
    print(f"| transformers generate, eager | {hf * 1e3:.1f} | {b / hf:.1f} |\n")
    for name, times in engine_s.items():
        print(f"engine ({name}-major) / transformers tokens/s: "
              f"{hf / statistics.median(times):.2f} (median of {args.rounds} rounds; engine "
              f"{', '.join(f'{s * 1e3:.1f}' for s in times)} ms)")
    print(f"transformers rounds: {', '.join(f'{s * 1e3:.1f}' for s in hf_s)} ms; load average "
          f"(1, 5, 15 min) {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
