"""Persistent step metadata and split-op layer replays (``compile/layer_replay.py``).

``PiecewiseModel`` moves the metadata of bucketed decode steps into fixed buffers
(``persist_forward_metadata``); each layer's split-op call records its plan runs once and replays
them on later steps. These tests run the emulated-capture path on the CPU (a captured piece
returns the same output tensors every replay, as a device graph does), poison the KV slots a
step must write, and compare logits and KV writes with eager runs over the same batch, while
lengths grow, batches shrink and grow inside a bucket, and the grad mode changes.
"""

from __future__ import annotations

import pytest
import torch

import xpu_ops

from compile import layer_replay
from compile.memory_pool import MHATokenToKVPool, SWAKVPool
from compile.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from compile.piecewise import PiecewiseModel
from tests.compile.compile_helpers import (Harness, MLAHarness, SWAHarness,
                                           eager_without_split_op as _eager, pool_buffers,
                                           tiny_model)

MIXED = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own models: no recompile budget shared with earlier tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def replays(monkeypatch):
    """Counts ``LayerReplay.replay`` calls (``[count]``)."""
    count = [0]
    original = layer_replay.LayerReplay.replay

    def counted(self):
        count[0] += 1
        original(self)
    monkeypatch.setattr(layer_replay.LayerReplay, "replay", counted)
    return count


def _step_equals_eager(pw, model, h, rows, grad_mode=torch.no_grad, draft=0, tol=1e-5,
                       kv_tol=1e-5):
    """One decode step of ``rows`` (a target-verify step of ``draft`` tokens per request when
    ``draft``) through ``pw``: the written KV slots (NaN-poisoned first) and the logits equal an
    eager run of the same batch over freshly built metadata."""
    ids, pos, fb = h.verify(rows, draft, init=True) if draft else h.decode(rows)
    pool, loc = h.kv_pool, fb.out_cache_loc
    if isinstance(pool, SWAKVPool):  # the SWA pool's buffers take translated slots
        swa_loc = pool.translate_loc_from_full_to_swa(loc)
        rows_of = ([(b, loc) for b in pool_buffers(pool.full_kv_pool)]
                   + [(b, swa_loc) for b in pool_buffers(pool.swa_kv_pool)])
    else:
        rows_of = [(b, loc) for b in pool_buffers(pool)]
    for buf, slots in rows_of:
        buf.view(buf.shape[0], -1)[slots] = float("nan")
    with grad_mode():
        out = pw(ids, pos, fb)
    written = [buf.view(buf.shape[0], -1)[slots].clone() for buf, slots in rows_of]
    persisted = fb.attn_backend.forward_metadata
    fb.attn_backend.init_forward_metadata(fb)  # the reference reads its own, fresh metadata
    ref = _eager(model, pw.layers, ids, pos, fb)  # rewrites the same slots, eagerly
    fb.attn_backend.forward_metadata = persisted
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for got, (buf, slots) in zip(written, rows_of):
        want = buf.view(buf.shape[0], -1)[slots]
        torch.testing.assert_close(got.float(), want.float(), rtol=kv_tol, atol=kv_tol)
    return fb


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_steps_replay_every_layer_and_equal_eager(replays, page_size):
    model = tiny_model(num_layers=3)
    h = Harness(model, page_size=page_size)
    h.extend([0, 1, 2], [5, 9, 3])
    _eager(model, {}, *h.extend([0, 1, 2], [5, 9, 3]))  # fill some context
    pw = PiecewiseModel(model, graph_sizes=(4,), inductor=False, emulate_graphs=True)
    schedule = [[0, 1], [0, 1], [0, 1], [0, 1, 2], [0, 1, 2], [2], [0, 1], [0, 1]]
    for rows in schedule:
        fb = _step_equals_eager(pw, model, h, rows)
        assert fb.attn_backend.forward_metadata.replays is not None
    # Each (batch size) key records at its first step in the bucket after warm-up/capture; the
    # steps after that replay all 3 layers.
    assert replays[0] >= 3 * 4, replays[0]


def test_target_verify_steps_of_two_draft_lengths_replay_and_equal_eager(replays):
    model = tiny_model(num_layers=2)
    h = Harness(model, page_size=2)
    _eager(model, {}, *h.extend([0, 1, 2], [5, 8, 3]))
    pw = PiecewiseModel(model, graph_sizes=(8, 16), inductor=False, emulate_graphs=True)
    for rows, draft in ([([0, 1], 3)] * 3 + [([0, 1], 2)] * 2 + [([0, 1, 2], 2)] * 2
                        + [([0, 1], 3)] * 2):
        fb = _step_equals_eager(pw, model, h, rows, draft=draft)
        assert fb.attn_backend.forward_metadata.replays is not None
        h.accept(rows)
    assert replays[0] > 0


def test_plans_made_on_the_fresh_metadata_are_not_kept_after_binding():
    model = tiny_model(num_layers=2)
    h = Harness(model)
    h.extend([0, 1], [4, 6])
    pw = PiecewiseModel(model, graph_sizes=(2,), inductor=False, emulate_graphs=True)
    ids, pos, fb = h.decode([0, 1])
    _eager(model, pw.layers, ids, pos, fb)  # an eager run plans calls on the fresh metadata
    with torch.no_grad():
        pw(ids, pos, fb)  # the same batch: its metadata is bound now
    for _ in range(4):  # later steps refill the bound buffers; stale plans would not see it
        _step_equals_eager(pw, model, h, [0, 1])


class _FP8Harness(Harness):
    def _kv_pool(self, model, size: int, page_size: int):
        cfg = model.config
        return MHATokenToKVPool(size, page_size, torch.float8_e4m3fn, cfg.num_key_value_heads,
                                cfg.head_dim, cfg.num_hidden_layers, self.device)


