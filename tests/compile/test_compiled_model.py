"""``compile.graphs.compiled_model``: ``compile_model(model)`` equals eager over extend and decode steps,
traces one layer per kind in decode steps (Dynamo stamps out the others; extend steps trace every
layer), binds the pool once and again when its buffers change, and is a plain ``torch.compile``
where region reuse is unavailable.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from compile.graphs import compiled_model
from compile.graphs.compiled_model import CompiledModel, compile_model, reusable_regions_supported
from tests.compile.compile_helpers import Harness, SWAHarness, pool_buffers, tiny_model

needs_reuse = pytest.mark.skipif(not reusable_regions_supported(),
                                 reason="torch without Dynamo region trace reuse (< 2.13)")

MIXED = dict(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4)


def _steps(h: Harness):
    """Extend (prefill past the sliding window), decode twice, then a second extend chunk."""
    yield h.extend([0, 1, 2], [6, 1, 9])
    yield h.decode([0, 1, 2])
    yield h.decode([0, 1, 2])
    yield h.extend([0, 1, 2], [2, 3, 1])


def _run_pair(model, forward, steps_of=_steps, harness=Harness):
    """Each step through ``forward`` and through eager from the same KV cache: logits equal and
    the pool's buffers afterwards equal."""
    h = harness(model)
    bufs = pool_buffers(h.kv_pool)
    with torch.no_grad():
        for b in bufs:
            b.normal_()
        for ids, pos, fb in steps_of(h):
            start = [b.clone() for b in bufs]
            ref = model(ids, pos, fb)
            after_eager = [b.clone() for b in bufs]
            for b, s in zip(bufs, start):
                b.copy_(s)
            out = forward(ids, pos, fb)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
            for i, (b, e) in enumerate(zip(bufs, after_eager)):
                torch.testing.assert_close(b, e, rtol=1e-4, atol=1e-5, msg=f"KV buffer {i}")
    return h


@needs_reuse
def test_compiled_model_equals_eager_and_traces_one_layer_per_kind(stamp_outs):
    torch._dynamo.reset()
    model = tiny_model(4, **MIXED)
    counter = CompileCounterWithBackend("aot_eager")
    forward = compile_model(model, backend=counter, fullgraph=True)
    assert forward.regions
    _run_pair(model, forward)
    # Each decode frame traced a sliding and a full layer and stamped out the other two;
    # extend frames (two of the frames at least) trace every layer: their query lengths vary.
    assert stamp_outs[0] >= 2 and stamp_outs[0] % 2 == 0, stamp_outs
    assert stamp_outs[0] <= 2 * (counter.frame_count - 2), (stamp_outs, counter.frame_count)
    assert forward.binds == 1


@needs_reuse
def test_compiled_model_rebinds_when_the_pool_replaces_its_buffers():
    torch._dynamo.reset()
    model = tiny_model(2)
    forward = compile_model(model, backend="aot_eager", fullgraph=True)

    def steps(h):
        yield h.extend([0, 1], [4, 5])  # extend steps run without regions: no binding
        yield h.decode([0, 1])
        pool = h.kv_pool
        pool.k_buffer[1] = torch.randn_like(pool.k_buffer[1])  # e.g. a pool that re-allocates
        yield h.decode([0, 1])

    _run_pair(model, forward, steps)  # the last decode step read and wrote the new buffer
    assert forward.binds == 2


def test_regions_off_is_a_plain_torch_compile(stamp_outs):
    torch._dynamo.reset()
    model = tiny_model(3)
    forward = compile_model(model, regions=False, backend="aot_eager", fullgraph=True)
    _run_pair(model, forward)
    assert stamp_outs[0] == 0 and forward.binds == 0
    assert all(m.self_attn.attn.bound_k_buffer is None for m in model.model.layers)


def test_batch_without_a_bindable_pool_runs_without_regions(stamp_outs):
    torch._dynamo.reset()
    model = tiny_model(2)
    forward = compile_model(model, backend="aot_eager", fullgraph=True)

    def steps(h):
        for ids, pos, fb in _steps(h):
            fb.token_to_kv_pool = object()  # a pool without bind_layers
            yield ids, pos, fb

    _run_pair(model, forward, steps)
    assert stamp_outs[0] == 0 and forward.binds == 0


