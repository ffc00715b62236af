"""Speculative and cascade steps inside whole-step graphs, against the float64 oracle, replayed
and eager: tree target verify (topk > 1, the cascade), tree draft decode, draft extend, the
multi-step draft backend's rounds, and inside them sliding-window and chunked-local layers (in
trees: merged rows per draft or branch), MLA (its decode workspace, the cascade,
``flash_mla_prefill`` steps), sinks and softcap; a chain verify whose width is
``num_tokens_per_req``, a non-causal layer, and deterministic inference's batch invariance
across buckets.

Every step is a fresh random batch of a changing size (``tests/compile/graphs/spec_probe.py``),
so buckets warm up, capture and replay while the step buffers are refilled in place; the
runner's ``debug`` check and the metadata addresses show nothing moved. On the CPU the graphs
are ``EmulatedGraph``s; ``TestDeviceGraphs`` runs the same scenarios with real device graphs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import xpu_ops

from compile.backend.multi_step_draft import XPUMultiStepDraftBackend
from compile.batch import ForwardMode, SpecInfo
from compile.graphs import GraphRunner, full_and_piecewise
from compile.graphs import device as dev
from tests.compile.compile_helpers import (Harness as ModelHarness, eager_without_split_op,
                                           tiny_model)
from tests.compile.graphs.spec_probe import (BUCKETS, SIZES, AttentionProbe, decode_batch,
                                             draft_batch, draft_extend_batch, random_tree,
                                             run_round, run_schedule, verify_batch)
from tests.compile.oracle import Harness
from tests.markers import requires_gpu_graphs

CPU = "cpu"


def _harness(page_size, seed, device=CPU, **kw):
    return Harness(page_size, seed=seed, num_pages=4096 // page_size + 64, device=device, **kw)


def _mla_harness(page_size, seed, device=CPU, **kw):
    return _harness(page_size, seed, device, hq=4, hkv=1, d=48, dv=32, mla=True, **kw)


def _runner(h, probe, **kw):
    """A runner over ``probe`` (emulated graphs on the CPU, device graphs elsewhere)."""
    return GraphRunner(probe, batch_sizes=BUCKETS, emulate_graphs=h.device.type == CPU,
                       debug=True, **kw)


def _sinks(h):
    return torch.randn(h.hq, generator=h.gen)


# ------------------------------------------------------------------ scenarios (any device)

def tree_verify(page_size, device=CPU):
    """Cascade (prefix pass + tree-masked expand pass, sinks and softcap) on a full layer and
    the merged per-draft rows on a sliding-window layer."""
    d = 5
    h = _harness(page_size, 300 + page_size, device, num_layers=2, topk=2, draft_tokens=d,
                 window=6)
    probe = AttentionProbe(h, [h.layer(0, logit_cap=4.0), h.layer(1, sliding_window_size=6)],
                           sinks=_sinks(h))
    runner = _runner(h, probe, draft_token_num=d)
    run_schedule(h, probe, runner, lambda b: verify_batch(h, probe, b, d, flat=page_size == 16))


def tree_draft_decode(page_size, device=CPU):
    """Draft decode with topk 3 at draft step 1 of 3: the prefix pass (3 queries per request,
    non-causal) and each branch's expand over its own drafts."""
    topk, steps, step = 3, 3, 1
    h = _harness(page_size, 320 + page_size, device, topk=topk, num_steps=steps, step_id=step)
    probe = AttentionProbe(h, [h.layer(0, logit_cap=5.0)], sinks=_sinks(h))
    runner = _runner(h, probe, speculative_num_steps=steps, topk=topk)
    run_schedule(h, probe, runner, lambda b: draft_batch(h, probe, b, topk, steps, step))
    assert {(d.draft, d.topk, d.step) for d in runner.graph.entries} == {(True, topk, step)}


