"""``DSAAttentionBackend`` modes beyond what the engine runs (model parity:
``tests/models/test_deepseek_v32_parity.py``).

A tiny zoo DeepSeek-V3.2 (index top-k 4, below every length here) on a ``DSATokenToKVPool``:

- TARGET_VERIFY with topk 1 (``flash_mla_with_kvcache`` with ``indices [b, D, topk]``) gives
  the logits that an EXTEND of the same draft tokens over the same prefix gives
  (``flash_mla_sparse_fwd``), at page sizes 1 and 4;
- the same verify step with its metadata bound into fixed graph buffers
  (``fill_graph_metadata``: ``rows.page_table``/``rows.cache_seqlens``) equals the eager one;
- the index keys land in the index-key cache at exactly the step's slots;
- MIXED attends as EXTEND does;
- modes the backend does not serve, and a model without indexer inputs on a plain backend,
  are refused.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from compile.backend import XPUAttentionBackend
from compile.backend.dsa_backend import DSAAttentionBackend
from compile.batch import DSATokenToKVPool
from compile.engine.model_runner import ModelRunnerInfo
from compile.models.deepseek_moe import MoEConfig
from compile.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM
from tests.compile.compile_helpers import Harness

TOPK = 4


def tiny_v32(seed: int = 0, **overrides) -> DeepseekV32ForCausalLM:
    """The tiny random model (``overrides``: config fields, e.g. ``kv_lora_rank=128`` for an
    fp8 latent cache)."""
    cfg = DeepseekV32Config(**{**dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=128, index_n_heads=4,
        index_head_dim=16, index_topk=TOPK, mlp_layer_types=("dense", "sparse"),
        moe=MoEConfig(4, 2, 8, n_shared_experts=1, scoring_func="sigmoid", n_group=2,
                      topk_group=1)), **overrides})
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "k_norm.weight" in name else 0.0, 0.15)
    return model


class DSAHarness(Harness):
    """``Harness`` over a ``DSATokenToKVPool`` (latent cache of ``kv_dtype``) with a
    ``DSAAttentionBackend``."""

    def __init__(self, model, kv_dtype: torch.dtype = torch.float32, **kwargs):
        self.kv_dtype = kv_dtype
        super().__init__(model, **kwargs)
        cfg = model.config
        runner = ModelRunnerInfo(
            model_config=SimpleNamespace(context_len=self.req_pool.req_to_token.shape[1],
                                         num_attention_heads=cfg.num_attention_heads,
                                         index_topk=cfg.index_topk),
            tp_size=1, device=self.device, page_size=self.kv_pool.page_size,
            req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
            kv_cache_dtype=self.kv_pool.dtype,
            server_args=SimpleNamespace(speculative_eagle_topk=1))
        self.backend = DSAAttentionBackend(runner)

    def _kv_pool(self, model, size: int, page_size: int):
        cfg = model.config
        return DSATokenToKVPool(size, page_size, self.kv_dtype, cfg.kv_lora_rank,
                                cfg.qk_rope_head_dim, cfg.num_hidden_layers, self.device,
                                index_head_dim=cfg.index_head_dim)


def _prefill(h: DSAHarness, model, rows=(0, 1), lens=(9, 6)):
    with torch.no_grad():
        model(*h.extend(list(rows), list(lens)))


@pytest.mark.parametrize("page_size", [1, 4])
def test_target_verify_equals_extend_of_the_drafts(page_size):
    model = tiny_v32()
    ver, ext = DSAHarness(model, page_size=page_size), DSAHarness(model, page_size=page_size)
    _prefill(ver, model)
    _prefill(ext, model)
    ids, pos, fb = ver.verify([0, 1], 3, init=True)
    assert fb.forward_mode.is_target_verify()
    with torch.no_grad():
        got = model(ids, pos, fb, return_all_logits=True)
        e_ids, e_pos, e_fb = ext.extend([0, 1], [3, 3])
        want = model(e_ids, e_pos, e_fb, return_all_logits=True)
    assert torch.equal(ids, e_ids) and torch.equal(pos, e_pos)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_target_verify_in_graph_buffers_equals_eager():
    model = tiny_v32()
    eager, graph = DSAHarness(model, page_size=4), DSAHarness(model, page_size=4)
    _prefill(eager, model)
    _prefill(graph, model)
    ids, pos, fb = eager.verify([0, 1], 3, init=True)
    with torch.no_grad():
        want = model(ids, pos, fb, return_all_logits=True)
    g_ids, g_pos, g_fb = graph.verify([0, 1], 3)
    buffers = graph.backend.graph_metadata_buffers(4, 16)
    bound = graph.backend.fill_graph_metadata(g_fb, buffers)
    assert bound.rows.page_table.data_ptr() == buffers["rows.page_table"].data_ptr()
    with torch.no_grad():
        got = model(g_ids, g_pos, g_fb, return_all_logits=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_index_keys_stored_at_the_step_slots():
    model = tiny_v32()
    h = DSAHarness(model, page_size=4)
    before = h.kv_pool.get_index_k_with_scale_buffer(0).clone()
    ids, pos, fb = h.extend([0], [5])
    with torch.no_grad():
        model(ids, pos, fb)
    after = h.kv_pool.get_index_k_with_scale_buffer(0)
    ps, dim = 4, model.config.index_head_dim
    changed = set()
    for page in range(after.shape[0]):
        for row in range(ps):
            key = slice((row * dim), (row + 1) * dim)  # the fp8 bytes of the row's key
            flat_a, flat_b = after[page].flatten(), before[page].flatten()
            if not torch.equal(flat_a[key], flat_b[key]):
                changed.add(page * ps + row)
    assert changed == set(fb.out_cache_loc.tolist())


def test_unsupported_modes_and_plain_backend_are_refused():
    model = tiny_v32()
    h = DSAHarness(model, page_size=1)
    _prefill(h, model)
    ids, pos, fb = h.verify([0, 1], 3)
    fb.spec_info = dataclasses.replace(fb.spec_info, topk=2)
    h.backend.topk = 2
    with pytest.raises(NotImplementedError, match="topk 2"):
        h.backend.init_forward_metadata(fb)
    plain_backend = XPUAttentionBackend(ModelRunnerInfo(
        model_config=SimpleNamespace(context_len=128, num_attention_heads=2), tp_size=1,
        device=h.device, page_size=1, req_to_token_pool=h.req_pool, token_to_kv_pool=h.kv_pool,
        kv_cache_dtype=torch.float32))
    ids, pos, fb = h.decode([0, 1], init=False)
    fb.attn_backend = plain_backend
    plain_backend.init_forward_metadata(fb)
    with pytest.raises(NotImplementedError, match="DSAAttentionBackend"), torch.no_grad():
        model(ids, pos, fb)


def test_mixed_step_equals_extend_step():
    """MIXED (a prefill chunk beside a decoding request) attends as EXTEND does."""
    from compile.batch import ForwardMode
    model = tiny_v32()
    out = []
    for mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        h = DSAHarness(model, page_size=4)
        _prefill(h, model)
        ids, pos, fb = h.extend([0, 1], [5, 1], init=False)
        fb.forward_mode = mode
        h.backend.init_forward_metadata(fb)
        with torch.no_grad():
            out.append(model(ids, pos, fb, return_all_logits=True))
    torch.testing.assert_close(out[1], out[0], atol=0, rtol=0)


def test_engine_on_an_fp8_latent_cache_eager_and_in_graphs():
    """``Engine(kv_dtype=float8_e4m3fn)``: a DSA pool of FlashMLA fp8 tokens (R = 128: 164
    bytes a token), chunked prefill over it and decode; whole-step decode graphs (emulated
    capture and replay) give the eager ids. A layer without indexer inputs over it is refused."""
    from compile.engine import Engine, SamplingParams
    from compile.graphs import GraphRunner
    model = tiny_v32(kv_lora_rank=128)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (13, 6)]
    ids = []
    runner = GraphRunner(model, emulate_graphs=True)
    for forward in (model, runner):
        engine = Engine(model, forward=forward, page_size=4, max_running=2, max_context_len=64,
                        max_total_tokens=256, chunked_prefill_size=8,
                        kv_dtype=torch.float8_e4m3fn)
        pool = engine.token_to_kv_pool
        assert pool.fp8_latent and tuple(pool.get_key_buffer(0).shape[1:]) == (1, 128 + 4 + 16)
        ids.append(engine.generate(prompts, SamplingParams(max_new_tokens=4)))
    assert ids[0] == ids[1] and all(len(x) == 4 for x in ids[0])
    assert runner.captures >= 1 and runner.replays >= 1
    h = DSAHarness(model, page_size=4, kv_dtype=torch.float8_e4m3fn)
    ids_, pos, fb = h.extend([0], [5])
    with pytest.raises(NotImplementedError, match="no indexer inputs"):
        h.backend._forward(torch.zeros(5, 2 * 128), None, None, model.model.layers[0].self_attn
                           .attn, fb, False)


def test_fp8_latent_cache_needs_tiles_of_128():
    with pytest.raises(ValueError, match="multiple of 128"):
        DSATokenToKVPool(16, 4, torch.float8_e4m3fn, 16, 8, 1, "cpu", index_head_dim=16)
