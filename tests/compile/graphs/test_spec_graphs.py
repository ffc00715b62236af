"""Speculative steps inside whole-step graphs: tree target verify (topk > 1, the cascade), tree
draft decode, against the float64 oracle, eager and replayed.

Every step is a fresh random batch (random prefixes over shuffled pages, NaN in every unused
cache slot, random trees) of a changing size, so buckets warm up, capture and replay while the
step buffers are refilled in place; the runner's ``debug`` check and the metadata addresses
show nothing moved. On the CPU the graphs are ``EmulatedGraph``s.
"""

from __future__ import annotations

import pytest
import torch

import xpu_ops

from compile.backend.multi_step_draft import XPUMultiStepDraftBackend
from compile.batch import ForwardMode, SpecInfo
from compile.graphs import GraphRunner
from compile.graphs import device as dev
from tests.compile.compile_helpers import Harness as ModelHarness, tiny_model
from tests.compile.graphs.spec_probe import (AttentionProbe, random_tree, tree_oracle,
                                             write_tokens)
from tests.compile.oracle import Harness, assert_close
from tests.markers import requires_gpu_graphs

SIZES = (3, 4, 1, 2, 3)  # requests per step; buckets 4 (warm-up), 4 (capture), 1, 2, 4 (replay)
BUCKETS = (1, 2, 4)
MAX_PREFIX = 70


def _flatten_sglang(masks, prefixes):
    """sglang's flattened custom mask: per request ``[D, prefix + D]`` rows, prefix visible."""
    return torch.cat([torch.cat([torch.ones(m.shape[0], p, dtype=torch.bool), m], 1).reshape(-1)
                      for m, p in zip(masks, prefixes)])