def sliding_window_tree_draft_decode(page_size, hybrid, device=CPU):
    """Draft decode with topk 2 on a sliding-window layer (window 6 < a branch's keys): one
    merged row per branch, its prefix and own drafts (SWA slots on the hybrid pool)."""
    topk, steps, step = 2, 3, 2
    kw = dict(swa_layers=(1,)) if hybrid else {}
    h = _harness(page_size, 325 + page_size, device, num_layers=2, topk=topk,
                 num_steps=steps, step_id=step, window=6, **kw)
    probe = AttentionProbe(h, [h.layer(0), h.layer(1, sliding_window_size=6)])
    runner = _runner(h, probe, speculative_num_steps=steps, topk=topk)
    run_schedule(h, probe, runner, lambda b: draft_batch(h, probe, b, topk, steps, step))


def draft_extend(page_size, mode, device=CPU):
    """Draft extend of D tokens per request (causal; a sliding-window layer too); a ragged
    batch is not captured."""
    d = 4
    h = _harness(page_size, 330 + page_size, device, num_layers=2, draft_tokens=d, window=5)
    probe = AttentionProbe(h, [h.layer(0), h.layer(1, sliding_window_size=5)])
    runner = _runner(h, probe, draft_token_num=d)
    run_schedule(h, probe, runner, lambda b: draft_extend_batch(h, probe, b, d, mode))
    assert {(x.forward_mode, x.draft) for x in runner.graph.entries} == {(mode, True)}
    ragged = draft_extend_batch(h, probe, 2, d, mode).fb
    ragged.extend_seq_lens_cpu = [d, d - 1]
    assert not runner.can_run(ragged)


def multi_step_rounds(page_size, topk, device=CPU):
    """``XPUMultiStepDraftBackend``: its step backends share the runner's step buffers, one
    graph per (bucket, step), each replay refilled by its own step backend."""
    steps = 4
    h = _harness(page_size, 340 + page_size, device)
    probe = AttentionProbe(h, [h.layer(0, logit_cap=3.0)], sinks=_sinks(h))
    multi = XPUMultiStepDraftBackend(h.runner, topk=topk, speculative_num_steps=steps)
    runner = _runner(h, probe, speculative_num_steps=steps, topk=topk)
    for b in SIZES:
        run_round(h, probe, runner, multi, b)
    assert (runner.captures, runner.replays) == (steps - 1, steps - 1)  # bucket 4, each step
    assert {(d.bucket, d.step) for d in runner.graph.entries} == {(4, i) for i in range(3)}
    assert runner.buffers.backend is multi.attn_backends[0]


def chunked_local(page_size, chunk, device=CPU):
    """Chunked-local (iRoPE) layers beside a full one: decode, chain verify and draft extend,
    the virtual batches padded to the bucket's maximum and refilled in place."""
    d = 3
    h = _harness(page_size, 380 + page_size, device, num_layers=2, chunk=chunk, topk=1,
                 draft_tokens=d)
    probe = AttentionProbe(h, [h.layer(0), h.layer(1, use_irope=True)])
    runner = _runner(h, probe, draft_token_num=d)
    for make in (lambda b: decode_batch(h, probe, b),
                 lambda b: verify_batch(h, probe, b, d, tree=False),
                 lambda b: draft_extend_batch(h, probe, b, d)):
        run_schedule(h, probe, runner, make)
    assert {x.forward_mode for x in runner.graph.entries} == {
        ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2}


def chunked_local_trees(page_size, chunk, device=CPU):
    """Chunked-local layers in trees (topk > 1): tree verify and tree draft decode, one merged
    row per draft or branch cut to the query's chunk, beside a full layer's cascade."""
    d, topk, steps, step = 4, 2, 3, 2
    h = _harness(page_size, 390 + page_size, device, num_layers=2, chunk=chunk, topk=topk,
                 draft_tokens=d, num_steps=steps, step_id=step)
    probe = AttentionProbe(h, [h.layer(0), h.layer(1, use_irope=True)], sinks=_sinks(h))
    runner = _runner(h, probe, draft_token_num=d, speculative_num_steps=steps, topk=topk)
    run_schedule(h, probe, runner, lambda b: verify_batch(h, probe, b, d))
    run_schedule(h, probe, runner, lambda b: draft_batch(h, probe, b, topk, steps, step))


