"""``compile.graphs.compiled_model``: ``compile_model(model)`` is ``torch.compile`` of the model
called inside the forward context: equal to eager over extend and decode steps (logits and every KV
buffer, over an MHA and a hybrid SWA pool), graphs counted, no recompile per new batch.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from compile.graphs import compile_model
from compile.graphs.forward_context import get_forward_context, has_forward_context
from tests.compile.compile_helpers import Harness, SWAHarness, pool_buffers, tiny_model

MIXED = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4)


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


@pytest.mark.parametrize("harness", [Harness, SWAHarness], ids=["mha_pool", "hybrid_swa_pool"])
def test_compiled_model_equals_eager(harness):
    torch._dynamo.reset()
    model = tiny_model(2, **MIXED)
    counter = CompileCounterWithBackend("aot_eager")
    _run_pair(model, compile_model(model, backend=counter, fullgraph=True), harness=harness)
    # extend: static, then dynamic when its lengths change at the second extend step; decode:
    # static (both decode steps have the same sizes)
    assert counter.frame_count == 2 + 1, counter.frame_count


def test_each_call_runs_inside_the_forward_context_of_its_batch():
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, input_ids, positions, forward_batch):
            seen.append((get_forward_context().forward_batch, get_forward_context().num_tokens))
            return input_ids + 1

    batch = object()
    out = compile_model(Probe(), backend="eager")(torch.arange(3), torch.arange(3), batch)
    torch.testing.assert_close(out, torch.arange(1, 4))
    assert seen == [(batch, 3)] and not has_forward_context()


def test_bad_model_is_rejected():
    with pytest.raises(TypeError, match="compile_model: model must be an nn.Module; expected a "
                                        "zoo model, got function"):
        compile_model(lambda x: x)


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


def test_engine_decode_across_page_boundaries_compiles_nothing_after_the_warm_up():
    """``compile.engine.Engine`` with ``compile_model``: once the first decode step of a batch
    size has compiled, decoding on past several page boundaries (page tables 2 -> 3 -> 4 -> 5
    pages wide) compiles no new graph, the ids equal eager's, and the engine marks the decode
    steps that compiled (``EngineStats.compiled_decode_steps``)."""
    from compile.engine import Engine, SamplingParams

    torch._dynamo.reset()
    model = tiny_model(2)
    prompts = [[5, 9, 2, 7, 1], [3, 8]]
    sampling = SamplingParams(max_new_tokens=14)

    def run(forward, graphs_per_step=None):
        engine = Engine(model, forward=forward, page_size=4, max_running=2, max_context_len=32)
        reqs = [engine.add_request(p, sampling) for p in prompts]
        while engine.has_work():
            engine.step()
            if graphs_per_step is not None:
                graphs_per_step.append((max(r.num_cached for r in reqs), counter.frame_count))
        return [r.output_ids for r in reqs], engine.stats

    eager, eager_stats = run(model)
    counter = CompileCounterWithBackend("eager")
    log = []
    compiled, stats = run(compile_model(model, backend=counter, fullgraph=True), log)
    assert compiled == eager
    # the engine saw the first decode step compile (the decode graph), and no other
    assert (eager_stats.compiled_decode_steps, stats.compiled_decode_steps) == (set(), {0})
    # log[0]: the prefill; log[1], log[2]: the warm-up decode steps (one batch size throughout)
    widths = {-(-longest // 4) for longest, _ in log[3:]}
    assert len(widths) >= 3, log              # the steady state crossed page boundaries
    assert {frames for _, frames in log[2:]} == {log[2][1]}, log
