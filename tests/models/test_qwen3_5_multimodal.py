"""Multimodal Qwen3.5 checkpoints (``qwen3_5``, ``qwen3_5_moe``): the zoo serves their text model.

Tiny random ``Qwen3_5ForConditionalGeneration`` (dense, tied LM head) and
``Qwen3_5MoeForConditionalGeneration`` (every layer MoE) models with a one-block vision tower:
``from_hf`` takes the decoder from ``model.language_model.`` and the LM head, and the engine's
logits and greedy tokens equal the multimodal model's own on text-only input. Saved to a folder,
the checkpoint loads through ``python -m compile generate --model <folder>`` (which ``--verify``
checks against ``transformers``) and its printed text is the multimodal model's greedy output.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from compile.__main__ import main  # noqa: E402
from compile.engine.engine import Engine, SamplingParams  # noqa: E402
from compile.models import SUPPORTED_MODEL_TYPES, from_hf  # noqa: E402
from compile.models.qwen3_next import Qwen3NextForCausalLM  # noqa: E402
from compile.models.qwen3_next_config import Qwen3NextConfig  # noqa: E402
from tests.models.test_llama_parity import SMALL, check_parity, random_hf  # noqa: E402
from tests.models.test_qwen3_next_parity import HYBRID, MOE, _spread_decay  # noqa: E402

VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=8,
              num_position_embeddings=16, out_hidden_size=SMALL["hidden_size"])


def multimodal_hf(moe: bool, seed: int = 0):
    """A random multimodal Qwen3.5: dense with a tied LM head, or MoE (untied)."""
    if moe:
        experts = {k: v for k, v in MOE.items() if k != "mlp_only_layers"}
        text = transformers.Qwen3_5MoeTextConfig(**{**SMALL, **HYBRID, **experts})
        cfg = transformers.Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=VISION)
        model_class = transformers.Qwen3_5MoeForConditionalGeneration
    else:
        text = transformers.Qwen3_5TextConfig(**{**SMALL, **HYBRID})
        cfg = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=VISION,
                                         tie_word_embeddings=True)
        model_class = transformers.Qwen3_5ForConditionalGeneration
    cfg.text_config._attn_implementation = "eager"
    return _spread_decay(random_hf(model_class, cfg, seed))


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def hf_multimodal(request):
    hf = multimodal_hf(moe=request.param == "qwen3_5_moe")
    assert hf.config.model_type == request.param
    return hf


def test_from_hf_serves_the_text_model(hf_multimodal):
    model = from_hf(hf_multimodal)
    assert isinstance(model, Qwen3NextForCausalLM)
    assert {"qwen3_5", "qwen3_5_moe"} <= set(SUPPORTED_MODEL_TYPES)
    cfg = Qwen3NextConfig.from_hf(hf_multimodal.config)
    moe = hf_multimodal.config.model_type == "qwen3_5_moe"
    assert cfg.split_projections and cfg.num_experts == (4 if moe else 0)
    assert cfg.tie_word_embeddings == (not moe)
    assert (model.lm_head is None) == (not moe)  # tied: the logits use the embedding
    check_parity(hf_multimodal, model, 1, vocab=SMALL["vocab_size"],
                 label=hf_multimodal.config.model_type, prompt_lens=(9, 5))


def test_greedy_tokens_equal_the_multimodal_generate(hf_multimodal):
    model = from_hf(hf_multimodal)
    prompts = [[5, 9, 2, 40, 77, 13], [60, 1, 8]]
    engine = Engine(model, page_size=4, max_running=2, max_total_tokens=64)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=5))
    for prompt, out in zip(prompts, outs):
        want = hf_multimodal.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
        assert out == want


def byte_tokenizer():
    """Qwen3.5's own tokenizer class over a 97-token vocabulary without merges: id 0 is
    ``<|endoftext|>``, 1-94 the printable ASCII characters, 95 a space, 96 a newline."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer
    vocab = {"<|endoftext|>": 0, **{chr(c): c - 32 for c in range(33, 127)}, "\u0120": 95,
             "\u010a": 96}
    assert len(vocab) == SMALL["vocab_size"]
    return Qwen3_5Tokenizer(vocab=vocab, merges=[])


def test_cli_generates_from_a_multimodal_folder(tmp_path, capsys):
    """The saved checkpoint keeps the multimodal names (``model.language_model.``, the vision
    tower) and ``model_type: qwen3_5``; the CLI serves its text model (tied LM head included)
    and prints the multimodal model's greedy text."""
    hf = multimodal_hf(moe=False, seed=1)
    hf.save_pretrained(tmp_path)
    tokenizer = byte_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    prompt = "Hi there"
    code = main(["generate", "--model", str(tmp_path), "--prompt", prompt, "--device", "cpu",
                 "--max-new-tokens", "4", "--verify", "--no-progress", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    ids = tokenizer(prompt)["input_ids"]
    assert ids == [40, 73, 95, 84, 72, 69, 82, 69]
    want = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, eos_token_id=0,
                       pad_token_id=0)[0, len(ids):].tolist()
    text = tokenizer.decode(want, skip_special_tokens=True)
    assert f"--- prompt 0: {prompt!r}\n{text}\n" in out, out


def test_usage_names_every_supported_model_type():
    """docs/USAGE.md's list of folder ``model_type``s is ``SUPPORTED_MODEL_TYPES``."""
    from pathlib import Path
    text = " ".join((Path(__file__).parents[2] / "docs" / "USAGE.md").read_text().split())
    listed = text.split("`compile.models.SUPPORTED_MODEL_TYPES`: ", 1)[1].split(". ", 1)[0]
    names = listed.replace(" and ", ", ").split(", ")
    assert sorted(names) == sorted(SUPPORTED_MODEL_TYPES)