def mla_decode(page_size, sinks, monkeypatch, device=CPU):
    """Absorbed MLA decode: ``flash_mla_decode`` on the step buffers' workspace (with sinks,
    which it does not take, the paged call)."""
    calls, real = [], xpu_ops.flash_mla_decode
    monkeypatch.setattr(xpu_ops, "flash_mla_decode",
                        lambda *a, **k: calls.append(a[5]) or real(*a, **k))
    h = _mla_harness(page_size, 360 + page_size, device)
    probe = AttentionProbe(h, [h.layer(0)], sinks=_sinks(h) if sinks else None)
    runner = _runner(h, probe)
    run_schedule(h, probe, runner, lambda b: decode_batch(h, probe, b))
    if sinks:
        assert not calls
    else:  # the graph steps' call reads the fixed buffer
        assert calls and calls[0] is runner.buffers.metadata["mla_workspace"]


def mla_tree(kind, device=CPU):
    """MLA with the cascade over the latent cache: tree verify (softcap) or tree draft decode
    (sinks)."""
    if kind == "verify":
        h = _mla_harness(16, 370, device, topk=2, draft_tokens=4)
        probe = AttentionProbe(h, [h.layer(0, logit_cap=6.0)])
        runner = _runner(h, probe, draft_token_num=4)
        run_schedule(h, probe, runner, lambda b: verify_batch(h, probe, b, 4))
        return
    topk, steps, step = 2, 3, 1
    h = _mla_harness(64, 371, device, topk=topk, num_steps=steps, step_id=step)
    probe = AttentionProbe(h, [h.layer(0)], sinks=_sinks(h))
    runner = _runner(h, probe, speculative_num_steps=steps, topk=topk)
    run_schedule(h, probe, runner, lambda b: draft_batch(h, probe, b, topk, steps, step))


def verify_width(page_size, device=CPU):
    """A chain target verify ``num_tokens_per_req`` = 3 wide while the spec input's
    ``draft_token_num`` is 5 (sglang 0.5.23: the width is per request): the runner captures it
    at its own ``draft_token_num`` 3, beside a sliding-window layer."""
    d = 3
    h = _harness(page_size, 395 + page_size, device, num_layers=2, topk=1, draft_tokens=5,
                 window=4)
    probe = AttentionProbe(h, [h.layer(0), h.layer(1, sliding_window_size=4)], sinks=_sinks(h))
    runner = _runner(h, probe, draft_token_num=d)
    run_schedule(h, probe, runner,
                 lambda b: verify_batch(h, probe, b, d, tree=False, draft_token_num=5))
    wider = verify_batch(h, probe, 2, d + 1, tree=False, draft_token_num=5).fb
    assert not runner.can_run(wider)          # another width: not this runner's graphs


def mla_chain(page_size, device=CPU):
    """Absorbed MLA steps that go through ``flash_mla_prefill`` inside graphs: a chain target
    verify (topk 1) and a draft extend, D = 3 causal queries per request."""
    d, calls, real = 3, [], xpu_ops.flash_mla_prefill

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)
    h = _mla_harness(page_size, 375 + page_size, device, topk=1, draft_tokens=d)
    probe = AttentionProbe(h, [h.layer(0)])
    runner = _runner(h, probe, draft_token_num=d)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(xpu_ops, "flash_mla_prefill", spy)
        run_schedule(h, probe, runner, lambda b: verify_batch(h, probe, b, d, tree=False))
        run_schedule(h, probe, runner, lambda b: draft_extend_batch(h, probe, b, d))
    assert calls
    assert {x.forward_mode for x in runner.graph.entries} == {
        ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2}


