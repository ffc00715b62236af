"""Qwen3-Next and Qwen3.5 in every compiled mode equal eager (tokens and every step's logits).

Modes as ``tests/models/test_gemma3_modes.py`` builds them, on the CPU: ``torch.compile``
(``compile_model``, Dynamo with the eager backend, one full graph), piecewise with graph
capture emulated (both split ops: the paged layers' and the linear layers'; pieces captured
per token bucket), full decode graphs (``GraphRunner``, emulated capture: the linear layers'
state slots are written inside the step) and full_and_piecewise. Three requests of different
lengths, prompts longer than a prefill chunk (a later chunk continues from the state the first
left), decode steps past a page boundary.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from compile.engine import Engine, SamplingParams  # noqa: E402
from compile.graphs import (GraphRunner, PiecewiseModel, compile_model,  # noqa: E402
                            full_and_piecewise)
from compile.models import from_hf  # noqa: E402
from tests.compile.batch.test_swa_pages import Recorder  # noqa: E402
from tests.models.test_qwen3_next_parity import MODELS  # noqa: E402

PROMPT_LENS = (21, 6, 9)
NEW_TOKENS = 5

MODES = {
    "compile": lambda m: compile_model(m, backend="eager"),
    "piecewise": lambda m: PiecewiseModel(m, inductor=False, emulate_graphs=True,
                                          graph_sizes=(8, 16, 32)),
    "graphs": lambda m: GraphRunner(m, forward=compile_model(m, backend="eager"),
                                    emulate_graphs=True, batch_sizes=(1, 2, 4)),
    "full_and_piecewise": lambda m: full_and_piecewise(m, inductor=False, emulate_graphs=True,
                                                       graph_sizes=(8, 16, 32),
                                                       batch_sizes=(1, 2, 4)),
}


@functools.lru_cache(maxsize=None)
def hf_model(name: str):
    return MODELS[name]()


def generate(model, forward, page_size: int):
    rec = Recorder(forward)
    engine = Engine(model, forward=rec, page_size=page_size, max_running=3, max_context_len=48,
                    max_total_tokens=160, chunked_prefill_size=16)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
               for n in PROMPT_LENS]
    return engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS)), rec.logits


@functools.lru_cache(maxsize=None)
def eager_reference(name: str, page_size: int):
    eager = from_hf(hf_model(name))
    return generate(eager, eager, page_size)


CASES = ([(name, mode, 16) for name in sorted(MODELS) for mode in sorted(MODES)]
         + [("qwen3_next", "graphs", 1), ("qwen3_next", "piecewise", 1)])


@pytest.mark.parametrize("name, mode, page_size", CASES)
def test_compiled_mode_equals_eager(name, mode, page_size):
    torch._dynamo.reset()
    want_ids, want = eager_reference(name, page_size)
    model = from_hf(hf_model(name))
    forward = MODES[mode](model)
    ids, got = generate(model, forward, page_size)
    assert ids == want_ids
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    if mode in ("graphs", "full_and_piecewise"):
        # decode steps of 3 requests (bucket 4) and, once requests finish, fewer: captured
        # once per bucket, replayed after
        assert forward.captures >= 1 and forward.replays >= 1


def test_serving_path_with_a_prompt_longer_than_a_delta_chunk_matches_generate():
    """The serving path (``full_and_piecewise``) against ``transformers``' ``generate`` itself:
    a 70-token prompt (two chunks of the chunked delta rule) and a 5-token one in one extend
    step (compiled pieces, uncaptured: 75 tokens exceed the largest piece bucket), then decode
    steps replayed as whole-step graphs (bucket 2, then 1 once the short request finishes)."""
    torch._dynamo.reset()
    hf = hf_model("qwen3_next")
    model = from_hf(hf)
    forward = MODES["full_and_piecewise"](model)
    engine = Engine(model, forward=forward, page_size=16, max_running=2, max_context_len=96,
                    max_total_tokens=256, chunked_prefill_size=128)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
               for n in (70, 5)]
    got = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert engine.stats.steps == 1 + NEW_TOKENS - 1  # one extend step for both prompts
    for prompt, out in zip(prompts, got, strict=True):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
        assert out == want
    assert forward.captures >= 1 and forward.replays >= 1
