"""``python -m compile check`` on DeepSeek models: each layer's attention (dense or sparse MLA)
and the KV and DSA index-key bytes per token (and a DSA model's latent bytes in an fp8 latent
cache); a tiny DeepSeek-V3.2 traces whole (fullgraph, no
break) and splits into ``num_layers + 1`` pieces."""

from __future__ import annotations

from compile.engine.cli_check import (CheckResult, MLACacheBytes, attention_kinds, check_model,
                                      format_result, mla_cache_bytes)
from compile.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from tests.compile.backend.test_dsa_backend import tiny_v32
from tests.compile.compile_helpers import tiny_model


def test_attention_kinds_and_cache_bytes():
    v32 = tiny_v32()
    assert attention_kinds(v32) == ["sparse MLA (top-k 4)"] * 2
    # per layer: latent (R + r) float32 = (16 + 8) * 4; index key Di fp8 + a float32 scale
    assert mla_cache_bytes(v32) == MLACacheBytes(latent=(16 + 8) * 4, index=16 + 4, layers=2)
    v2 = DeepseekV2ForCausalLM(DeepseekV2Config(num_hidden_layers=3, kv_lora_rank=16,
                                                qk_rope_head_dim=8))
    assert attention_kinds(v2) == ["dense MLA"] * 3
    assert mla_cache_bytes(v2) == MLACacheBytes(latent=(16 + 8) * 4, index=0, layers=3)
    assert mla_cache_bytes(tiny_model()) is None
    # R = 128: an fp8 latent cache holds 128 e4m3 values, one float32 scale, 8 bfloat16 rope
    assert mla_cache_bytes(tiny_v32(kv_lora_rank=128)).latent_fp8 == 128 + 4 + 2 * 8


def test_check_reports_sparse_layers_and_traces_whole():
    result = check_model(tiny_v32(kv_lora_rank=128))
    assert result.ok and result.graph_breaks == 0
    assert result.pieces_per_graph == 3  # num_layers + 1
    text = format_result("tiny-v32", result, "eager")
    assert "2 x sparse MLA (top-k 4) (layers 0-1)" in text
    # latent (128 + 8) * 4 float32 = 544 bytes, index 16 + 4; fp8 latent 128 + 4 + 2 * 8 = 148
    assert "MLA latent 544 bytes, DSA index keys 20 bytes; all 2 layers: 1088 + 40 = 1128" in text
    assert ("with an fp8 latent cache (kv_dtype float8_e4m3fn): MLA latent 148 bytes per token "
            "and layer; all 2 layers: 336 bytes per token") in text, text


def test_dense_mla_report_names_no_index_keys():
    """A DeepSeek-V2/V3 model has no DSA indexer: its line gives the latent bytes alone."""
    result = CheckResult(num_layers=3, graph_breaks=0, break_reasons={}, graphs=2,
                         pieces_per_graph=4, split_ops=3, ids_match=True,
                         attention=["dense MLA"] * 3,
                         mla_bytes=MLACacheBytes(latent=192, index=0, layers=3))
    text = format_result("v3", result, "eager")
    assert ("KV cache per token and layer: MLA latent 192 bytes; all 3 layers: 576 bytes per "
            "token") in text, text
    assert "index" not in text, text