def non_causal_steps(page_size, device=CPU):
    """A non-causal layer (``attn_type`` DECODER_BIDIRECTIONAL) in captured chain verify and
    draft extend steps: every query row sees all of its request's new tokens."""
    d = 4
    h = _harness(page_size, 385 + page_size, device, topk=1, draft_tokens=d)
    probe = AttentionProbe(h, [h.layer(0, attn_type="decoder_bidirectional")])
    runner = _runner(h, probe, draft_token_num=d)

    def all_new_tokens(step):
        step.seen = [step.ids[r * d:(r + 1) * d] for r in step.row_request]
        return step
    run_schedule(h, probe, runner,
                 lambda b: all_new_tokens(verify_batch(h, probe, b, d, tree=False)))
    run_schedule(h, probe, runner, lambda b: all_new_tokens(draft_extend_batch(h, probe, b, d)))


def deterministic_replays(page_size, mla=False, device=CPU):
    """Deterministic inference inside graphs: every replayed call passes ``num_splits=1``
    (MLA: ``num_kv_splits=1``), and request 0's replayed decode output has the same bits in
    buckets 1, 2 and 4 beside longer requests (its padded rows and partners change)."""
    make = _mla_harness if mla else _harness
    h = make(page_size, 398 + page_size, device, context_len=1024)
    h.runner.server_args.enable_deterministic_inference = True
    h.backend = type(h.backend)(h.runner)
    probe = AttentionProbe(h, [h.layer(0)])
    runner = _runner(h, probe)
    name, key = ("flash_mla_decode", "num_kv_splits") if mla else (
        "flash_attn_with_kvcache", "num_splits")
    real, splits = getattr(xpu_ops, name), []

    def spy(*a, **k):
        splits.append(k[key])
        return real(*a, **k)

    class AtTheOp(TorchDispatchMode):  # the plain layer calls the op without the wrapper
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.xpu_ops.flash_attn_with_kvcache.default:
                splits.append(args[20])  # num_splits
            return func(*args, **(kwargs or {}))
    lens = [40, 700, 3, 900]
    reqs = [h.add_request(n) for n in lens]
    q_ids = torch.randint(0, 512, (4,), generator=h.gen)
    outs = []
    with pytest.MonkeyPatch.context() as mp, torch.no_grad(), (
            contextlib.nullcontext() if mla else AtTheOp()):
        if mla:
            mp.setattr(xpu_ops, name, spy)
        for rows in ([0], [0, 1], [0, 1, 2, 3]) * 3:   # warm-up, capture, replay per bucket
            fb = h.batch(ForwardMode.DECODE, [reqs[i] for i in rows], [1] * len(rows),
                         torch.zeros(len(rows), dtype=torch.int64, device=h.device),
                         [lens[i] for i in rows])
            fb.token_to_kv_pool, fb.req_to_token_pool = h.pool, h.req_pool
            ids = q_ids[torch.tensor(rows)].to(h.device)
            pos = torch.tensor([lens[i] - 1 for i in rows], device=h.device)
            outs.append(runner(ids, pos, fb)[0].cpu())
    assert (runner.captures, runner.replays) == (3, 3) and set(splits) == {1}
    assert all(torch.equal(o, outs[0]) for o in outs), "a bucket changed request 0's output"


