"""DeepSeek-V3.2 (MLA, MoE, DSA sparse attention) against ``transformers`` on random weights.

A tiny ``DeepseekV32ForCausalLM`` (two layers: dense MLP then MoE; eight index heads) is copied
with ``compile.models.from_hf`` and run through the engine on a ``DSATokenToKVPool`` with the
``DSAAttentionBackend``:

- ``index_topk`` 4, below the prompt lengths, so each query attends only its top-4 keys. The
  indexer scores fp8 keys and queries, as DeepSeek's reference and sglang do;
  ``transformers`` scores them in float (it calls fp8 "a precision optimization"), and the
  ~4 % rounding of fp8 reorders close scores. So the reference here is ``transformers`` with
  its indexer's scores taken from fp8-rounded keys and queries
  (``compile.models.deepseek_v32_reference.fp8_indexer``, the engine's numerical contract:
  Hadamard rotation, per-row scale ``amax / 448``; also ``generate --verify``'s reference);
  everything else is ``transformers``' own code.
- ``index_topk`` 64, above every length: sparse equals dense and the reference is plain
  ``transformers``.

Checks: every prompt and decode logit row equals the reference's full forward; greedy ids equal
its ``generate`` eager and in every compiled mode (``test_gemma3_modes``'s), page sizes 1 and 64;
the sparse ops really run (and dense MLA prefill where every request is short); attending every
key instead of the top-k breaks parity.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV32ForCausalLM"):
    pytest.skip("transformers has no DeepseekV32ForCausalLM", allow_module_level=True)

import xpu_ops  # noqa: E402
from compile.__main__ import hf_generate  # noqa: E402
from compile.backend.dsa_backend import DSAAttentionBackend  # noqa: E402
from compile.batch import DSATokenToKVPool  # noqa: E402
from compile.models import deepseek_v32, from_hf  # noqa: E402
from compile.models.deepseek_v32_reference import _fp8_indexer_forward, fp8_indexer  # noqa: E402
from tests.models import test_deepseek_moe_parity as moe_parity  # noqa: E402
from tests.models import test_llama_parity as llama_parity  # noqa: E402

VOCAB = moe_parity.VOCAB
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=24, first_k_dense_replace=1,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            max_position_embeddings=160, index_head_dim=32, index_n_heads=8,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0))
SPARSE_TOPK, DENSE_TOPK = 4, 64


def make_hf(index_topk: int, seed: int = 0, **overrides):
    """Random ``transformers`` model; the indexer's LayerNorm weights near 1 (as trained ones
    are), so index keys differ between tokens by more than the norm's bias."""
    cfg = transformers.DeepseekV32Config(**{**TINY, **overrides}, index_topk=index_topk)
    hf = llama_parity.random_hf(transformers.DeepseekV32ForCausalLM, cfg, seed)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.indexer.k_norm.weight.normal_(1.0, 0.1)
            layer.self_attn.indexer.k_norm.bias.normal_(0.0, 0.1)
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    return hf


@functools.lru_cache(maxsize=None)
def hf_reference(index_topk: int) -> tuple:
    """Reference greedy ids of ``moe_parity.prompts()`` (fp8 indexer when sparse)."""
    with fp8_indexer(index_topk == SPARSE_TOPK), torch.no_grad():
        ids = hf_generate(make_hf(index_topk), moe_parity.prompts(), moe_parity.NEW_TOKENS, ())
    return tuple(map(tuple, ids))


@pytest.mark.parametrize("index_topk", [SPARSE_TOPK, DENSE_TOPK])
def test_logits_match_transformers(index_topk, monkeypatch):
    calls = {"sparse_fwd": 0, "with_kvcache": 0, "prefill": 0}
    for op, key in (("flash_mla_sparse_fwd", "sparse_fwd"),
                    ("flash_mla_with_kvcache", "with_kvcache"), ("flash_mla_prefill", "prefill")):
        real = getattr(xpu_ops, op)
        monkeypatch.setattr(xpu_ops, op, lambda *a, _r=real, _k=key, **kw: (
            calls.__setitem__(_k, calls[_k] + 1), _r(*a, **kw))[1])
    hf = make_hf(index_topk)
    model = from_hf(hf)
    assert isinstance(model, deepseek_v32.DeepseekV32ForCausalLM)
    with fp8_indexer(index_topk == SPARSE_TOPK):
        checked = llama_parity.check_parity(hf, model, 4, vocab=VOCAB, label=f"topk {index_topk}")
    assert checked == (11 + 5 + 9) + 3 * 3  # prompt rows + (max_new_tokens - 1) decodes
    assert calls["with_kvcache"] == 3 * 2  # decode steps x layers: always sparse
    if index_topk == SPARSE_TOPK:  # every prefill chunk has a request past 4 keys
        assert calls["sparse_fwd"] > 0 and calls["prefill"] == 0
    else:  # every request holds <= 64 keys: dense MLA prefill
        assert calls["sparse_fwd"] == 0 and calls["prefill"] > 0


