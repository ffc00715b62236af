"""DeepSeek-V2 / V3 mixture-of-experts models against ``transformers`` on random weights.

Tiny ``DeepseekV2ForCausalLM`` (softmax routing, group-limited greedy, shared experts, a dense
first layer) and ``DeepseekV3ForCausalLM`` (sigmoid routing with a random score-correction
bias, groups, renormalised top-k, ``routed_scaling_factor``, q LoRA) are copied with
``compile.models.from_hf`` and run through the engine:

- every prompt and decode logit row equals the ``transformers`` full forward (chunked prefill
  over a cached prefix, then decode);
- greedy ids equal ``transformers``' own ``generate``, eager and in every compiled mode the zoo
  tests (``test_gemma3_modes``: Dynamo, piecewise with emulated capture, full decode graphs,
  full_and_piecewise), page sizes 1 and 64;
- YaRN RoPE (as DeepSeek's configs set it) matches too;
- the router equals a float64 oracle written per token from the routing rules, and the whole
  MoE traces with ``fullgraph=True``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip("transformers has no DeepseekV3ForCausalLM", allow_module_level=True)

from compile.__main__ import hf_generate  # noqa: E402
from compile.engine import Engine, SamplingParams  # noqa: E402
from compile.models import deepseek_v2, from_hf  # noqa: E402
from compile.models.deepseek_moe import DeepseekMoE, GroupedTopKRouter, MoEConfig  # noqa: E402
from compile.models.weights import copy_from_hf  # noqa: E402
from tests.models import test_gemma3_modes as gemma3_modes  # noqa: E402
from tests.models import test_llama_parity as llama_parity  # noqa: E402

VOCAB = 128
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
            max_position_embeddings=160,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0))
VARIANTS = {
    "v2": ("DeepseekV2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              routed_scaling_factor=1.5)),
    "v3": ("DeepseekV3", dict(n_group=4, topk_group=2, norm_topk_prob=True,
                              routed_scaling_factor=2.5, q_lora_rank=24)),
}
PROMPT_LENS = (13, 5)
NEW_TOKENS = 5

# the compiled modes the zoo's models are tested in (test_gemma3_modes), and eager
MODES = {"eager": lambda m: m, **gemma3_modes.MODES}


def make_hf(variant: str, seed: int = 0, **overrides):
    """A random-weight ``transformers`` model of ``VARIANTS[variant]`` (score-correction bias
    random too: ``random_hf`` fills parameters only)."""
    prefix, extra = VARIANTS[variant]
    cfg = getattr(transformers, prefix + "Config")(**{**TINY, **extra, **overrides})
    hf = llama_parity.random_hf(getattr(transformers, prefix + "ForCausalLM"), cfg, seed)
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    return hf


def prompts(vocab: int = VOCAB, lens=PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def engine_generate(model, forward, page_size: int, prompt_ids, new_tokens: int = NEW_TOKENS):
    """Greedy ids of ``prompt_ids`` through the engine (chunked prefill of 8 tokens)."""
    engine = Engine(model, forward=forward, page_size=page_size, max_running=2,
                    max_context_len=64, max_total_tokens=256, chunked_prefill_size=8)
    return engine.generate(prompt_ids, SamplingParams(max_new_tokens=new_tokens))


@functools.lru_cache(maxsize=None)
def hf_reference(variant: str) -> tuple:
    """``transformers`` generate's greedy ids of ``prompts()`` (computed once per variant)."""
    hf = make_hf(variant, num_hidden_layers=2)
    return tuple(map(tuple, hf_generate(hf, prompts(), NEW_TOKENS, ())))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant):
    hf = make_hf(variant)
    model = from_hf(hf)
    assert isinstance(model, deepseek_v2.DeepseekV2ForCausalLM)
    moe = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert moe == ["LlamaMLP", "DeepseekMoE", "DeepseekMoE"]  # first_k_dense_replace = 1
    checked = llama_parity.check_parity(hf, model, 4, vocab=VOCAB, label=variant)
    assert checked == (11 + 5 + 9) + 3 * 3  # prompt rows + (max_new_tokens - 1) decodes


# V3 (DeepSeek-V3's routing) in every mode at both page sizes; V2 in every mode at page size
# 64 and eager at both (CPU time).
GREEDY_CASES = sorted({(v, m, p) for m in MODES for v, p in (("v2", 64), ("v3", 1), ("v3", 64))}
                      | {("v2", "eager", 1)})


@pytest.mark.parametrize("variant, mode, page_size", GREEDY_CASES)
def test_greedy_matches_transformers_generate(variant, mode, page_size):
    torch._dynamo.reset()
    model = from_hf(make_hf(variant, num_hidden_layers=2))  # one dense, one MoE layer
    ids = engine_generate(model, MODES[mode](model), page_size, prompts())
    assert [tuple(x) for x in ids] == list(hf_reference(variant))


def test_rotate_half_rope_variant_matches_transformers():
    """V3 with ``rope_interleave=False`` rotates halves (rotate-half) on the rope part."""
    hf = make_hf("v3", rope_interleave=False)
    model = from_hf(hf)
    assert not model.config.rope_interleave
    llama_parity.check_parity(hf, model, 4, vocab=VOCAB, label="v3 rotate-half")


YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=5.0, original_max_position_embeddings=32,
            beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707)  # 160 / 32 = 5


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_yarn_rope_matches_transformers(variant):
    """YaRN frequencies and the ``mscale_all_dim`` softmax correction (DeepSeek's configs);
    the same weights without them do not match."""
    hf = make_hf(variant, rope_parameters=YARN)
    model = from_hf(hf)
    assert model.config.rope_scaling["rope_type"] == "yarn"
    llama_parity.check_parity(hf, model, 4, vocab=VOCAB, label=f"{variant} yarn")
    plain = dataclasses.replace(model.config, rope_scaling=None)
    unscaled = copy_from_hf(deepseek_v2.DeepseekV2ForCausalLM, plain, hf)
    with pytest.raises(AssertionError, match="request"):
        llama_parity.check_parity(hf, unscaled, 4, vocab=VOCAB, label="no yarn")


def test_ungrouped_routing_fails_parity():
    """The check can fail: routing without the group limit changes the logits."""
    hf = make_hf("v3")
    model = from_hf(hf)
    for layer in model.model.layers[1:]:
        layer.mlp.gate.cfg = MoEConfig(**{**vars(layer.mlp.gate.cfg), "n_group": 1,
                                          "topk_group": 1, "scoring_func": "softmax"})
    with pytest.raises(AssertionError, match="request"):
        llama_parity.check_parity(hf, model, 4, vocab=VOCAB, label="ungrouped")


def _oracle_weights(cfg: MoEConfig, w, bias, x) -> torch.Tensor:
    """Float64 routing weights ``[T, E]``, one token at a time, from the rules in
    ``compile.models.deepseek_moe``'s docstring."""
    e, per = cfg.n_routed_experts, cfg.n_routed_experts // cfg.n_group
    out = torch.zeros(x.shape[0], e, dtype=torch.float64)
    for t in range(x.shape[0]):
        logits = [float(x[t].double() @ w[i].double()) for i in range(e)]
        if cfg.scoring_func == "softmax":
            z = sum(math.exp(v) for v in logits)
            scores = [math.exp(v) / z for v in logits]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in logits]
        sel = [s + (float(bias[i]) if bias is not None else 0.0) for i, s in enumerate(scores)]
        if cfg.grouped:
            groups = [sorted(sel[g * per:(g + 1) * per], reverse=True) for g in range(cfg.n_group)]
            gs = [g[0] if cfg.scoring_func == "softmax" else g[0] + g[1] for g in groups]
            keep = sorted(range(cfg.n_group), key=lambda g: -gs[g])[:cfg.topk_group]
            fill = 0.0 if cfg.scoring_func == "softmax" else -math.inf
            sel = [v if i // per in keep else fill for i, v in enumerate(sel)]
        top = sorted(range(e), key=lambda i: -sel[i])[:cfg.num_experts_per_tok]
        wts = {i: (sel[i] if cfg.scoring_func == "softmax" else scores[i]) for i in top}
        if cfg.scoring_func == "sigmoid" and cfg.norm_topk_prob:
            total = sum(wts.values())
            wts = {i: v / total for i, v in wts.items()}
        for i, v in wts.items():
            out[t, i] = v * cfg.routed_scaling_factor
    return out


ROUTERS = {
    "v2_greedy": MoEConfig(8, 3, 4, scoring_func="softmax", routed_scaling_factor=1.0),
    "v2_grouped": MoEConfig(8, 2, 4, scoring_func="softmax", n_group=4, topk_group=2,
                            routed_scaling_factor=1.5),
    "v3_grouped_norm": MoEConfig(12, 3, 4, scoring_func="sigmoid", n_group=3, topk_group=2,
                                 norm_topk_prob=True, routed_scaling_factor=2.5),
    "v3_one_group": MoEConfig(6, 2, 4, scoring_func="sigmoid", n_group=1, topk_group=1),
}


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_router_matches_float64_oracle(name):
    cfg = ROUTERS[name]
    torch.manual_seed(3)
    router = GroupedTopKRouter(cfg, 16)
    with torch.no_grad():
        router.weight.normal_()
        if router.e_score_correction_bias is not None:
            router.e_score_correction_bias.normal_(0.0, 0.3)
    x = torch.randn(9, 16)
    got = router(x)
    with torch.no_grad():
        want = _oracle_weights(cfg, router.weight, router.e_score_correction_bias, x)
    assert (got != 0).sum(-1).tolist() == [cfg.num_experts_per_tok] * 9
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_moe_traces_fullgraph_and_matches_eager():
    cfg = ROUTERS["v3_grouped_norm"]
    torch.manual_seed(4)
    moe = DeepseekMoE(MoEConfig(**{**vars(cfg), "n_shared_experts": 2}),
                      deepseek_v2.DeepseekV2Config(hidden_size=16))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(5, 16)
    compiled = torch.compile(moe, backend="eager", fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x), moe(x))
    torch.testing.assert_close(compiled(x[:3]), moe(x[:3]))


@pytest.mark.parametrize("override, match", [
    (dict(moe_layer_freq=2), "moe_layer_freq 2"),
    (dict(topk_method="noaux_tc"), "topk_method 'noaux_tc'"),
    (dict(rope_parameters={**YARN, "mscale": 1.0}), "YaRN attention factor"),
    (dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)), "'linear'"),
])
def test_config_rejects_unmodelled_routing(override, match):
    prefix, extra = VARIANTS["v2"]
    cfg = transformers.DeepseekV2Config(**{**TINY, **extra, **override})
    with pytest.raises(NotImplementedError, match=match):
        deepseek_v2.DeepseekV2Config.from_hf(cfg)


@pytest.mark.parametrize("kwargs, match", [
    (dict(scoring_func="tanh"), "scoring_func"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok 9"),
    (dict(n_group=3), "n_group=3"),
    (dict(scoring_func="sigmoid", n_group=8), "two best experts"),
])
def test_moe_config_rejects_bad_values(kwargs, match):
    base = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=4)
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**base, **kwargs})