def tiny_llama_draft_extend(device=CPU):
    """DRAFT_EXTEND_V2 steps of the tiny Llama: its LM head picks each request's last token
    from the step buffers' ``extend_seq_lens`` inside the graph; the runner returns one row
    per request, as eager does."""
    d = 3
    model = tiny_model(device=device)
    h = ModelHarness(model, page_size=16, device=device)
    with torch.no_grad():
        model(*h.extend([0, 1, 2, 3], [17, 3, 40, 16]))
    runner = GraphRunner(model, batch_sizes=(2, 4), draft_token_num=d, debug=True,
                         emulate_graphs=torch.device(device).type == CPU)
    for rows in ([0, 1, 2], [3, 1], [0, 1, 2, 3], [2, 0], [1, 2, 3]):
        ids, pos, fb = h.extend(rows, [d] * len(rows), init=False)
        fb.forward_mode = ForwardMode.DRAFT_EXTEND_V2
        fb.spec_info = SpecInfo(topk=1, num_tokens_per_req=d)
        assert runner.can_run(fb)
        with torch.no_grad():
            out = runner(ids, pos, fb)
            h.backend.init_forward_metadata(fb)
            ref = model(ids, pos, fb)
        assert out.shape == ref.shape == (len(rows), model.config.vocab_size)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert (runner.captures, runner.replays) == (2, 1)  # bucket 4: 3 steps, 2: 2 steps


def serving_path_trees(device=CPU):
    """The serving path (``full_and_piecewise``): tree verify steps of the tiny Llama replay
    whole-step graphs recorded through the piecewise model (its split op on the step buffers'
    cascade metadata), equal to the model run eagerly."""
    d, topk = 3, 2
    model = tiny_model(device=device)
    h = ModelHarness(model, page_size=4, device=device)
    runner = full_and_piecewise(model, batch_sizes=(2, 4), graph_sizes=(8, 16), inductor=False,
                                emulate_graphs=torch.device(device).type == CPU, debug=True,
                                draft_token_num=d, topk=topk)
    with torch.no_grad():
        runner(*h.extend([0, 1, 2, 3], [5, 3, 9, 2], init=False))
    gen = torch.Generator().manual_seed(1)
    for rows in ([0, 1, 2], [0, 1, 2, 3], [1, 2, 3], [0, 2]):
        ids, pos, fb = h.verify(rows, d)
        trees = torch.stack([random_tree(gen, d) for _ in rows]).to(device)
        fb.spec_info = SpecInfo(topk=topk, draft_token_num=d, custom_mask=trees)
        assert runner.can_run(fb)
        with torch.no_grad():
            out = runner(ids, pos, fb)
        h.backend.init_forward_metadata(fb)
        ref = eager_without_split_op(model, runner.forward.layers, ids, pos, fb)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        h.accept(rows)
    assert (runner.captures, runner.replays) == (1, 1)  # bucket 4: 3 steps
    assert runner.forward.backend.stats["captures"] == 0  # pieces never capture inside a step


# ------------------------------------------------------------------ CPU (emulated graphs)

def test_serving_path_tree_verify_equals_eager():
    torch._dynamo.reset()
    serving_path_trees()


def test_tiny_llama_draft_extend_in_graphs_equals_eager():
    tiny_llama_draft_extend()


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_tree_verify_in_graphs_equals_oracle(page_size):
    tree_verify(page_size)


def test_tree_verify_in_graphs_hybrid_swa_pool():
    """Tree verify on a hybrid pool: the sliding-window layer's prefix and drafts in SWA
    slots."""
    d = 4
    h = _harness(16, 310, num_layers=2, swa_layers=(1,), topk=2, draft_tokens=d, window=6)
    probe = AttentionProbe(h, [h.layer(0), h.layer(1, sliding_window_size=6)])
    runner = _runner(h, probe, draft_token_num=d)
    run_schedule(h, probe, runner, lambda b: verify_batch(h, probe, b, d, flat=True))


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_tree_draft_decode_in_graphs_equals_oracle(page_size):
    tree_draft_decode(page_size)


@pytest.mark.parametrize("page_size,hybrid", [(16, False), (64, True)])
def test_sliding_window_tree_draft_decode_in_graphs_equals_oracle(page_size, hybrid):
    sliding_window_tree_draft_decode(page_size, hybrid)


