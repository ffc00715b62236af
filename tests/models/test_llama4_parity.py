"""Logits parity of the zoo's Llama 4 (iRoPE chunked local attention) with ``transformers``.

Tiny random-weight ``Llama4ForCausalLM`` text models (4 layers: three RoPE layers with chunked
local attention, chunk 8, and one NoPE layer with global attention and temperature tuning) are
copied with ``from_hf`` and run through the engine (paged KV cache, chunked prefill of 7 tokens
so prefill chunks straddle attention chunks, then decode steps) at page sizes 1 and 4. Prompts of
up to 27 tokens cross three attention chunks. Every recorded logit row must equal the
``transformers`` full forward at its position. Mutation tests show the check catches a model that
ignores the chunking, the temperature tuning, the QK norm or the interleaved RoPE layout.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Llama4ForCausalLM"):
    pytest.skip("transformers has no Llama4ForCausalLM", allow_module_level=True)

from compile.models import Llama4Config, Llama4ForCausalLM, ModelConfig, from_hf  # noqa: E402
from compile.models.llama4 import Llama4MoE  # noqa: E402
from tests.models import test_llama_parity as llama_parity  # noqa: E402

VOCAB, CHUNK = 97, 8
PROMPT_LENS = (27, 9, 20)  # 27 + 3 decodes spans attention chunks 0..3
TINY = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=40, intermediate_size_mlp=80,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
            max_position_embeddings=128, attention_chunk_size=CHUNK,
            floor_scale=4, attn_scale=0.5)  # temperature > 1 from position 3 on
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=16)

VARIANTS = {
    "dense_tied_qk_norm": dict(moe_layers=[], tie_word_embeddings=True, use_qk_norm=True,
                               rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "moe_bias_llama3_rope": dict(moe_layers=[1, 3], num_local_experts=4, num_experts_per_tok=2,
                                 attention_bias=True, use_qk_norm=False,
                                 rope_parameters=LLAMA3_ROPE),
}


def make_hf(variant: str, seed: int = 0):
    cfg = transformers.Llama4TextConfig(**TINY, **VARIANTS[variant])
    return llama_parity.random_hf(transformers.Llama4ForCausalLM, cfg, seed)


def check_parity(hf, model, page_size: int, prompt_lens=PROMPT_LENS) -> int:
    """Engine vs ``transformers`` logits of every prompt and decode row of random prompts of
    ``prompt_lens`` tokens (shared parity check); returns the rows checked."""
    return llama_parity.check_parity(hf, model, page_size, vocab=VOCAB, label="llama4",
                                     prompt_lens=prompt_lens)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant, page_size):
    hf = make_hf(variant)
    model = from_hf(hf)
    assert isinstance(model, Llama4ForCausalLM)
    irope = [layer.self_attn.attn.use_irope for layer in model.model.layers]
    assert irope == [True, True, True, False]  # every 4th layer is NoPE and global
    checked = check_parity(hf, model, page_size)
    assert checked == sum(PROMPT_LENS) + 3 * 3  # prompt rows + (max_new_tokens - 1) decodes


def _full_attention(model):
    for layer in model.model.layers:
        layer.self_attn.attn.use_irope = False


def _no_temperature(model):
    model.model.layers[3].self_attn.temperature_tuning = False


def _no_qk_norm(model):
    for layer in model.model.layers:
        layer.self_attn.qk_l2_norm = False


def _neox_rope(model):
    def neox(x, cos, sin):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    model.model.layers[0].self_attn.rotary_emb._rotate = neox


@pytest.mark.parametrize("mutate, first_bad", [
    (_full_attention, "request 0 pos 8"),  # first query past the first chunk
    (_no_temperature, "request 0 pos 3"),  # floor((3 + 1) / floor_scale 4) = 1
    (_no_qk_norm, "request 0 pos 1"),  # one key: softmax is 1 at any scale
    (_neox_rope, "request 0 pos 1"),  # position 0 is not rotated
], ids=["chunked_as_full", "no_temperature", "no_qk_norm", "neox_rope"])
def test_mutated_model_fails(mutate, first_bad):
    """The test can fail: each Llama 4 feature, turned off, breaks parity where it first acts
    (one 27-token prompt is enough)."""
    hf = make_hf("dense_tied_qk_norm")
    model = from_hf(hf)
    mutate(model)
    with pytest.raises(AssertionError, match=first_bad):
        check_parity(hf, model, page_size=4, prompt_lens=PROMPT_LENS[:1])


def test_config_reads_llama4_options():
    hf = make_hf("moe_bias_llama3_rope")
    cfg = ModelConfig.from_hf(hf.config)
    assert isinstance(cfg, Llama4Config)
    assert cfg.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    assert cfg.use_rope == [True, True, True, False] and cfg.attention_chunk_size == CHUNK
    assert cfg.moe_layers == [1, 3] and cfg.intermediate_size_mlp == 80
    assert cfg.o_proj_bias and not cfg.qk_l2_norm and cfg.attn_temperature_tuning
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.floor_scale == 4.0
    model = from_hf(hf)
    assert [isinstance(layer.feed_forward, Llama4MoE) for layer in model.model.layers] == [
        False, True, False, True]


@pytest.mark.parametrize("kwargs, match", [
    (dict(moe_layers=[4]), "moe_layers must be layer ids below 4"),
    (dict(moe_layers=[0], num_local_experts=2, num_experts_per_tok=3), "num_experts_per_tok"),
    (dict(qk_norm=True), "set qk_l2_norm=True"),
])
def test_config_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Llama4Config(num_hidden_layers=4, **kwargs)


def test_from_hf_rejects_other_model_types():
    with pytest.raises(NotImplementedError, match="expected 'llama4_text'"):
        Llama4Config.from_hf(transformers.LlamaConfig(num_hidden_layers=1))
