"""A Gemma 3 model on the hybrid sliding-window pool in every compiled mode equals eager.

The zoo's tiny Gemma 3 (two local layers, window 4, one global layer) runs prompts longer than
the window and than a page through the engine, so SWA pages are evicted while the compiled
code runs. Modes as ``python -m compile`` builds them, on the CPU: ``torch.compile`` through
``compile_model`` (Dynamo, eager backend: tracing and guards are what differ from eager; the
default model's Inductor run is the main job's), piecewise with graph capture emulated
(``emulate_graphs=True``: the bucket, capture and replay path), full decode graphs
(``GraphRunner``: the step-buffer step the GPU captures, captured and replayed as a
``TapeGraph``, so host decisions of the capture stay frozen as on a GPU) and full_and_piecewise.
"""

from __future__ import annotations

import functools

import pytest
import torch

from compile.graphs import GraphRunner, PiecewiseModel, compile_model, full_and_piecewise
from compile.engine import Engine, SamplingParams
from tests.compile.batch.test_swa_pages import Recorder, tiny_gemma3

PROMPT_LENS = (21, 6)
NEW_TOKENS = 6

MODES = {
    "compile": lambda m: compile_model(m, backend="eager"),
    "piecewise": lambda m: PiecewiseModel(m, inductor=False, emulate_graphs=True,
                                          graph_sizes=(8, 16, 32)),
    "graphs": lambda m: GraphRunner(m, forward=compile_model(m, backend="eager"),
                                    emulate_graphs=True),
    "full_and_piecewise": lambda m: full_and_piecewise(m, inductor=False, emulate_graphs=True,
                                                       graph_sizes=(8, 16, 32)),
}


def generate(model, forward, page_size: int):
    rec = Recorder(forward)
    engine = Engine(model, forward=rec, page_size=page_size, max_running=2, max_context_len=48,
                    max_total_tokens=96, chunked_prefill_size=16)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
               for n in PROMPT_LENS]
    ids = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert engine.swa_pages is not None and engine.swa_pages.available_pages() > 0
    return ids, rec.logits


@functools.lru_cache(maxsize=None)
def eager_reference(page_size: int):
    """Eager ids and per-step logits, computed once per page size for every mode's case."""
    eager = tiny_gemma3()
    return generate(eager, eager, page_size)


# every mode at page size 16; page size 1 (slot tables) where the step buffers differ most
CASES = [(mode, 16) for mode in sorted(MODES)] + [("graphs", 1), ("piecewise", 1)]


@pytest.mark.parametrize("mode, page_size", CASES)
def test_compiled_mode_equals_eager(mode, page_size):
    torch._dynamo.reset()
    want_ids, want = eager_reference(page_size)
    model = tiny_gemma3()
    ids, got = generate(model, MODES[mode](model), page_size)
    assert ids == want_ids
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
