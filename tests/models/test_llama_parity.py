"""Logits parity of the zoo's Llama-family models with ``transformers`` on random weights.

Each case builds a small ``transformers`` model, copies it with ``from_hf`` and runs it through
the engine (paged KV cache, chunked prefill over a cached prefix, then decode steps), recording
the logits of every token of every step. The same sequences then go through the
``transformers`` model in one full forward; every recorded row must match its position there.
"""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

transformers = pytest.importorskip("transformers")

from compile.engine.engine import Engine, SamplingParams  # noqa: E402
from compile.models import ModelConfig, from_hf  # noqa: E402

SMALL = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=128)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=16)

VARIANTS = {
    # name: (config class, model class, extra config)
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama_mqa_tied_llama3_rope": ("LlamaConfig", "LlamaForCausalLM",
                                   dict(num_key_value_heads=1, tie_word_embeddings=True,
                                        rope_parameters=LLAMA3_ROPE)),
    "qwen2_qkv_bias": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3_qk_norm_per_layer_window": (
        "Qwen3Config", "Qwen3ForCausalLM",
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=0,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "mistral_sliding_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6)),
    "gemma2_softcap_sandwich": (
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(sliding_window=4, attn_logit_softcapping=4.0, final_logit_softcapping=6.0,
             query_pre_attn_scalar=12, hidden_activation="gelu_pytorch_tanh")),
    "gpt_oss_sinks_moe": (
        "GptOssConfig", "GptOssForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
}


def random_hf(model_class, cfg, seed: int = 0):
    """``model_class(cfg)`` in eval mode with eager attention and N(0, 0.15**2) weights."""
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = model_class(cfg).eval()
    with torch.no_grad():  # larger than the default init, so mistakes show in the logits
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    return hf


def make_hf(variant: str, seed: int = 0):
    cfg_name, model_name, extra = VARIANTS[variant]
    cfg = getattr(transformers, cfg_name)(**{**SMALL, **extra})
    return random_hf(getattr(transformers, model_name), cfg, seed)


class Recorder:
    """Engine forward that keeps every token's logits, keyed by (request id, position)."""

    def __init__(self, model):
        self.model, self.rows, self.engine = model, {}, None

    def __call__(self, input_ids, positions, fb):
        logits = self.model(input_ids, positions, fb, return_all_logits=True)
        rids = [r.rid for r in self.engine.last_batch_reqs]
        counts = fb.extend_seq_lens_cpu if fb.forward_mode.is_extend() else [1] * len(rids)
        owners = [rid for rid, n in zip(rids, counts) for _ in range(n)]
        for row, (rid, pos) in enumerate(zip(owners, positions.tolist())):
            self.rows[(rid, pos)] = logits[row]
        if not fb.forward_mode.is_extend():
            return logits
        return logits[torch.cumsum(fb.extend_seq_lens, 0) - 1]


def run_paged(model, prompts, page_size: int, max_new_tokens: int = 4, chunk: int = 7):
    rec = Recorder(model)
    engine = Engine(model, forward=rec, page_size=page_size, max_running=4,
                    max_context_len=64, max_total_tokens=256, chunked_prefill_size=chunk)
    rec.engine = engine
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    return outs, rec.rows


def check_parity(hf, model, page_size: int, vocab: int, label: str = "",
                 prompt_lens: Sequence[int] = (11, 5, 9)) -> int:
    """Run random prompts of ``prompt_lens`` tokens through the engine (``run_paged``) and
    compare every prompt and decode logit row with ``hf`` on the same token sequence; returns
    the rows checked."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    outs, rows = run_paged(model, prompts, page_size)
    checked = 0
    for rid, (prompt, out) in enumerate(zip(prompts, outs)):
        seq = prompt + out[:-1]  # the last sampled token was never fed back
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        for pos in range(len(seq)):
            torch.testing.assert_close(rows[(rid, pos)], ref[pos], atol=2e-4, rtol=1e-4,
                                       msg=lambda m: f"{label} request {rid} pos {pos}: {m}")
            checked += 1
    assert checked == sum(len(p) + 3 for p in prompts)  # prompt + (max_new_tokens - 1) decodes
    return checked


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant, page_size):
    hf = make_hf(variant)
    check_parity(hf, from_hf(hf), page_size, vocab=97, label=variant)


@pytest.mark.parametrize("variant", ["llama_mqa_tied_llama3_rope", "qwen2_qkv_bias"])
def test_cpu_models_store_linear_weights_column_major(variant):
    """On the CPU ``from_hf(cpu_column_major=True)`` stores every linear weight (and a tied
    embedding, which the LM head reads) column-major with the same values; the default keeps
    them row-major. The column-major model's logits match ``transformers`` too."""
    hf = make_hf(variant)
    col, row = from_hf(hf, cpu_column_major=True), from_hf(hf)
    linears = [(n, m.weight) for n, m in col.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) >= 4 * SMALL["num_hidden_layers"]
    tied = col.lm_head is None
    assert tied == (variant == "llama_mqa_tied_llama3_rope")
    if tied:
        linears.append(("model.embed_tokens", col.model.embed_tokens.weight))
    rows = dict(row.named_parameters())
    for name, w in linears:
        assert w.stride() == (1, w.shape[0]), name
        assert rows[name + ".weight"].is_contiguous(), name
        assert torch.equal(w, rows[name + ".weight"]), name
    ids = torch.tensor([3, 41, 7])
    torch.testing.assert_close(col.model.embed_tokens(ids), row.model.embed_tokens(ids),
                               atol=0, rtol=0)
    check_parity(hf, col, 4, vocab=97, label=f"{variant} column-major")


def test_config_reads_every_variant_option():
    cfg = ModelConfig.from_hf(make_hf("gemma2_softcap_sandwich").config)
    assert cfg.attn_logit_softcap == 4.0 and cfg.final_logit_softcap == 6.0
    assert cfg.sandwich_norm and cfg.norm_weight_offset == 1.0
    assert "sliding_attention" in cfg.layer_types and cfg.sliding_window == 4
    qwen = ModelConfig.from_hf(make_hf("qwen3_qk_norm_per_layer_window").config)
    assert qwen.qk_norm and qwen.layer_types[1] == "full_attention"
    llama3 = ModelConfig.from_hf(make_hf("llama_mqa_tied_llama3_rope").config)
    assert llama3.rope_scaling["rope_type"] == "llama3" and llama3.tie_word_embeddings


def test_unsupported_model_type_raises():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2)
    with pytest.raises(NotImplementedError, match="model_type 'gpt2'"):
        ModelConfig.from_hf(cfg)
