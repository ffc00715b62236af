"""``DSAAttentionBackend`` against a float64 oracle, layer by layer, in every mode it serves.

A tiny zoo DeepSeek-V3.2 (index top-k 4; ``test_dsa_backend.tiny_v32``) runs a sequence of
steps over persistent requests: extend without cached prefix (sparse: requests past 4 keys;
dense prefill: a request of 3), extend over a cached prefix, MIXED (a prefill chunk beside a
decoding request), DECODE and TARGET_VERIFY with topk 1, at page sizes 1 and 4, over a float32
latent cache and over an fp8 one (FlashMLA's fp8 tokens, R = 128). Every DSA
layer call is recorded (its inputs, the slots the indexer picked, its output), and per query
row, in float64, written here from the math (DeepSeek-V3.2's indexer, ``act_quant``):

- the indexer's selection: keys and queries rounded to ``float8_e4m3fn`` with per-token (keys)
  and per-(token, head) (queries) scales ``max(amax, 1e-4) / 448``, scores
  ``sum_h w_h s_h relu(q8_h . k8_j) s_j`` over the row's causal keys, the top 4 (every key when
  the row has at most 4): the picked slots equal that set wherever the 4th and 5th scores are
  not tied (apart by more than 1e-4 of the scores' magnitude);
- the attention: softmax of ``scale * (q_nope . latent_j + q_rope . rope_j)`` over exactly the
  picked keys (all causal keys for dense prefill), values the latents, equals the layer's
  output; with the fp8 cache the oracle's latents are rounded as FlashMLA's layout stores them
  (per 128 values a scale ``amax / 448``, e4m3 values; rope in bfloat16).
"""

from __future__ import annotations

import pytest
import torch

import xpu_ops
from compile.backend import dsa_backend
from compile.backend.dsa_backend import DSAAttentionBackend
from compile.batch import ForwardMode
from tests.compile.backend.test_dsa_backend import TOPK, DSAHarness, tiny_v32

FP8_MAX, AMAX_FLOOR = 448.0, 1e-4


def _fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8, scale)``: rows of ``x [..., D]`` (float64) as e4m3 values and their scales."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR) / FP8_MAX
    return (x / scale).to(torch.float8_e4m3fn).double(), scale


class Recorder:
    """Every DSA layer call: inputs, picked slots, output; and per layer and slot the keys
    written so far (latent, rope, index key)."""

    def __init__(self, monkeypatch):
        self.calls, self.keys, self._slots = [], {}, None
        real_forward, real_topk = DSAAttentionBackend._forward, dsa_backend.topk_slots

        def topk(*args, **kwargs):
            self._slots = real_topk(*args, **kwargs)
            return self._slots

        def forward(backend, q, k, v, layer, fb, save_kv_cache, sinks=None, **kw):
            self._slots = None
            out = real_forward(backend, q, k, v, layer, fb, save_kv_cache, sinks=sinks, **kw)
            loc = fb.out_cache_loc.tolist()
            store = self.keys.setdefault(layer.layer_id, {})
            for i, slot in enumerate(loc):
                store[slot] = (k.reshape(len(loc), -1)[i].double(),
                               kw["k_rope"].reshape(len(loc), -1)[i].double(),
                               kw["index_k"][i].double())
            self.calls.append(dict(layer=layer, q=q.double(), q_rope=kw["q_rope"].double(),
                                   index_q=kw["index_q"].double(),
                                   weights=kw["index_weights"].double(), out=out.double(),
                                   slots=None if self._slots is None else self._slots.clone()))
            return out

        monkeypatch.setattr(DSAAttentionBackend, "_forward", forward)
        monkeypatch.setattr(dsa_backend, "topk_slots", topk)


def oracle_topk(call, t: int, key_slots: list[int], keys: dict) -> tuple[set, bool]:
    """``(slots, untied)``: the float64 top-k of row ``t`` over ``key_slots``."""
    q8, qs = _fp8(call["index_q"][t])                                    # [Hi, Di], [Hi, 1]
    w = call["weights"][t] * qs[:, 0]                                    # [Hi]
    k8, ks = _fp8(torch.stack([keys[s][2] for s in key_slots]))         # [n, Di], [n, 1]
    dots = (q8 @ k8.T) * ks[:, 0]                                        # [Hi, n]
    scores = (w[:, None] * dots.clamp_min(0)).sum(0)
    if len(key_slots) <= TOPK:
        return set(key_slots), True
    order = scores.argsort(descending=True)
    gap = scores[order[TOPK - 1]] - scores[order[TOPK]]
    untied = bool(gap > 1e-4 * (w.abs()[:, None] * dots.abs()).sum(0).max())
    return {key_slots[i] for i in order[:TOPK].tolist()}, untied


