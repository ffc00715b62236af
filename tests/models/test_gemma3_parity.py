"""Gemma 3 (``compile.models.gemma3``): logits parity with ``transformers`` on random weights.

Tiny ``Gemma3TextConfig`` models go through the engine (paged KV cache, chunked prefill over a
cached prefix, decode; ``test_llama_parity.check_parity``) and every logit row is compared with
``transformers``' ``Gemma3ForCausalLM`` on the same sequence. The window (4 tokens) is shorter
than the prompts and the prefill chunks, so the sliding-window layers' masks, their own RoPE
base and the global layers' scaled RoPE all show in the logits.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from compile.models import Gemma3Config, Gemma3ForCausalLM, ModelConfig, from_hf  # noqa: E402
from compile.models.config import CONFIG_MODEL_TYPES, SUPPORTED_MODEL_TYPES  # noqa: E402
from tests.models.test_llama_parity import SMALL, check_parity, random_hf  # noqa: E402

# 5 local : 1 global would need 6 layers; 2 : 1 keeps the same structure at half the cost.
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}


def gemma3_text_config(**extra):
    return transformers.Gemma3TextConfig(**{
        **SMALL, "num_hidden_layers": len(LAYER_TYPES), "layer_types": LAYER_TYPES,
        "sliding_window": 4, "query_pre_attn_scalar": 12, "rope_parameters": ROPE, **extra})


@pytest.fixture(scope="module")
def hf_gemma3():
    return random_hf(transformers.Gemma3ForCausalLM,
                     gemma3_text_config(final_logit_softcapping=6.0))


@pytest.mark.parametrize("page_size", [1, 16])
def test_logits_match_transformers(hf_gemma3, page_size):
    model = from_hf(hf_gemma3)
    assert isinstance(model, Gemma3ForCausalLM)
    check_parity(hf_gemma3, model, page_size, vocab=SMALL["vocab_size"], label="gemma3_text")


def test_multimodal_gemma3_loads_its_text_part():
    text = gemma3_text_config(num_hidden_layers=2, layer_types=LAYER_TYPES[1:3])
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=16, patch_size=8)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                    mm_tokens_per_image=4)
    cfg.text_config._attn_implementation = "eager"
    hf = random_hf(transformers.Gemma3ForConditionalGeneration, cfg)
    model = from_hf(hf)
    assert model.config.layer_types == LAYER_TYPES[1:3]
    check_parity(hf, model, 1, vocab=SMALL["vocab_size"], label="gemma3", prompt_lens=(9, 5))


def test_config_reads_gemma3_options(hf_gemma3):
    cfg = ModelConfig.from_hf(hf_gemma3.config)
    assert isinstance(cfg, Gemma3Config)
    assert cfg.layer_types == LAYER_TYPES and cfg.sliding_window == 4
    assert cfg.layer_rope(0) == (1e4, None)
    assert cfg.layer_rope(2) == (1e6, {"rope_type": "linear", "factor": 2.0})
    assert cfg.qk_norm and cfg.sandwich_norm and cfg.norm_weight_offset == 1.0
    assert cfg.scaling == 12 ** -0.5 and cfg.final_logit_softcap == 6.0
    assert cfg.embed_scale == SMALL["hidden_size"] ** 0.5 and cfg.tie_word_embeddings
    model = Gemma3ForCausalLM(cfg)
    layers = model.model.layers
    assert [lay.self_attn.attn.sliding_window_size for lay in layers] == [3, 3, -1, 3]
    local, glob = layers[0].self_attn.rotary_emb, layers[2].self_attn.rotary_emb
    assert layers[1].self_attn.rotary_emb is local and local is not glob
    # position 1, feature 1 rotates by base ** (-2 / D), over the factor on global layers
    d = SMALL["head_dim"]
    torch.testing.assert_close(local.sin_cached[1, 1], torch.tensor(1e4 ** (-2 / d)).sin())
    torch.testing.assert_close(glob.sin_cached[1, 1], torch.tensor(1e6 ** (-2 / d) / 2).sin())


def test_bidirectional_gemma3_is_rejected():
    cfg = gemma3_text_config(use_bidirectional_attention=True)
    with pytest.raises(NotImplementedError, match="use_bidirectional_attention"):
        ModelConfig.from_hf(cfg)


def test_unsupported_model_type_names_every_supported_one():
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2))
    with pytest.raises(NotImplementedError) as info:
        from_hf(hf)
    assert str(info.value) == ("from_hf: model_type 'gpt2' is not supported; expected one of "
                               f"{', '.join(SUPPORTED_MODEL_TYPES)}.")
    assert {"gemma3_text", "gemma3", "deepseek_v2", "llama4_text"} <= set(SUPPORTED_MODEL_TYPES)
    with pytest.raises(NotImplementedError) as info:  # DeepSeek-V2 has a config of its own
        ModelConfig.from_hf(transformers.DeepseekV2Config())
    assert str(info.value).endswith(f"expected one of {', '.join(CONFIG_MODEL_TYPES)}.")
    assert "deepseek_v2" not in CONFIG_MODEL_TYPES and "gemma3_text" in CONFIG_MODEL_TYPES