def test_regions_true_without_reuse_raises_and_bad_model_is_rejected(monkeypatch):
    monkeypatch.setattr(compiled_model, "reusable_regions_supported", lambda: False)
    with pytest.raises(RuntimeError, match="regions=True needs Dynamo's region trace reuse"):
        CompiledModel(tiny_model(1), regions=True)
    assert not CompiledModel(tiny_model(1)).regions  # default: follows support
    with pytest.raises(TypeError, match="must be an nn.Module, got function"):
        compile_model(lambda x: x)


@needs_reuse
def test_no_recompile_per_new_batch():
    torch._dynamo.reset()
    model = tiny_model(2)
    counter = CompileCounterWithBackend("aot_eager")
    forward = compile_model(model, backend=counter, fullgraph=True)
    h = Harness(model)
    h.extend([0, 1, 2], [3, 3, 3])
    frames = []
    with torch.no_grad():
        for _ in range(5):  # a new ForwardBatch every step
            ids, pos, fb = h.decode([0, 1, 2])
            forward(ids, pos, fb)
            frames.append(counter.frame_count)
    assert frames[-1] == frames[1]


@needs_reuse
def test_batch_size_changes_after_the_dynamic_recompile():
    """Decode batches of 4, 3 and 2 requests: after the batch dimension turns dynamic,
    ``cu_seqlens_q`` is ``[s + 1]`` and the stamped-out layers must still find that size
    (``compile.graphs.regions._alias_replaced_symbols``)."""
    torch._dynamo.reset()
    model = tiny_model(3)

    def steps(h):
        yield h.extend([0, 1, 2, 3], [5, 2, 7, 3])
        for rows in ([0, 1, 2, 3], [0, 1, 2], [1, 3], [0, 2, 3]):
            yield h.decode(rows)

    _run_pair(model, compile_model(model, backend="aot_eager", fullgraph=True), steps)


@needs_reuse
def test_batch_size_changes_over_a_hybrid_swa_pool():
    """The same over sliding and full layers on an SWA pool, where the batch size symbol is
    itself replaced (``s5 + 1`` recorded, ``s28 + 1`` bound)."""
    torch._dynamo.reset()
    model = tiny_model(4, **MIXED)

    def steps(h):
        yield h.extend([0, 1, 2], [6, 1, 9])
        yield h.decode([0, 1, 2])
        yield h.decode([0, 2])

    _run_pair(model, compile_model(model, backend="aot_eager", fullgraph=True), steps,
              harness=SWAHarness)


@needs_reuse
def test_a_binding_does_not_leak_into_other_compiles_of_the_model():
    """After compile_model bound the layers to one pool, a plain torch.compile of the same model
    (and compile_model(regions=False)) over another pool read and write that other pool."""
    torch._dynamo.reset()
    model = tiny_model(2)
    _run_pair(model, compile_model(model, backend="aot_eager", fullgraph=True))
    assert all(m.self_attn.attn.bound_k_buffer is not None for m in model.model.layers)
    _run_pair(model, torch.compile(model, backend="aot_eager", fullgraph=True))  # new Harness
    _run_pair(model, compile_model(model, regions=False, backend="aot_eager", fullgraph=True))


@needs_reuse
def test_grad_mode_runs_without_regions(stamp_outs):
    torch._dynamo.reset()
    model = tiny_model(2)
    forward = compile_model(model, backend="aot_eager", fullgraph=True)
    h = Harness(model)
    ids, pos, fb = h.extend([0, 1], [4, 3])
    out = forward(ids, pos, fb)  # grad mode on: a plain torch.compile call
    assert out.requires_grad and stamp_outs[0] == 0 and forward.binds == 0
    with torch.no_grad():
        torch.testing.assert_close(out, model(ids, pos, fb), rtol=1e-4, atol=1e-5)


@needs_reuse
def test_two_models_with_other_softmax_scales_in_one_process():
    """Region code is shared between models: a second model whose layers have another float
    attribute (softmax scale of head_dim 16 vs 8) must compile (not hand a SymFloat to the op)."""
    torch._dynamo.reset()
    for model in (tiny_model(2), tiny_model(2, seed=1, head_dim=16)):
        _run_pair(model, compile_model(model, backend="aot_eager", fullgraph=True))