@pytest.mark.parametrize("change", ["kv_buffers", "fp8_scales"])
def test_replays_follow_replaced_kv_buffers_and_new_fp8_scales(replays, change):
    model = tiny_model(num_layers=2)
    h = _FP8Harness(model) if change == "fp8_scales" else Harness(model)
    # fp8: one e4m3 step is 1/8 relative; KV that rounds differently moves the logits a little
    tol, kv_tol = (2e-2, 0.13) if change == "fp8_scales" else (1e-5, 1e-5)
    h.extend([0, 1], [4, 6])
    pw = PiecewiseModel(model, graph_sizes=(2,), inductor=False, emulate_graphs=True)
    for _ in range(3):
        _step_equals_eager(pw, model, h, [0, 1], tol=tol, kv_tol=kv_tol)
    assert replays[0] > 0
    if change == "kv_buffers":  # a pool that re-allocated its buffers (same contents)
        h.kv_pool.k_buffer = [b.clone() for b in h.kv_pool.k_buffer]
        h.kv_pool.v_buffer = [b.clone() for b in h.kv_pool.v_buffer]
    else:
        for layer in pw.layers.values():
            layer.set_kv_scales(0.25, 0.5)
    for _ in range(3):  # the new buffers are poisoned and checked, the scales change the KV
        _step_equals_eager(pw, model, h, [0, 1], tol=tol, kv_tol=kv_tol)


def test_grad_and_inference_mode_steps_keep_separate_bindings(replays):
    model = tiny_model(num_layers=2)
    h = Harness(model)
    h.extend([0, 1], [4, 6])
    pw = PiecewiseModel(model, graph_sizes=(2,), inductor=False, emulate_graphs=True)
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode, torch.no_grad):
        for _ in range(3):
            _step_equals_eager(pw, model, h, [0, 1], grad_mode=mode)
    assert replays[0] > 0


def test_extend_steps_keep_their_own_metadata():
    model = tiny_model(num_layers=2)
    h = Harness(model)
    pw = PiecewiseModel(model, graph_sizes=(8,), inductor=False, emulate_graphs=True)
    ids, pos, fb = h.extend([0, 1], [3, 2])
    fresh = fb.attn_backend.forward_metadata
    with torch.no_grad():
        out = pw(ids, pos, fb)
    assert fb.attn_backend.forward_metadata is fresh and fresh.replays is None
    torch.testing.assert_close(out, _eager(model, pw.layers, ids, pos, fb))


def test_persistent_metadata_off_never_replays(replays):
    model = tiny_model(num_layers=2)
    h = Harness(model)
    h.extend([0, 1], [4, 6])
    pw = PiecewiseModel(model, graph_sizes=(2,), inductor=False, emulate_graphs=True,
                        persistent_metadata=False)
    for _ in range(4):
        fb = _step_equals_eager(pw, model, h, [0, 1])
    assert replays[0] == 0 and fb.attn_backend.forward_metadata.replays is None


def _deepseek():
    torch.manual_seed(0)
    return DeepseekV2ForCausalLM(DeepseekV2Config(vocab_size=64, num_hidden_layers=2,
                                                  q_lora_rank=24)).eval()


@pytest.mark.parametrize("kind", ["mla", "hybrid_swa"])
def test_layers_served_by_more_than_plan_runs_are_never_recorded(replays, kind):
    if kind == "mla":
        model = _deepseek()
        h = MLAHarness(model)
    else:
        model = tiny_model(2, **MIXED)
        h = SWAHarness(model)
    h.extend([0, 1], [4, 6])
    pw = PiecewiseModel(model, graph_sizes=(2,), inductor=False, emulate_graphs=True)
    for _ in range(4):
        fb = _step_equals_eager(pw, model, h, [0, 1])
    assert replays[0] == 0
    assert fb.attn_backend.forward_metadata.replays == {}  # persisted, nothing recorded


def test_a_replay_needs_the_same_tensors_and_token_count():
    q, k, v, out = (torch.randn(4, 8) for _ in range(4))
    calls = []

    class Plan:
        def run_matched(self, tensors):
            calls.append(tensors)

    inputs = (q, k, v, out, None, None, None, True)
    state = (torch.zeros(2), torch.zeros(2), None, None)
    replay = layer_replay.LayerReplay(inputs, 3, [(Plan(), (q,))], out[3:], state)
    assert replay.matches(inputs, 3) and replay.same_state(tuple(state))
    assert not replay.same_state((torch.zeros(2),) + state[1:])
    assert not replay.same_state(state[:2] + (torch.ones(1), None))
    assert not replay.matches(inputs, 2)
    assert not replay.matches((q.clone(), k, v, out, None, None, None, True), 3)
    assert not replay.matches((q, k, v, out, None, None, None, False), 3)
    replay.replay()
    assert len(calls) == 1 and calls[0][0] is q and bool((out[3:] == 0).all())
    assert not layer_replay.LayerReplay.recordable([])
    assert not layer_replay.LayerReplay.recordable([(Plan(), (q,)), None])
    assert not layer_replay.LayerReplay.recordable(None)


def test_debug_value_checks_turn_replays_off(replays):
    model = tiny_model(num_layers=2)
    h = Harness(model)
    h.extend([0, 1], [4, 6])
    pw = PiecewiseModel(model, graph_sizes=(2,), inductor=False, emulate_graphs=True)
    for _ in range(3):
        _step_equals_eager(pw, model, h, [0, 1])
    before = replays[0]
    assert before > 0
    with xpu_ops.debug_checks():  # the public ops' value checks must run: no plans, no replays
        for _ in range(2):
            _step_equals_eager(pw, model, h, [0, 1])
    assert replays[0] == before