def fp8_tokens(latent: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(latent, rope)`` as an fp8 FlashMLA token holds them, in float64."""
    tiles = latent.unflatten(-1, (-1, 128))
    amax = tiles.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    tiles = (tiles / scale).to(torch.float8_e4m3fn).double() * scale
    return tiles.flatten(-2), rope.to(torch.bfloat16).double()


def oracle_attention(call, t: int, slots: list[int], keys: dict, fp8: bool) -> torch.Tensor:
    """``[H, R]`` float64 attention of row ``t`` over ``slots``."""
    heads, rope = call["q_rope"].shape[-2:]
    q_nope = call["q"][t].view(heads, -1)
    latent = torch.stack([keys[s][0] for s in slots])                    # [n, R]
    k_rope = torch.stack([keys[s][1] for s in slots])                    # [n, r]
    if fp8:
        latent, k_rope = fp8_tokens(latent, k_rope)
    scores = (q_nope @ latent.T + call["q_rope"][t].view(heads, rope) @ k_rope.T)
    return torch.softmax(scores * call["layer"].scaling, -1) @ latent


def check_step(rec: Recorder, h: DSAHarness, fb, rows_per_token: list[int]) -> tuple[int, int]:
    """Check every recorded call of one step; ``(rows checked for selection, rows)``."""
    positions = fb.positions.tolist()
    untied_rows = total = 0
    for call in rec.calls:
        keys = rec.keys[call["layer"].layer_id]
        heads, rank = call["q_rope"].shape[-2], call["q"].shape[-1] // call["q_rope"].shape[-2]
        for t, (req, pos) in enumerate(zip(rows_per_token, positions)):
            key_slots = h.req_pool.req_to_token[req, :pos + 1].tolist()
            if call["slots"] is None:                                   # dense prefill
                assert len(key_slots) <= TOPK and not h.kv_pool.fp8_latent
                picked = key_slots
            else:
                picked = [s for s in call["slots"][t].tolist() if s >= 0]
                want, untied = oracle_topk(call, t, key_slots, keys)
                assert len(picked) == min(TOPK, len(key_slots)), (t, picked)
                if untied:
                    assert set(picked) == want, (fb.forward_mode, t, picked, want)
                    untied_rows += 1
            got = call["out"][t].view(heads, rank)
            torch.testing.assert_close(got, oracle_attention(call, t, picked, keys,
                                                                 h.kv_pool.fp8_latent),
                                       atol=2e-5, rtol=2e-5)
            total += 1
    rec.calls.clear()
    return untied_rows, total


def _run(rec, h, model, step, rows, lens, mode=None):
    """One step ``step(rows, lens)`` (MIXED when ``mode`` says so), checked."""
    ids, pos, fb = step(rows, lens) if lens is not None else step(rows)
    if mode is not None:
        fb.forward_mode = mode
        h.backend.init_forward_metadata(fb)
    with torch.no_grad():
        model(ids, pos, fb)
    per_req = lens if lens is not None else [1] * len(rows)
    return check_step(rec, h, fb, [r for r, n in zip(rows, per_req) for _ in range(n)])


@pytest.mark.parametrize("page_size, fp8", [(1, False), (4, False), (4, True)])
def test_every_mode_matches_the_float64_oracle(page_size, fp8, monkeypatch):
    model = tiny_v32(kv_lora_rank=128) if fp8 else tiny_v32()
    h = DSAHarness(model, page_size=page_size,
                   kv_dtype=torch.float8_e4m3fn if fp8 else torch.float32)
    rec = Recorder(monkeypatch)
    counts = [
        _run(rec, h, model, h.extend, [0, 1], [9, 6]),                   # no prefix, sparse
        _run(rec, h, model, h.extend, [2], [3]),                         # no prefix, dense
        _run(rec, h, model, h.extend, [0, 1, 2], [5, 3, 4]),             # cached prefix
        _run(rec, h, model, lambda r, n: h.extend(r, n, init=False), [0, 1], [4, 1],
             ForwardMode.MIXED),
        _run(rec, h, model, h.decode, [0, 1, 2], None),
    ]
    ids, pos, fb = h.verify([0, 1], 3, init=True)                        # topk 1 chain
    with torch.no_grad():
        model(ids, pos, fb)
    counts.append(check_step(rec, h, fb, [0, 0, 0, 1, 1, 1]))
    untied, total = map(sum, zip(*counts))
    layers = model.config.num_hidden_layers
    assert total == layers * (15 + 3 + 12 + 5 + 3 + 6), total
    assert untied >= total // 2, (untied, total)                        # the oracle compared


def test_a_wrong_pick_fails_the_oracle(monkeypatch):
    """The check can fail: an indexer keeping the lowest-scored keys instead of the highest
    (same counts) fails the selection check."""
    real = xpu_ops.fast_topk_v2
    monkeypatch.setattr(xpu_ops, "fast_topk_v2", lambda logits, lens, k: real(-logits, lens, k))
    model = tiny_v32()
    h = DSAHarness(model, page_size=1)
    rec = Recorder(monkeypatch)
    with pytest.raises(AssertionError, match="ForwardMode.EXTEND"):
        _run(rec, h, model, h.extend, [0, 1], [9, 6])
