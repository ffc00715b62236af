"""Random batches through ``XPUAttentionBackend``'s sglang 0.5.23 features, against the oracle.

Each seed draws a page size (1, 16 or 64), a batch of 1-5 requests with random cached prefixes
(0-150 tokens, so prefixes end anywhere in a page) and random new lengths, then runs one EXTEND
step through a causal, a non-causal (ENCODER_ONLY) and a sliding-window layer (in a hybrid
SWA pool for odd seeds) with random Gemma-3 image spans, and one TARGET_VERIFY chain whose width (``num_tokens_per_req``) differs
from the configured draft count. Caches are NaN-poisoned, pages handed out shuffled, outputs
NaN-poisoned (``tests/compile/oracle.Harness``).
"""

import random

import pytest
import torch

import xpu_ops
from compile.backend import AttentionType
from compile.batch import ForwardMode, SpecInfo
from tests.compile.oracle import Harness, assert_close


def _image_spans(rng: random.Random, prefix: int, new: int) -> list[tuple[int, int]]:
    """At most one image per request, ending inside the new tokens (as sglang's model builds)."""
    if new < 2 or rng.random() < 0.3:
        return []
    last = rng.randrange(prefix + 1, prefix + new)
    return [(rng.randrange(max(0, last - 12), last), last)]


@pytest.mark.parametrize("seed", range(6))
def test_random_extend_batches(seed):
    rng = random.Random(seed)
    hybrid = dict(swa_layers=(2,)) if seed % 2 else {}      # the windowed layer in an SWA pool
    h = Harness(rng.choice([1, 16, 64]), seed=300 + seed, num_layers=3, window=8, **hybrid)
    b = rng.randint(1, 5)
    prefixes = [rng.randint(0, 150) for _ in range(b)]
    new = [rng.randint(1, 24) for _ in range(b)]
    reqs = [h.add_request(p, layers=(0, 1, 2)) for p in prefixes]
    spans = [_image_spans(rng, p, n) for p, n in zip(prefixes, new)]
    total = [p + n for p, n in zip(prefixes, new)]
    ids = xpu_ops.build_bidirectional_block_ids(total, spans)
    per_request = None if ids is None else [r.tolist() for r in ids.split(total)]
    layers = [h.layer(0), h.layer(1, attn_type=AttentionType.ENCODER_ONLY),
              h.layer(2, sliding_window_size=7)]
    outs, qs = h.step(ForwardMode.EXTEND, reqs, new, layers, block_ids=ids)
    for layer, out, q in zip(layers, outs, qs):
        blocks = None if layer.attn_type != AttentionType.DECODER else per_request
        assert_close(out, h.expected(reqs, new, layer, q, block_ids=blocks))


@pytest.mark.parametrize("seed", range(4))
def test_random_verify_widths(seed):
    rng = random.Random(seed)
    h = Harness(rng.choice([1, 16, 64]), seed=320 + seed, topk=1, draft_tokens=6)
    b, width = rng.randint(1, 5), rng.randint(1, 6)
    prefixes = [rng.randint(0, 150) for _ in range(b)]
    reqs = [h.add_request(p) for p in prefixes]
    loc = torch.cat([h.alloc_slots(r, p, width) for r, p in zip(reqs, prefixes)])
    spec = SpecInfo(topk=1, draft_token_num=6, num_tokens_per_req=width)
    fb = h.batch(ForwardMode.TARGET_VERIFY, reqs, [width] * b, loc, prefixes, spec_info=spec)
    h.backend.init_forward_metadata(fb)
    layer = h.layer()
    q = h.rand(b * width, h.hq * h.d).float()
    k, v = h.rand(b * width, h.hkv, h.d), h.rand(b * width, h.hkv, h.d)
    h.poisoned_output(fb, b * width, layer)
    out = layer(q, k.float(), v.float(), fb).double()
    h._append(reqs, [width] * b, 0, k, v, 1.0)
    assert_close(out, h.expected(reqs, [width] * b, layer, q.double()))