# eager and every compiled mode, each at page sizes 1 and 64
GREEDY_CASES = [(mode, page) for mode in moe_parity.MODES for page in (1, 64)]


@pytest.mark.parametrize("mode, page_size", GREEDY_CASES)
def test_greedy_matches_transformers_generate(mode, page_size):
    torch._dynamo.reset()
    model = from_hf(make_hf(SPARSE_TOPK))
    ids = moe_parity.engine_generate(model, moe_parity.MODES[mode](model), page_size,
                                     moe_parity.prompts())
    assert [tuple(x) for x in ids] == list(hf_reference(SPARSE_TOPK))


@pytest.mark.parametrize("page_size", [1, 64])
def test_topk_above_lengths_matches_plain_transformers(page_size):
    model = from_hf(make_hf(DENSE_TOPK))
    ids = moe_parity.engine_generate(model, model, page_size, moe_parity.prompts())
    assert [tuple(x) for x in ids] == list(hf_reference(DENSE_TOPK))


@pytest.mark.parametrize("index_topk", [SPARSE_TOPK, DENSE_TOPK])
def test_yarn_rope_matches_transformers(index_topk):
    """YaRN (DeepSeek-V3.2's released config kind) on the MLA rope part and the indexer's."""
    hf = make_hf(index_topk, rope_parameters=moe_parity.YARN)
    model = from_hf(hf)
    assert model.config.rope_scaling["rope_type"] == "yarn"
    with fp8_indexer(index_topk == SPARSE_TOPK):
        llama_parity.check_parity(hf, model, 4, vocab=VOCAB, label=f"yarn topk {index_topk}")


def test_attending_every_key_fails_parity(monkeypatch):
    """The check can fail: a backend that keeps every key (top-k above every length) is not
    the sparse model."""
    hf = make_hf(SPARSE_TOPK)
    model = from_hf(hf)
    monkeypatch.setattr(DSAAttentionBackend, "__init__", lambda self, mr, **kw: (
        super(DSAAttentionBackend, self).__init__(mr, **kw),
        setattr(self, "index_topk", DENSE_TOPK))[0])
    with fp8_indexer(), pytest.raises(AssertionError, match="request"):
        llama_parity.check_parity(hf, model, 4, vocab=VOCAB, label="dense")


def test_engine_builds_dsa_pool_and_backend():
    from compile.engine import Engine
    model = from_hf(make_hf(SPARSE_TOPK))
    engine = Engine(model, page_size=4, max_running=2, max_context_len=32, max_total_tokens=64)
    assert isinstance(engine.token_to_kv_pool, DSATokenToKVPool)
    assert isinstance(engine.attn_backend, DSAAttentionBackend)
    cache = engine.token_to_kv_pool.get_index_k_with_scale_buffer(1)
    assert cache.dtype == torch.uint8 and tuple(cache.shape[1:]) == (4, 1, 32 + 4)


def test_config_rejects_bad_indexer_shapes():
    with pytest.raises(ValueError, match="power-of-two index_head_dim"):
        deepseek_v32.DeepseekV32Config(q_lora_rank=8, index_head_dim=24)
    with pytest.raises(ValueError, match="index_topk must be >= 1"):
        deepseek_v32.DeepseekV32Config(q_lora_rank=8, index_topk=0)


class _IndexerCache:
    """A layer cache holding earlier index keys: ``update_indexer`` appends and returns all."""

    def __init__(self, earlier: torch.Tensor):
        self.keys, self.calls = earlier, 0

    def update_indexer(self, k, layer_idx):
        self.calls += 1
        self.keys = torch.cat([self.keys, k], dim=1)
        return self.keys


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_fp8_reference_indexer_reads_the_cache_under_either_keyword(keyword):
    """``transformers`` passes the layer cache as ``cache`` from 5.24 and as
    ``past_key_values`` before: the reference's decode query scores every cached key under both
    (a forward that dropped it scored one key and gave wrong reference ids on 5.17)."""
    indexer = make_hf(SPARSE_TOPK).model.layers[0].self_attn.indexer
    g = torch.Generator().manual_seed(3)
    earlier = torch.randn(1, 9, indexer.head_dim, generator=g)
    hidden = torch.randn(1, 1, TINY["hidden_size"], generator=g)
    q_resid = torch.randn(1, 1, TINY["q_lora_rank"], generator=g)
    rope = (torch.ones(1, 1, indexer.qk_rope_head_dim), torch.zeros(1, 1, indexer.qk_rope_head_dim))
    cache = _IndexerCache(earlier)
    with torch.no_grad():
        picked = _fp8_indexer_forward(indexer, hidden, q_resid, rope, torch.zeros(1, 1, 10),
                                      **{keyword: cache})
    assert cache.calls == 1 and picked.shape == (1, 1, SPARSE_TOPK)
    assert int(picked.max()) < 10 and len(set(picked.flatten().tolist())) == SPARSE_TOPK
