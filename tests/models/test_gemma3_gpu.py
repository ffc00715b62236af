"""Gemma 3 270M's shape on the GPU in graph modes: greedy ids equal ``transformers``' ``generate``.

The real checkpoint (253 MB) cannot reach the GPU machine, so this builds the same architecture
(18 layers, 15 sliding-window layers of window 512 and 3 global, 1 KV head of 256, 262k
vocabulary) with ``transformers``' own initialisation, float32, and runs it through the engine
on the hybrid SWA pool with decode steps captured as device graphs (``graphs``) or pieces and
full graphs (``full_and_piecewise``). One prompt is longer than the window and the prefill
chunk, so SWA pages are freed before the captured decode steps run.
Run on the GPU machine: ``python -m pytest -m gpu tests/models/test_gemma3_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.markers import requires_gpu_graphs

transformers = pytest.importorskip("transformers")

from compile.__main__ import make_forward  # noqa: E402
from compile.engine.engine import Engine, SamplingParams  # noqa: E402
from compile.graphs import device as dev  # noqa: E402
from compile.models import from_hf  # noqa: E402

# Gemma 3 270M as its GGUF's config reads in transformers (Gemma3TextConfig defaults elsewhere)
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                   num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=256, sliding_window=512, max_position_embeddings=32768,
                   query_pre_attn_scalar=256, rms_norm_eps=1e-6)
PROMPT_LENS = (700, 37, 5)
NEW_TOKENS = 24


def hf_greedy(hf_model, prompts, device) -> list[list[int]]:
    outs = []
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            y = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    return outs


@requires_gpu_graphs
@pytest.mark.parametrize("mode", ["graphs", "full_and_piecewise"])
def test_gemma3_270m_shape_graph_modes_match_transformers(mode):
    device = dev.as_device()
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3_270M))
    hf = hf.to(device).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, GEMMA3_270M["vocab_size"], (n,), generator=g).tolist()
               for n in PROMPT_LENS]
    expected = hf_greedy(hf, prompts, device)
    model = from_hf(hf)
    torch._dynamo.reset()
    forward = make_forward(model, mode)
    engine = Engine(model, forward=forward, page_size=16, max_running=len(prompts),
                    max_context_len=1024, max_total_tokens=3 * 1024, chunked_prefill_size=512)
    got = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert engine.swa_pages is not None
    assert got == expected
    assert forward.captures >= 1 and forward.replays >= 1