def _harness(page_size, seed, **kw):
    return Harness(page_size, seed=seed, num_pages=4096 // page_size + 64, **kw)


def _ids(h, n, vocab=512):
    return torch.randperm(vocab, generator=h.gen)[:n]


def _verify_batch(h, probe, b, d, flat, tree=True):
    """A TARGET_VERIFY batch of ``b`` new requests with random prefixes and trees (``tree``
    False: a chain, topk 1, causal)."""
    lids = sorted({layer.kv_cache_layer_id for layer in probe.layers})
    prefixes = torch.randint(0, MAX_PREFIX, (b,), generator=h.gen).tolist()
    reqs = [h.add_request(p, layers=lids) for p in prefixes]
    loc = torch.cat([h.alloc_slots(r, p, d) for r, p in zip(reqs, prefixes)])
    if tree:
        trees = [random_tree(h.gen, d) for _ in reqs]
        mask = _flatten_sglang(trees, prefixes) if flat else torch.stack(trees)
    else:
        trees, mask = [torch.ones(d, d, dtype=torch.bool).tril()] * b, None
    spec = SpecInfo(topk=2 if tree else 1, draft_token_num=d, custom_mask=mask)
    fb = h.batch(ForwardMode.TARGET_VERIFY, reqs, [d] * b, loc, prefixes, spec_info=spec)
    fb.token_to_kv_pool, fb.req_to_token_pool = h.pool, h.req_pool
    ids = _ids(h, b * d)
    pos = torch.cat([p + torch.arange(d) for p in prefixes])
    seen = [ids[row] for row in torch.block_diag(*trees)]
    return reqs, fb, ids, pos, seen, [r for r in range(b) for _ in range(d)]


def _draft_batch(h, probe, b, topk, steps, step):
    """A draft DECODE batch of ``b`` new requests at draft step ``step`` of a round of ``steps``:
    ``topk`` branches per request, each over its earlier ``step`` drafts (cached here) and the
    query token itself."""
    prefixes = torch.randint(0, MAX_PREFIX, (b,), generator=h.gen).tolist()
    lids = sorted({layer.kv_cache_layer_id for layer in probe.layers})
    reqs = [h.add_request(p, layers=lids) for p in prefixes]
    scratch = h.add_request(0)  # the round's draft slots, laid out (b, topk, steps)
    loc = h.alloc_slots(scratch, 0, b * topk * steps).view(b, topk, steps)
    h.req_pool.free(scratch.row)
    all_ids = _ids(h, b * topk * (step + 1)).view(b, topk, step + 1)
    write_tokens(h, probe, loc[..., :step].reshape(-1), all_ids[..., :step].reshape(-1))
    fb = h.batch(ForwardMode.DECODE, reqs, [topk] * b, loc.reshape(-1), prefixes,
                 spec_info=SpecInfo(topk=topk))
    fb.token_to_kv_pool, fb.req_to_token_pool = h.pool, h.req_pool
    ids = all_ids[..., step].reshape(-1)
    pos = torch.tensor([p + step for p in prefixes for _ in range(topk)])
    return reqs, fb, ids, pos, list(all_ids.reshape(b * topk, -1)), [
        r for r in range(b) for _ in range(topk)]


@pytest.mark.parametrize("page_size,hybrid", [(16, False), (64, True)])
def test_sliding_window_tree_draft_decode_in_graphs_equals_oracle(page_size, hybrid):
    """Draft decode with topk 2 on a sliding-window layer (window 6 < the branch's keys): one
    merged row per branch, its prefix and own drafts (SWA slots on the hybrid pool)."""
    topk, steps, step = 2, 3, 2
    kw = dict(swa_layers=(1,)) if hybrid else {}
    h = _harness(page_size, 325 + page_size, num_layers=2, topk=topk, num_steps=steps,
                 step_id=step, window=6, **kw)
    probe = AttentionProbe(h, [h.layer(0), h.layer(1, sliding_window_size=6)])
    runner = GraphRunner(probe, batch_sizes=BUCKETS, speculative_num_steps=steps, topk=topk,
                         emulate_graphs=True, debug=True)
    _run_schedule(h, probe, runner, lambda b: _draft_batch(h, probe, b, topk, steps, step))


def _decode_batch(h, probe, b):
    """A plain DECODE batch of ``b`` new requests with random prefixes."""
    lids = sorted({layer.kv_cache_layer_id for layer in probe.layers})
    prefixes = torch.randint(0, MAX_PREFIX, (b,), generator=h.gen).tolist()
    reqs = [h.add_request(p, layers=lids) for p in prefixes]
    loc = torch.cat([h.alloc_slots(r, p, 1) for r, p in zip(reqs, prefixes)])
    fb = h.batch(ForwardMode.DECODE, reqs, [1] * b, loc, [p + 1 for p in prefixes])
    fb.token_to_kv_pool, fb.req_to_token_pool = h.pool, h.req_pool
    ids = _ids(h, b)
    return reqs, fb, ids, torch.tensor(prefixes), [ids[t:t + 1] for t in range(b)], list(range(b))


def _mla_harness(page_size, seed, **kw):
    return _harness(page_size, seed, hq=4, hkv=1, d=48, dv=32, mla=True, **kw)


@pytest.mark.parametrize("page_size,sinks", [(1, False), (64, True)])
def test_mla_decode_in_graphs_equals_oracle(page_size, sinks, monkeypatch):
    """Absorbed MLA decode through replayed graphs: ``flash_mla_decode`` on the workspace
    buffer of the step buffers (sinks: the paged call, which takes them)."""
    calls = []
    real = xpu_ops.flash_mla_decode
    monkeypatch.setattr(xpu_ops, "flash_mla_decode",
                        lambda *a, **k: calls.append(a[5]) or real(*a, **k))
    h = _mla_harness(page_size, 360 + page_size)
    probe = AttentionProbe(h, [h.layer(0)],
                           sinks=torch.randn(h.hq, generator=h.gen) if sinks else None)
    runner = GraphRunner(probe, batch_sizes=BUCKETS, emulate_graphs=True, debug=True)
    _run_schedule(h, probe, runner, lambda b: _decode_batch(h, probe, b))
    if sinks:
        assert not calls
    else:
        workspace = runner.buffers.metadata["mla_workspace"]
        assert calls and calls[0] is workspace  # the graph steps' call reads the fixed buffer


def test_mla_tree_verify_in_graphs_equals_oracle():
    """MLA with the cascade: tree verify's prefix and expand passes over the latent cache."""
    d = 4
    h = _mla_harness(16, 370, topk=2, draft_tokens=d)
    probe = AttentionProbe(h, [h.layer(0, logit_cap=6.0)])
    runner = GraphRunner(probe, batch_sizes=BUCKETS, draft_token_num=d, emulate_graphs=True,
                         debug=True)
    _run_schedule(h, probe, runner, lambda b: _verify_batch(h, probe, b, d, flat=False))


def test_mla_tree_draft_decode_in_graphs_equals_oracle():
    topk, steps, step = 2, 3, 1
    h = _mla_harness(64, 371, topk=topk, num_steps=steps, step_id=step)
    probe = AttentionProbe(h, [h.layer(0)], sinks=torch.randn(h.hq, generator=h.gen))
    runner = GraphRunner(probe, batch_sizes=BUCKETS, speculative_num_steps=steps, topk=topk,
                         emulate_graphs=True, debug=True)
    _run_schedule(h, probe, runner, lambda b: _draft_batch(h, probe, b, topk, steps, step))


@pytest.mark.parametrize("page_size,chunk", [(1, 8), (16, 32), (64, 64)])
def test_chunked_local_in_graphs_equals_oracle(page_size, chunk):
    """Chunked-local (iRoPE) layers beside a full one inside graphs: decode, chain verify and
    draft extend, the virtual batches padded to the bucket's maximum and refilled in place."""
    d = 3
    h = _harness(page_size, 380 + page_size, num_layers=2, chunk=chunk, topk=1,
                 draft_tokens=d)
    probe = AttentionProbe(h, [h.layer(0), h.layer(1, use_irope=True)])
    runner = GraphRunner(probe, batch_sizes=BUCKETS, draft_token_num=d, emulate_graphs=True,
                         debug=True)
    mode = ForwardMode.DRAFT_EXTEND_V2
    for make in (lambda b: _decode_batch(h, probe, b),
                 lambda b: _verify_batch(h, probe, b, d, flat=False, tree=False),
                 lambda b: _draft_extend_batch(h, probe, b, d, mode)):
        _run_schedule(h, probe, runner, make)
    assert {x.forward_mode for x in runner.graph.entries} == {
        ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, mode}


def _draft_extend_batch(h, probe, b, d, mode):
    """A draft-extend batch (``mode`` DRAFT_EXTEND_V2, or EXTEND with a draft input) of ``b``
    new requests, ``d`` causal new tokens each over a random prefix."""
    lids = sorted({layer.kv_cache_layer_id for layer in probe.layers})
    prefixes = torch.randint(0, MAX_PREFIX, (b,), generator=h.gen).tolist()
    reqs = [h.add_request(p, layers=lids) for p in prefixes]
    loc = torch.cat([h.alloc_slots(r, p, d) for r, p in zip(reqs, prefixes)])
    spec = SpecInfo(topk=1, num_tokens_per_req=d)
    assert spec.is_draft_input()
    fb = h.batch(mode, reqs, [d] * b, loc, [p + d for p in prefixes], spec_info=spec)
    fb.token_to_kv_pool, fb.req_to_token_pool = h.pool, h.req_pool
    ids = _ids(h, b * d)
    pos = torch.cat([p + torch.arange(d) for p in prefixes])
    seen = [ids[t - t % d:t + 1] for t in range(b * d)]  # causal within the request
    return reqs, fb, ids, pos, seen, [r for r in range(b) for _ in range(d)]


def _addresses(meta):
    return {name: t.data_ptr() for name, t in meta.tensors()}


def _run_schedule(h, probe, runner, make_batch):
    """Each step through ``runner`` and eagerly: both equal the oracle; metadata addresses of
    every descriptor stay those of its first step."""
    addresses, counts = {}, (runner.captures, runner.replays)
    for b in SIZES:
        reqs, fb, ids, pos, seen, row_request = make_batch(b)
        expected = tree_oracle(h, probe, reqs, ids, seen, row_request)
        assert runner.can_run(fb)
        with torch.no_grad():
            out = runner(ids, pos, fb)
            (desc, bound), = [(d, m) for d, m in runner.buffers.bound.items()
                              if m is h.backend.forward_metadata]
            assert_close(out, expected)
            assert addresses.setdefault(desc, _addresses(bound)) == _addresses(bound)
            h.backend.init_forward_metadata(fb)
            assert_close(probe(ids, pos, fb), expected)
        h.req_pool.free([r.row for r in reqs])
    assert (runner.captures - counts[0], runner.replays - counts[1]) == (1, 1)
    assert sorted(d.bucket for d in addresses) == list(BUCKETS)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_tree_verify_in_graphs_equals_oracle(page_size):
    """Cascade (prefix pass + tree-masked expand pass, sinks and softcap) on a full layer and
    the merged per-draft tables on a sliding-window layer, through replayed graphs."""
    d = 5
    h = _harness(page_size, 300 + page_size, num_layers=2, topk=2, draft_tokens=d, window=6)
    sinks = torch.randn(h.hq, generator=h.gen)
    probe = AttentionProbe(h, [h.layer(0, logit_cap=4.0), h.layer(1, sliding_window_size=6)],
                           sinks=sinks)
    runner = GraphRunner(probe, batch_sizes=BUCKETS, draft_token_num=d, emulate_graphs=True,
                         debug=True)
    _run_schedule(h, probe, runner, lambda b: _verify_batch(h, probe, b, d, flat=page_size == 16))


def test_tree_verify_in_graphs_hybrid_swa_pool():
    """The same on a hybrid pool: the sliding-window layer's prefix and drafts in SWA slots."""
    d = 4
    h = _harness(16, 310, num_layers=2, swa_layers=(1,), topk=2, draft_tokens=d, window=6)
    probe = AttentionProbe(h, [h.layer(0), h.layer(1, sliding_window_size=6)])
    runner = GraphRunner(probe, batch_sizes=BUCKETS, draft_token_num=d, emulate_graphs=True,
                         debug=True)
    _run_schedule(h, probe, runner, lambda b: _verify_batch(h, probe, b, d, flat=True))


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_tree_draft_decode_in_graphs_equals_oracle(page_size):
    """Draft decode with topk 3 at draft step 1 of 3: the prefix pass (3 queries per request,
    non-causal) and each branch's expand over its own drafts, through replayed graphs."""
    topk, steps, step = 3, 3, 1
    h = _harness(page_size, 320 + page_size, topk=topk, num_steps=steps, step_id=step)
    probe = AttentionProbe(h, [h.layer(0, logit_cap=5.0)], sinks=torch.randn(h.hq,
                                                                            generator=h.gen))
    runner = GraphRunner(probe, batch_sizes=BUCKETS, speculative_num_steps=steps, topk=topk,
                         emulate_graphs=True, debug=True)
    _run_schedule(h, probe, runner, lambda b: _draft_batch(h, probe, b, topk, steps, step))
    assert {(d.draft, d.topk, d.step) for d in runner.graph.entries} == {(True, topk, step)}


@pytest.mark.parametrize("page_size,mode", [(1, ForwardMode.DRAFT_EXTEND_V2),
                                             (16, ForwardMode.EXTEND),
                                             (64, ForwardMode.DRAFT_EXTEND_V2)],
                         ids=["ps1-v2", "ps16-extend", "ps64-v2"])
def test_draft_extend_in_graphs_equals_oracle(page_size, mode):
    """Draft extend of D tokens per request (causal over prefix + new tokens, a sliding-window
    layer too) through replayed graphs; ragged widths run uncaptured."""
    d = 4
    h = _harness(page_size, 330 + page_size, num_layers=2, draft_tokens=d, window=5)
    probe = AttentionProbe(h, [h.layer(0), h.layer(1, sliding_window_size=5)])
    runner = GraphRunner(probe, batch_sizes=BUCKETS, draft_token_num=d, emulate_graphs=True,
                         debug=True)
    _run_schedule(h, probe, runner, lambda b: _draft_extend_batch(h, probe, b, d, mode))
    assert {(x.forward_mode, x.draft) for x in runner.graph.entries} == {(mode, True)}
    _, fb, *_ = _draft_extend_batch(h, probe, 2, d, mode)
    fb.extend_seq_lens_cpu = [d, d - 1]
    assert not runner.can_run(fb)


def _draft_round(h, probe, runner, multi, b):
    """One draft round of ``b`` new requests through ``runner``: forward ``i`` with
    ``multi.attn_backends[i]`` attends each branch's drafts 0..i (step i writes column i), then
    the same round eagerly. Every forward equals the oracle."""
    topk, steps = multi.topk, multi.speculative_num_steps
    prefixes = torch.randint(0, MAX_PREFIX, (b,), generator=h.gen).tolist()
    reqs = [h.add_request(p, layers=(0,)) for p in prefixes]
    if topk == 1:  # a chain: the round's slots follow the prefix in req_to_token
        loc = torch.stack([h.alloc_slots(r, p, steps) for r, p in zip(reqs, prefixes)])
    else:  # trees: the round's own slots, laid out (b, topk, steps)
        scratch = h.add_request(0)
        loc = h.alloc_slots(scratch, 0, b * topk * steps).view(b, topk, steps)
        h.req_pool.free(scratch.row)
    fb = h.batch(ForwardMode.DECODE, reqs, [topk] * b, loc.reshape(-1), prefixes,
                 spec_info=SpecInfo(topk=topk, spec_steps=steps))
    fb.token_to_kv_pool, fb.req_to_token_pool = h.pool, h.req_pool
    ids = _ids(h, b * topk * (steps - 1)).view(b * topk, steps - 1)
    rows = [r for r in range(b) for _ in range(topk)]
    expected = [tree_oracle(h, probe, reqs, ids[:, i], list(ids[:, :i + 1]), rows)
                for i in range(steps - 1)]
    pos = [torch.tensor([prefixes[r] + i for r in rows]) for i in range(steps - 1)]
    assert runner.can_run(fb)
    with torch.no_grad():
        for i, backend in enumerate(multi.attn_backends):
            fb.attn_backend = backend
            assert_close(runner(ids[:, i].contiguous(), pos[i], fb), expected[i])
        multi.init_forward_metadata(fb)
        for i, backend in enumerate(multi.attn_backends):
            fb.attn_backend = backend
            assert_close(probe(ids[:, i].contiguous(), pos[i], fb), expected[i])
    h.req_pool.free([r.row for r in reqs])


@pytest.mark.parametrize("page_size,topk", [(1, 2), (16, 1), (64, 3)])
def test_multi_step_draft_rounds_in_graphs_equal_oracle(page_size, topk):
    """``XPUMultiStepDraftBackend``: its step backends share the runner's step buffers, one
    graph per (bucket, step), each replay refilled by its own step backend."""
    steps = 4
    h = _harness(page_size, 340 + page_size)
    probe = AttentionProbe(h, [h.layer(0, logit_cap=3.0)],
                           sinks=torch.randn(h.hq, generator=h.gen))
    multi = XPUMultiStepDraftBackend(h.runner, topk=topk, speculative_num_steps=steps)
    runner = GraphRunner(probe, batch_sizes=BUCKETS, speculative_num_steps=steps, topk=topk,
                         emulate_graphs=True, debug=True)
    for b in SIZES:
        _draft_round(h, probe, runner, multi, b)
    assert (runner.captures, runner.replays) == (steps - 1, steps - 1)  # bucket 4, each step
    assert {(d.bucket, d.step) for d in runner.graph.entries} == {(4, i) for i in range(3)}
    assert runner.buffers.backend is multi.attn_backends[0]


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


def test_step_buffers_refuse_an_unrelated_backend():
    h = _harness(16, 350)
    probe = AttentionProbe(h, [h.layer(0)])
    runner = GraphRunner(probe, batch_sizes=BUCKETS, speculative_num_steps=3,
                         emulate_graphs=True)
    _draft_round(h, probe, runner, XPUMultiStepDraftBackend(h.runner, 1, 3), 2)
    other = _harness(16, 351, context_len=256)  # another pool and page table
    with pytest.raises(RuntimeError, match="cannot use the step buffers"):
        _draft_round(other, probe, runner, XPUMultiStepDraftBackend(other.runner, 1, 3), 2)


@requires_gpu_graphs
def test_tree_verify_device_graphs_replay_equals_eager():
    """Real device graphs: tree verify steps of the tiny Llama replay what eager computes, and
    the captured outputs and metadata buffers keep their addresses."""
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
