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


def _sharing_layers(windows=(-1, -1, -1, -1)):
    """Four PagedAttention layers; layers 2 and 3 read the caches of layers 0 and 1."""
    return nn.ModuleList([PagedAttention(4, 8, 0.1, 2, layer_id=i, sliding_window_size=w,
                                         kv_sharing_target_layer_id=(i - 2 if i >= 2 else None))
                          for i, w in enumerate(windows)])


def test_kv_sharing_layers_get_no_buffers():
    layout = kv_layout(_sharing_layers())
    assert layout.kv_sharing == ((2, 0), (3, 1)) and layout.cache_layer_ids == (0, 1)
    pool = make_kv_pool(layout, 32, 16, torch.float32, "cpu")
    for layer, target in layout.kv_sharing:  # the target's buffers themselves
        assert pool.get_key_buffer(layer) is pool.get_key_buffer(target)
        assert pool.get_value_buffer(layer) is pool.get_value_buffer(target)
    assert len({b.data_ptr() for b in pool.k_buffer + pool.v_buffer}) == 4  # 2 layers x K, V
    per_slot = 2 * (2 * 8) * 4  # a K and a V row of Hkv * D float32 each
    slots = 16 + 16  # one request's page and page 0
    nbytes = kv_cache_bytes(layout, 16, page_size=16, dtype=torch.float32)
    assert nbytes.full == nbytes.hybrid == 2 * slots * per_slot  # 2 layers with buffers, not 4


def test_kv_sharing_in_a_hybrid_pool():
    layout = kv_layout(_sharing_layers(windows=(-1, 3, -1, 3)))  # 3 reads 1: both sliding
    pool, _ = hybrid_kv_pool(layout, size=64, page_size=16, dtype=torch.float32, device="cpu",
                             max_running=1, prefill_chunk=8, max_context_len=32)
    assert pool.get_key_buffer(3) is pool.get_key_buffer(1) and pool.is_swa_layer(3)
    assert pool.get_value_buffer(2) is pool.get_value_buffer(0) and not pool.is_swa_layer(2)
    assert len(pool.full_kv_pool.k_buffer) == len(pool.swa_kv_pool.k_buffer) == 2
    assert len({b.data_ptr() for b in pool.full_kv_pool.k_buffer}) == 1
    assert len({b.data_ptr() for b in pool.swa_kv_pool.k_buffer}) == 1
