"""``compile.backend.layer.kv_layout`` and ``compile.batch.kv_layout``: the pool facts of a model
come from its attention layers, and the pool they give has one buffer of the right shape per
layer (MHA, MLA); the facts are checked against the model's config, written independently."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compile.backend import PagedAttention, kv_layout
from compile.batch import (KVLayout, MHATokenToKVPool, MLATokenToKVPool, hybrid_kv_pool,
                           kv_cache_bytes, make_kv_pool)
from compile.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from tests.compile.compile_helpers import tiny_model


def test_llama_with_sliding_layers():
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    model = tiny_model(4, layer_types=types, sliding_window=5)
    cfg = model.config
    layout = kv_layout(model)
    assert layout == KVLayout(num_layers=4, head_num=cfg.num_key_value_heads,
                              head_dim=cfg.head_dim, v_head_dim=cfg.head_dim,
                              swa_layer_ids=(1, 3), sliding_window=5)
    assert layout.full_layer_ids == (0, 2) and layout.qk_rope_head_dim == 0
    assert kv_layout(tiny_model(2)).swa_layer_ids == ()
    assert kv_layout(tiny_model(2)).sliding_window is None


def test_deepseek_v2_mla_layout_and_pool():
    cfg = DeepseekV2Config(vocab_size=64, num_hidden_layers=2)
    layout = kv_layout(DeepseekV2ForCausalLM(cfg))
    assert (layout.kv_lora_rank, layout.qk_rope_head_dim) == (cfg.kv_lora_rank,
                                                              cfg.qk_rope_head_dim)
    pool = make_kv_pool(layout, 32, 16, torch.float32, "cpu")
    assert isinstance(pool, MLATokenToKVPool) and pool.layer_num == 2
    assert pool.get_key_buffer(1).shape == (32, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def test_mha_pool_with_another_value_head_dim():
    pool = make_kv_pool(KVLayout(num_layers=3, head_num=2, head_dim=8, v_head_dim=4), 48, 16,
                        torch.float32, "cpu")
    assert isinstance(pool, MHATokenToKVPool) and len(pool.k_buffer) == 3
    assert pool.get_key_buffer(2).shape == (48, 2, 8)
    assert pool.get_value_buffer(2).shape == (48, 2, 4)


def test_a_model_without_attention_layers_is_rejected():
    with pytest.raises(ValueError, match="kv_layout: model has no PagedAttention layer; "
                                         "expected .* got Linear"):
        kv_layout(nn.Linear(2, 2))


def test_layers_of_two_shapes_are_rejected():
    model = nn.ModuleList([PagedAttention(4, 8, 0.1, 2, layer_id=0),
                           PagedAttention(4, 16, 0.1, 2, layer_id=1)])
    with pytest.raises(ValueError, match=r"kv_layout: layer 1 has \(Hkv, D, Dv\) \(2, 16, 16\); "
                                         r"expected the same as layer 0"):
        kv_layout(model)


@pytest.mark.parametrize("call", [
    lambda cfg: make_kv_pool(cfg, 32, 16, torch.float32, "cpu"),
    lambda cfg: kv_cache_bytes(cfg, 64),
    lambda cfg: hybrid_kv_pool(cfg, size=32, page_size=16, dtype=torch.float32, device="cpu",
                               max_running=1, prefill_chunk=8, max_context_len=32)],
    ids=["make_kv_pool", "kv_cache_bytes", "hybrid_kv_pool"])
def test_a_model_config_instead_of_a_layout_is_a_type_error(call):
    with pytest.raises(TypeError, match=r"\w+: layout must be a KVLayout; expected the model's "
                                        r"KV facts, got ModelConfig. Pass compile.backend"):
        call(tiny_model(2).config)
