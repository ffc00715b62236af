"""DeepSeek-V3.2 (DSA sparse MLA) on the GPU: greedy ids in eager and graph modes equal
``transformers``' ``generate`` with the fp8-rounded indexer (``test_deepseek_v32_parity``'s
reference), decode steps captured as device graphs; an fp8 latent cache gives the same ids in
graphs mode as eager.

The tiny random model of ``test_deepseek_v32_parity`` with index top-k 16, float32, prompts of
120, 37 and 5 tokens (chunked prefill of 64: sparse extend over a cached prefix; the 5-token
request alone would be dense), page sizes 1 and 64; the GPU's providers (Triton) run the
indexer and sparse MLA ops.
Run on the GPU machine: ``python -m pytest -m gpu tests/models/test_deepseek_v32_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.markers import requires_gpu_graphs

transformers = pytest.importorskip("transformers")

from compile.__main__ import hf_generate, make_forward  # noqa: E402
from compile.engine.engine import Engine, SamplingParams  # noqa: E402
from compile.graphs import device as dev  # noqa: E402
from compile.models import from_hf  # noqa: E402
from tests.models import test_deepseek_v32_parity as v32  # noqa: E402

TOPK, PROMPT_LENS, NEW_TOKENS = 16, (120, 37, 5), 16


@requires_gpu_graphs
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("mode", ["eager", "graphs", "full_and_piecewise"])
def test_dsa_graph_modes_match_transformers(mode, page_size):
    device = dev.as_device()
    hf = v32.make_hf(TOPK).to(device)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, v32.VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    with v32.fp8_indexer(), torch.no_grad():
        expected = hf_generate(hf, prompts, NEW_TOKENS, ())
    model = from_hf(hf)
    torch._dynamo.reset()
    forward = make_forward(model, mode)
    engine = Engine(model, forward=forward, page_size=page_size, max_running=len(prompts),
                    max_context_len=160, max_total_tokens=3 * 192, chunked_prefill_size=64)
    assert engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS)) == expected
    if mode != "eager":
        assert forward.captures >= 1 and forward.replays >= 1


@requires_gpu_graphs
def test_fp8_latent_cache_graphs_equal_eager():
    """An fp8 latent cache (FlashMLA's fp8 tokens, R = 128) on the GPU's providers: chunked
    sparse prefill and decode in graphs mode give the eager ids."""
    device = dev.as_device()
    model = from_hf(v32.make_hf(TOPK, kv_lora_rank=128).to(device))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, v32.VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    ids = []
    for mode in ("eager", "graphs"):
        torch._dynamo.reset()
        engine = Engine(model, forward=make_forward(model, mode), page_size=64,
                        max_running=len(prompts), max_context_len=160,
                        max_total_tokens=3 * 192, chunked_prefill_size=64,
                        kv_dtype=torch.float8_e4m3fn)
        assert engine.token_to_kv_pool.fp8_latent
        ids.append(engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS)))
    assert ids[0] == ids[1]
