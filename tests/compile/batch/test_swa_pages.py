"""``compile.batch.swa_pages``: the engine's hybrid sliding-window pool keeps only the window.

The engine with the hybrid pool must give the same logits as with every layer in the full pool,
while the SWA pages it frees are poisoned before every step (so a page freed too early, or a
translated page table pointing anywhere but a live page or the masked padding page, shows in
the logits), hold no more pages per request than ``swa_pages_per_request`` and free them all at
the end.
"""

from __future__ import annotations

import pytest
import torch

from compile.backend import kv_layout
from compile.engine import Engine, SamplingParams
from compile.batch import SWAKVPool
from compile.models import Gemma3Config, Gemma3ForCausalLM
from compile.batch.swa_pages import SWAPageAllocator, kv_cache_bytes, swa_pages_per_request
from tests.compile.compile_helpers import TINY, pool_buffers, tiny_model

WINDOW = 4
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
PROMPT_LENS = (23, 6, 13)
NEW_TOKENS = 5
CHUNK = 8


def tiny_gemma3(seed: int = 0) -> Gemma3ForCausalLM:
    """A zoo Gemma 3 (2 local layers, 1 global) with N(0, 0.15**2) weights."""
    torch.manual_seed(seed)
    cfg = Gemma3Config(**{**TINY, "num_hidden_layers": len(LAYER_TYPES)},
                       layer_types=LAYER_TYPES, sliding_window=WINDOW, qk_norm=True,
                       sandwich_norm=True, norm_weight_offset=1.0, tie_word_embeddings=True,
                       hidden_act="gelu_pytorch_tanh", embed_scale=TINY["hidden_size"] ** 0.5,
                       rope_local_base_freq=100.0)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    return model


class PoisonFreeSWAPages:
    """Engine forward that fills page 0 and every free SWA page with large random values before
    each step, checks no request holds more SWA pages than the bound, and records logits."""

    def __init__(self, model, bound: int):
        self.model, self.bound, self.engine, self.logits = model, bound, None, []
        self.gen = torch.Generator().manual_seed(3)

    def __call__(self, input_ids, positions, fb):
        swa = self.engine.swa_pages
        assert max(len(h) for h in swa.held.values()) <= self.bound
        pages = torch.tensor([0] + swa.allocator.free_pages)
        for buf in pool_buffers(swa.pool.swa_kv_pool):
            paged = buf.view(-1, swa.page_size, *buf.shape[1:])
            paged[pages] = 1e3 * torch.randn(paged[pages].shape, generator=self.gen)
        out = self.model(input_ids, positions, fb)
        self.logits.append(out)
        return out


def run(model, page_size: int, swa_pool, forward=None):
    engine = Engine(model, forward=forward, page_size=page_size, max_running=3,
                    max_context_len=64, max_total_tokens=192, chunked_prefill_size=CHUNK,
                    swa_pool=swa_pool)
    if forward is not None:
        forward.engine = engine
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist()
               for n in PROMPT_LENS]
    return engine, engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))


class Recorder:
    """Engine forward that runs ``forward`` and keeps the logits of every step."""

    def __init__(self, forward):
        self.forward, self.logits, self.engine = forward, [], None
        self.builds_metadata = getattr(forward, "builds_metadata", False)  # a graph runner's

    def __call__(self, *args):
        self.logits.append(self.forward(*args))
        return self.logits[-1]


@pytest.mark.parametrize("page_size", [1, 2, 16])
def test_hybrid_pool_equals_full_pool_with_freed_pages_poisoned(page_size):
    model = tiny_gemma3()
    full = Recorder(model)
    full_engine, want = run(model, page_size, swa_pool=False, forward=full)
    assert not isinstance(full_engine.token_to_kv_pool, SWAKVPool)
    bound = swa_pages_per_request(WINDOW, CHUNK, page_size, 64)
    poison = PoisonFreeSWAPages(model, bound)
    engine, got = run(model, page_size, swa_pool=None, forward=poison)
    assert isinstance(engine.token_to_kv_pool, SWAKVPool) and engine.attn_backend.is_hybrid_swa
    assert got == want
    for a, b in zip(poison.logits, full.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    swa = engine.swa_pages
    assert swa.available_pages() == swa.allocator.num_pages - 1  # all freed, page 0 reserved
    assert not swa.held and (swa.pool.full_to_swa_index_mapping // page_size == 0).all()


def test_eviction_frees_exactly_the_pages_no_later_query_sees():
    model = tiny_gemma3()
    engine = Engine(model, page_size=2, max_running=1, max_context_len=32,
                    max_total_tokens=32, chunked_prefill_size=CHUNK)
    swa = engine.swa_pages
    full_pages = list(range(1, 7))  # a request of 12 tokens: logical pages 0..5
    swa.map_new(0, full_pages)
    assert sorted(swa.held[0]) == [0, 1, 2, 3, 4, 5]
    # the next query at position 12 sees keys 9..12 (W = 4): pages 0..3 hold keys 0..7
    assert swa.evict(0, full_pages, next_position=12) == 4
    assert sorted(swa.held[0]) == [4, 5]
    mapping = swa.pool.full_to_swa_index_mapping
    assert (mapping[2:10] // 2 == 0).all() and (mapping[10:14] // 2 > 0).all()
    assert swa.evict(0, full_pages, next_position=12) == 0
    swa.map_new(0, full_pages + [7])  # only the new page is mapped, evicted ones stay so
    assert sorted(swa.held[0]) == [4, 5, 6]
    with pytest.raises(ValueError, match="window must be >= 1"):
        SWAPageAllocator(swa.pool, 0, "cpu")


def test_kv_cache_bytes_equals_the_engines_pools():
    model = tiny_gemma3()
    for swa_pool in (False, None):
        engine = Engine(model, page_size=4, max_running=2, max_context_len=40,
                        max_total_tokens=80, chunked_prefill_size=CHUNK, swa_pool=swa_pool)
        got = sum(b.numel() * b.element_size() for b in pool_buffers(engine.token_to_kv_pool))
        want = kv_cache_bytes(kv_layout(model), 40, page_size=4, prefill_chunk=CHUNK,
                              num_requests=2, dtype=torch.float32)
        assert got == (want.full if swa_pool is False else want.hybrid)
    assert 0 < want.saved_fraction < 1


def test_swa_pool_needs_sliding_layers():
    with pytest.raises(ValueError, match="swa_pool=True needs sliding_attention layers"):
        Engine(tiny_model(), swa_pool=True)
