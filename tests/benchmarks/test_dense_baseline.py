"""The dense gpt-fast-style peer of ``bench_model`` computes what this project's model computes.

Both models hold the same random bf16 weights and the same random K/V history; one DECODE step
must give the same logits (bf16 tolerance) and write the same K/V, with garbage past the valid
positions of the dense cache and in the paged pool's unused slots.
"""

import pytest
import torch

from bench_model import paged_decode_batch
from compile.models import LlamaForCausalLM, ModelConfig
from dense_baseline import DenseLlama
from decode_roofline import decode_step_bytes

# Hq 4, Hkv 2 (GQA 2), odd-sized MLP, untied head
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
            rope_theta=500.0, max_position_embeddings=64, tie_word_embeddings=False)


def tiny_model(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig(**{**TINY, **overrides}), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms around 1, matrices N(0, 0.1)
            p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 0.1)
    return model


def fill_history(model, fb, dense: DenseLlama, b: int, context: int) -> None:
    """The same random K/V for positions ``0 .. context - 1`` of every request in the paged pool
    and the dense caches; garbage in every other slot and position."""
    cfg = model.config
    slots = fb.req_to_token_pool.req_to_token[:b, :context].long()  # [b, context]
    for layer_id, block in enumerate(dense.layers):
        for paged, cache in ((fb.token_to_kv_pool.k_buffer[layer_id], block.kv_cache.k_cache),
                             (fb.token_to_kv_pool.v_buffer[layer_id], block.kv_cache.v_cache)):
            paged.normal_(0.0, 30.0)  # garbage: a mask or slot error would show
            cache.normal_(0.0, 30.0)
            history = torch.randn(b, context, cfg.num_key_value_heads, cfg.head_dim,
                                  dtype=cache.dtype)
            paged[slots] = history
            cache[:, :, :context] = history.transpose(1, 2)


@pytest.mark.parametrize("gqa", ["pack", "repeat"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_dense_decode_step_matches_the_paged_model(gqa, page_size):
    model, b, context = tiny_model(), 3, 9
    fb = paged_decode_batch(b, context, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2,
                            dtype=torch.bfloat16, device="cpu", page_size=page_size)
    dense = DenseLlama.from_paged(model, b, max_len=context + 4, gqa=gqa)
    fill_history(model, fb, dense, b, context)
    ids = torch.randint(0, TINY["vocab_size"], (b,))
    with torch.inference_mode():
        fb.attn_backend.init_forward_metadata(fb)
        want = model(ids, fb.positions, fb)                          # [b, vocab]
        got = dense(ids[:, None], torch.tensor([context]))[:, 0]     # [b, vocab]
    assert want.abs().max() > 1.0  # logits that carry information
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    for layer_id, block in enumerate(dense.layers):  # this step's K/V landed at position context
        new_k = fb.token_to_kv_pool.k_buffer[layer_id][fb.out_cache_loc]  # [b, Hkv, D]
        torch.testing.assert_close(block.kv_cache.k_cache[:, :, context], new_k,
                                   rtol=2e-2, atol=2e-2)


def test_dense_traces_as_one_graph_and_matches_eager():
    model, b, context = tiny_model(tie_word_embeddings=True), 2, 5
    eager = DenseLlama.from_paged(model, b, max_len=context + 1)
    ids, pos = torch.randint(0, TINY["vocab_size"], (b, 1)), torch.tensor([context])
    for block in eager.layers:
        block.kv_cache.k_cache.normal_()
        block.kv_cache.v_cache.normal_()
    compiled = torch.compile(eager, backend="eager", fullgraph=True)  # a graph break raises
    with torch.inference_mode():
        first = eager(ids, pos)
        torch.testing.assert_close(compiled(ids, pos), first, rtol=0, atol=0)


def test_pack_and_repeat_agree_on_a_multi_token_step():
    # s > 1: each query row of the packed layout must keep its own token's causal mask
    model, b, context = tiny_model(), 2, 6
    ids, pos = torch.randint(0, TINY["vocab_size"], (b, 3)), torch.arange(context, context + 3)
    torch.manual_seed(1)
    history = [torch.randn(b, 2, context + 5, 16, dtype=torch.bfloat16) for _ in range(4)]
    logits = {}
    for gqa in ("pack", "repeat"):
        dense = DenseLlama.from_paged(model, b, max_len=context + 5, gqa=gqa)
        for block, k, v in zip(dense.layers, history[::2], history[1::2]):
            block.kv_cache.k_cache.copy_(k)
            block.kv_cache.v_cache.copy_(v)
        with torch.inference_mode():
            logits[gqa] = dense(ids, pos)  # [b, 3, vocab]
    torch.testing.assert_close(logits["pack"], logits["repeat"], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(gqa="expand"), ValueError, r"gqa is 'expand'; expected one of \('pack', 'repeat'\)"),
    (dict(max_len=65), ValueError, r"max_len out of range; expected 1 <= max_len <= "
                                   r"max_position_embeddings=64, got 65"),
    (dict(max_len=0), ValueError, r"max_len out of range; .*got 0"),
])
def test_from_paged_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        DenseLlama.from_paged(tiny_model(), 1, **{"max_len": 8, **kwargs})


@pytest.mark.parametrize("overrides, feature", [
    (dict(qk_norm=True), "qk_norm"),
    (dict(final_logit_softcap=30.0), "final_logit_softcap"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
])
def test_from_paged_refuses_features_it_does_not_compute(overrides, feature):
    with pytest.raises(NotImplementedError, match=rf"uses \['{feature}'\]"):
        DenseLlama.from_paged(tiny_model(**overrides), 1, max_len=8)


@pytest.mark.parametrize("tied", [True, False])
def test_decode_step_bytes_counts_weights_once_and_the_whole_kv(tied):
    model, b, context = tiny_model(tie_word_embeddings=tied), 5, 20
    h, i, v, d = 64, 88, 96, 16
    layer = h * (4 + 2 * 2) * d + 4 * d * h + h * 2 * i + i * h + 2 * h  # qkv, o, gate_up, down, norms
    embed = v * h if tied else b * h + v * h  # untied: b gathered rows + the LM head
    weights, kv = decode_step_bytes(model, b, context)
    assert weights == 2 * (embed + 2 * layer + h)  # bf16; + the final norm
    assert kv == 2 * 2 * b * (context + 1) * 2 * 2 * d  # layers * b * tokens * Hkv * (K + V) * D


@pytest.mark.gpu
def test_compiled_dense_replays_one_device_graph_and_matches_eager():
    from torch._dynamo.utils import counters

    from dense_baseline import compile_dense
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (torch.compile's reduce-overhead graphs)")
    model, b, context = tiny_model().cuda(), 3, 40
    dense = DenseLlama.from_paged(model, b, max_len=context + 1)
    for block in dense.layers:
        block.kv_cache.k_cache.normal_()
        block.kv_cache.v_cache.normal_()
    ids = torch.randint(0, TINY["vocab_size"], (b, 1), device="cuda")
    pos = torch.tensor([context], device="cuda")
    with torch.inference_mode():
        want = dense(ids, pos).clone()
        skips = counters["inductor"]["cudagraph_skips"]
        compiled = compile_dense(dense)
        for _ in range(4):  # warm-up, record, replays
            torch.compiler.cudagraph_mark_step_begin()
            got = compiled(ids, pos)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert counters["inductor"]["cudagraph_skips"] == skips  # the step ran as a CUDA graph