@pytest.mark.parametrize("page_size,mode", [(1, ForwardMode.DRAFT_EXTEND_V2),
                                             (16, ForwardMode.EXTEND),
                                             (64, ForwardMode.DRAFT_EXTEND_V2)],
                         ids=["ps1-v2", "ps16-extend", "ps64-v2"])
def test_draft_extend_in_graphs_equals_oracle(page_size, mode):
    draft_extend(page_size, mode)


@pytest.mark.parametrize("page_size,topk", [(1, 2), (16, 1), (64, 3)])
def test_multi_step_draft_rounds_in_graphs_equal_oracle(page_size, topk):
    multi_step_rounds(page_size, topk)


@pytest.mark.parametrize("page_size,chunk", [(1, 8), (16, 32), (64, 64)])
def test_chunked_local_in_graphs_equals_oracle(page_size, chunk):
    chunked_local(page_size, chunk)


@pytest.mark.parametrize("page_size,chunk", [(1, 8), (16, 16), (64, 64)])
def test_chunked_local_trees_in_graphs_equal_oracle(page_size, chunk):
    chunked_local_trees(page_size, chunk)


@pytest.mark.parametrize("page_size,sinks", [(1, False), (64, True)])
def test_mla_decode_in_graphs_equals_oracle(page_size, sinks, monkeypatch):
    mla_decode(page_size, sinks, monkeypatch)


@pytest.mark.parametrize("kind", ["verify", "draft_decode"])
def test_mla_tree_in_graphs_equals_oracle(kind):
    mla_tree(kind)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_verify_width_from_num_tokens_per_req_in_graphs_equals_oracle(page_size):
    verify_width(page_size)


@pytest.mark.parametrize("page_size", [1, 64])
def test_mla_chain_verify_and_draft_extend_in_graphs_equal_oracle(page_size):
    mla_chain(page_size)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_non_causal_layer_in_graphs_equals_oracle(page_size):
    non_causal_steps(page_size)


@pytest.mark.parametrize("page_size,mla", [(1, False), (16, False), (16, True)])
def test_deterministic_inference_in_graphs_is_batch_invariant(page_size, mla):
    deterministic_replays(page_size, mla)


def test_multi_step_sglang_hooks_and_bad_arguments():
    """sglang's runner calls reach every step backend: each binds its own metadata at capture
    (its branch sees ``step + 1`` drafts) and refills it in place at replay."""
    h = _harness(16, 345)
    with pytest.raises(ValueError, match="expected topk >= 1 and speculative_num_steps >= 2"):
        XPUMultiStepDraftBackend(h.runner, topk=2, speculative_num_steps=1)
    multi = XPUMultiStepDraftBackend(h.runner, topk=2, speculative_num_steps=3)
    multi.init_cuda_graph_state(4, 4 * 2 * 3)
    reqs = [h.add_request(p) for p in (5, 20)]
    loc = h.alloc_slots(h.add_request(0), 0, 2 * 2 * 3)
    fb = h.batch(ForwardMode.IDLE, reqs, [2, 2], loc, [5, 20], spec_info=SpecInfo(topk=2))
    multi.init_forward_metadata_out_graph(fb, in_capture=True)  # seen as DECODE
    bound = [b.forward_metadata for b in multi.attn_backends]
    assert [m.expand.cache_seqlens.tolist() for m in bound] == [[1] * 4, [2] * 4]
    multi.init_forward_metadata_out_graph(fb)
    multi.init_forward_metadata_in_graph(fb)
    assert all(b.forward_metadata is m for b, m in zip(multi.attn_backends, bound))


