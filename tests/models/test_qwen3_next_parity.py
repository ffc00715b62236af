"""Qwen3-Next and Qwen3.5 (``compile.models.qwen3_next``): parity with ``transformers``.

Tiny random ``Qwen3NextConfig`` (three gated-delta-net layers per full-attention layer, sparse
MoE with a shared expert, one dense layer), ``Qwen3_5TextConfig`` (dense) and
``Qwen3_5MoeTextConfig`` (every layer MoE) models go through the
engine (paged KV cache plus the linear layers' state pool, chunked prefill continuing from a
cached prefix's state, decode) with several requests of different lengths in one batch; every
logit row is compared with ``transformers`` on the same sequence, and greedy decoding with
``transformers``' ``generate``. A prompt longer than the delta rule's 64-token chunk runs in one
extend step.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from compile.backend import HybridLinearAttnBackend, kv_layout, linear_layout  # noqa: E402
from compile.batch import kv_cache_bytes  # noqa: E402
from compile.engine.engine import Engine, SamplingParams  # noqa: E402
from compile.models import SUPPORTED_MODEL_TYPES, from_hf  # noqa: E402
from compile.models.qwen3_next import Qwen3NextForCausalLM  # noqa: E402
from compile.models.qwen3_next_config import Qwen3NextConfig  # noqa: E402
from tests.models.test_llama_parity import SMALL, check_parity, random_hf  # noqa: E402

HYBRID = dict(num_hidden_layers=4, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
           shared_expert_intermediate_size=32, mlp_only_layers=[1])


def qwen3_next_hf(seed: int = 0, **extra):
    """A random ``Qwen3NextForCausalLM``: layers linear, dense linear, linear, full; MoE on
    layers 0, 2, 3. ``A_log`` spread over [-1, 1] so the decays differ per head."""
    cfg = transformers.Qwen3NextConfig(**{**SMALL, **HYBRID, **MOE, **extra})
    return _spread_decay(random_hf(transformers.Qwen3NextForCausalLM, cfg, seed))


def qwen3_5_hf(seed: int = 0, **extra):
    """A random ``Qwen3_5ForCausalLM`` (dense MLP, four input projections)."""
    cfg = transformers.Qwen3_5TextConfig(**{**SMALL, **HYBRID, **extra})
    return _spread_decay(random_hf(transformers.Qwen3_5ForCausalLM, cfg, seed))


def qwen3_5_moe_hf(seed: int = 0, **extra):
    """A random ``Qwen3_5MoeForCausalLM`` (four input projections, every layer MoE)."""
    moe = {k: v for k, v in MOE.items() if k != "mlp_only_layers"}
    cfg = transformers.Qwen3_5MoeTextConfig(**{**SMALL, **HYBRID, **moe, **extra})
    return _spread_decay(random_hf(transformers.Qwen3_5MoeForCausalLM, cfg, seed))


def _spread_decay(hf):
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
    return hf


MODELS = {"qwen3_next": qwen3_next_hf, "qwen3_5_text": qwen3_5_hf}


@pytest.fixture(scope="module", params=sorted(MODELS) + ["qwen3_5_moe_text"])
def hf_hybrid(request):
    return {**MODELS, "qwen3_5_moe_text": qwen3_5_moe_hf}[request.param]()


@pytest.mark.parametrize("page_size", [1, 16])
def test_logits_match_transformers(hf_hybrid, page_size):
    model = from_hf(hf_hybrid)
    assert isinstance(model, Qwen3NextForCausalLM)
    check_parity(hf_hybrid, model, page_size, vocab=SMALL["vocab_size"],
                 label=hf_hybrid.config.model_type)


def test_greedy_generate_matches_transformers_with_a_prompt_longer_than_a_chunk(hf_hybrid):
    """One 70-token prompt (two chunks of the chunked delta rule) and a short one in one
    extend step, then decode: the same greedy tokens as ``generate``."""
    model = from_hf(hf_hybrid)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, SMALL["vocab_size"], (n,), generator=g).tolist() for n in (70, 4)]
    engine = Engine(model, page_size=16, max_running=2, max_context_len=96,
                    max_total_tokens=256, chunked_prefill_size=128)
    assert isinstance(engine.attn_backend, HybridLinearAttnBackend)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=5))
    for prompt, out in zip(prompts, outs):
        want = hf_hybrid.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        assert out == want
    assert engine.state_pool.available_size() == 2  # both slots freed with their requests


def test_config_reads_the_hybrid_options(hf_hybrid):
    cfg = Qwen3NextConfig.from_hf(hf_hybrid.config)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.rotary_dim == 4 and cfg.scaling == 16 ** -0.5
    kind = hf_hybrid.config.model_type
    assert cfg.split_projections == (kind != "qwen3_next")
    assert [cfg.layer_is_moe(i) for i in range(4)] == {
        "qwen3_next": [True, False, True, True], "qwen3_5_text": [False] * 4,
        "qwen3_5_moe_text": [True] * 4}[kind]
    assert {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"} <= set(SUPPORTED_MODEL_TYPES)


def test_pools_hold_kv_for_full_layers_and_state_for_linear_ones(hf_hybrid):
    """Only layer 3 has KV buffers; layers 0-2 have state slots, one per request row."""
    model = from_hf(hf_hybrid)
    layout, linear = kv_layout(model), linear_layout(model)
    assert layout.linear_layer_ids == (0, 1, 2) and layout.cache_layer_ids == (3,)
    assert linear.layer_ids == (0, 1, 2)
    conv_dim = 2 * 2 * 8 + 4 * 8
    assert (linear.conv_dim, linear.conv_width, linear.num_v_heads) == (conv_dim, 4, 4)
    # per request: 3 layers x (conv window [conv_dim, 3] fp32 + state [4, 8, 8] fp32)
    assert linear.state_bytes(torch.float32) == 3 * (conv_dim * 3 + 4 * 8 * 8) * 4
    # one KV layer: 2 heads x (16 + 16) fp32 per token, pages of 16 plus the padding page
    bytes_ = kv_cache_bytes(layout, 32, page_size=16, dtype=torch.float32)
    assert bytes_.full == 1 * (2 + 1) * 16 * 2 * 32 * 4
    engine = Engine(model, page_size=16, max_running=3, max_total_tokens=64)
    assert engine.token_to_kv_pool.get_key_buffer(0) is engine.token_to_kv_pool.get_key_buffer(3)
    assert engine.state_pool.conv.shape == (3, 4, conv_dim, 3)  # 3 layers, 3 slots + padding


def test_loads_from_a_local_folder(hf_hybrid, tmp_path):
    hf_hybrid.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    model = from_hf(loaded.eval())
    ids = torch.tensor([5, 9, 2])
    engine = Engine(model, page_size=1, max_running=1, max_total_tokens=16)
    out = engine.generate([ids.tolist()], SamplingParams(max_new_tokens=3))[0]
    want = hf_hybrid.generate(ids[None], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out == want[0, 3:].tolist()


def test_unsupported_rope_type_is_rejected():
    cfg = transformers.Qwen3NextConfig(**{**SMALL, **HYBRID, "rope_parameters": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.25}})
    with pytest.raises(NotImplementedError, match="rope_type 'linear'"):
        Qwen3NextConfig.from_hf(cfg)
