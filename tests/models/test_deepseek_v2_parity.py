"""Logits parity of the zoo's DeepSeek-V2 (MLA, absorbed) with ``transformers`` on random weights.

A tiny ``DeepseekV2ForCausalLM`` (dense layers; MoE layers: ``test_deepseek_moe_parity``) is
copied with ``deepseek_v2.from_hf`` and
run through the engine on an MLA latent pool: chunked prefill (chunk 7, so later chunks attend a
cached prefix through the absorbed ``qv`` path), then decode steps (``flash_mla_decode``). Every
recorded logit row must equal the ``transformers`` full forward at its position.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV2ForCausalLM"):
    pytest.skip("transformers has no DeepseekV2ForCausalLM", allow_module_level=True)

from compile.models import deepseek_v2  # noqa: E402
from tests.models import test_llama_parity as llama_parity  # noqa: E402

VOCAB = 128
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=16, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, max_position_embeddings=128,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0))


def make_hf(q_lora_rank, seed: int = 0):
    cfg = transformers.DeepseekV2Config(**TINY, q_lora_rank=q_lora_rank)
    return llama_parity.random_hf(transformers.DeepseekV2ForCausalLM, cfg, seed)


def check_parity(hf, model, page_size: int) -> int:
    """Engine vs transformers logits of every prompt and decode row (shared parity check)."""
    return llama_parity.check_parity(hf, model, page_size, vocab=VOCAB, label="deepseek_v2")


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["q_proj", "q_lora"])
def test_logits_match_transformers(q_lora_rank, page_size, monkeypatch):
    import xpu_ops
    calls = []
    real = xpu_ops.flash_mla_decode
    monkeypatch.setattr(xpu_ops, "flash_mla_decode",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    hf = make_hf(q_lora_rank)
    model = deepseek_v2.from_hf(hf)
    checked = check_parity(hf, model, page_size)
    assert len(calls) == 3 * 2  # decode steps (all 3 requests batched) x layers
    assert checked == (11 + 5 + 9) + 3 * 3  # prompt rows + (max_new_tokens - 1) decodes each


def test_half_rotate_rope_fails():
    """The test can fail: a neox (rotate-half) RoPE on the rope part breaks parity."""
    hf = make_hf(None)
    model = deepseek_v2.from_hf(hf)
    rotary = model.model.layers[0].self_attn.rotary_emb

    def neox(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    rotary._rotate = neox
    with pytest.raises(AssertionError, match="request 0 pos 1"):
        check_parity(hf, model, page_size=4)


def test_config_reads_moe_layers():
    """Layers from ``first_k_dense_replace`` on are MoE (parity: test_deepseek_moe_parity)."""
    cfg = transformers.DeepseekV2Config(**{**TINY, "first_k_dense_replace": 1})
    ours = deepseek_v2.DeepseekV2Config.from_hf(cfg)
    assert ours.mlp_layer_types == ("dense", "sparse")
    assert (ours.moe.n_routed_experts, ours.moe.num_experts_per_tok) == (4, 2)
    assert ours.moe.scoring_func == "softmax" and not ours.moe.grouped


def test_generic_from_hf_dispatches_to_deepseek_v2():
    from compile.models import from_hf
    hf = make_hf(None)
    model = from_hf(hf)
    assert isinstance(model, deepseek_v2.DeepseekV2ForCausalLM)
    check_parity(hf, model, page_size=4)