def test_draft_steps_retarget_to_an_unrelated_backend():
    """A draft backend over another pool and page table cannot share the step buffers: the
    runner drops them and its whole-step graphs, captures again over the new backend's, and
    every draft forward still equals the oracle; back on the first backend, the same again."""
    h = _harness(16, 350)
    probe = AttentionProbe(h, [h.layer(0)])
    runner = _runner(h, probe, speculative_num_steps=3)
    run_round(h, probe, runner, XPUMultiStepDraftBackend(h.runner, 1, 3), 2)
    assert runner.retargets == 0
    other = _harness(16, 351, context_len=256)  # another pool and page table
    run_round(other, probe, runner, XPUMultiStepDraftBackend(other.runner, 1, 3), 2)
    assert runner.retargets == 1
    run_round(h, probe, runner, XPUMultiStepDraftBackend(h.runner, 1, 3), 2)
    assert runner.retargets == 2


# ------------------------------------------------------------------ device graphs (gpu)

@requires_gpu_graphs
class TestDeviceGraphs:
    """The scenarios above with real device graphs, one page size each (small)."""

    def test_tree_verify(self):
        tree_verify(16, dev.as_device())

    def test_tree_draft_decode(self):
        tree_draft_decode(64, dev.as_device())

    def test_sliding_window_tree_draft_decode_hybrid(self):
        sliding_window_tree_draft_decode(16, True, dev.as_device())

    def test_draft_extend(self):
        draft_extend(16, ForwardMode.DRAFT_EXTEND_V2, dev.as_device())

    def test_multi_step_rounds(self):
        multi_step_rounds(16, 2, dev.as_device())

    def test_chunked_local(self):
        chunked_local(16, 32, dev.as_device())

    def test_chunked_local_trees(self):
        chunked_local_trees(16, 16, dev.as_device())

    def test_mla_decode(self, monkeypatch):
        mla_decode(64, False, monkeypatch, dev.as_device())

    def test_mla_tree_verify(self):
        mla_tree("verify", dev.as_device())

    def test_verify_width(self):
        verify_width(16, dev.as_device())

    def test_mla_chain(self):
        mla_chain(64, dev.as_device())

    def test_non_causal_layer(self):
        non_causal_steps(16, dev.as_device())

    def test_deterministic_replays(self):
        deterministic_replays(16, device=dev.as_device())

    def test_deterministic_replays_mla(self):
        deterministic_replays(64, mla=True, device=dev.as_device())

    def test_serving_path_tree_verify(self):
        torch._dynamo.reset()
        serving_path_trees(dev.as_device())

    def test_tiny_llama_draft_extend(self):
        tiny_llama_draft_extend(dev.as_device())

    def test_tiny_llama_tree_verify_replay_equals_eager(self):
        """Tree verify steps of the tiny Llama replay what eager computes, and the metadata
        buffers keep their addresses."""
        device, d = dev.as_device(), 4
        model = tiny_model(device=device)
        h = ModelHarness(model, page_size=16, device=device)
        with torch.no_grad():
            model(*h.extend([0, 1, 2, 3], [17, 3, 40, 16]))
        runner = GraphRunner(model, batch_sizes=(2, 4), draft_token_num=d, debug=True)
        gen, buffers = torch.Generator().manual_seed(5), None
        for rows in ([0, 1, 2], [3, 1], [0, 1, 2, 3], [2, 0], [1, 2, 3]):
            ids, pos, fb = h.verify(rows, d)
            trees = torch.stack([random_tree(gen, d) for _ in rows]).to(device)
            fb.spec_info = SpecInfo(topk=2, draft_token_num=d, custom_mask=trees)
            assert runner.can_run(fb)
            with torch.no_grad():
                out = runner(ids, pos, fb)
                h.backend.init_forward_metadata(fb)
                torch.testing.assert_close(out, model(ids, pos, fb), rtol=1e-4, atol=1e-4)
            h.accept(rows)
            ptrs = {name: t.data_ptr() for name, t in runner.buffers.metadata.items()}
            assert ptrs == (buffers := buffers or ptrs)
        assert (runner.captures, runner.replays) == (2, 1)  # bucket 4: 3 steps, 2: 2 steps
