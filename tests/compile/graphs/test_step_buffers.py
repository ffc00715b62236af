"""``StepBuffers`` step 3 for plain DECODE: the metadata is computed inside the captured step.

A schedule of decode steps over persistent requests (each step appends one token, so
``cache_seqlens`` and page-table rows change between replays and cross page boundaries;
requests leave and join, their rows reused over shuffled pages; batches shrink and grow inside
and across padded buckets) runs through a ``GraphRunner`` and must equal the float64 oracle and
the eager backend. After the captures, a replayed step must call no host metadata builder, and
``StepBuffers.load`` must dispatch only the input copies (``xpu_ops.testing.counted_ops``).
"""

from __future__ import annotations

import pytest
import torch

from compile.backend import backend_graph
from compile.batch import ForwardMode
from compile.graphs import GraphRunner
from compile.graphs import device as dev
from tests.compile.graphs.spec_probe import AttentionProbe, Step, tree_oracle
from tests.compile.oracle import Harness, assert_close
from tests.markers import requires_gpu_graphs
from xpu_ops.testing import counted_ops

BUCKETS = (1, 2, 4)
# requests per step: bucket 4 gets 3, 4, 4, 3, 4, 3, 4 (warm-up, capture, 5 replays), bucket 2
# gets 2, 2 (warm-up, capture), bucket 1 gets 1 (warm-up)
SIZES = (3, 4, 2, 4, 1, 3, 2, 4, 3, 4)
PREFIXES = (15, 0, 31, 16, 1, 47)  # lengths end just before, at and after page boundaries


class Schedule:
    """Persistent requests of ``h`` decoding one token per step through ``runner``."""

    def __init__(self, h: Harness, probe: AttentionProbe, runner):
        self.h, self.probe, self.runner = h, probe, runner
        self.lids = sorted({layer.kv_cache_layer_id for layer in probe.layers})
        self.live = [h.add_request(p, layers=self.lids) for p in PREFIXES]

    def turn_over(self) -> None:
        """The oldest request leaves (its ``req_to_token`` row freed); a new one joins (in
        that row, over new pages)."""
        old = self.live.pop(0)
        self.h.req_pool.free([old.row])
        prefix = int(torch.randint(0, 40, (1,), generator=self.h.gen))
        self.live.append(self.h.add_request(prefix, layers=self.lids))

    def step(self, b: int, eager: bool = True) -> torch.Tensor:
        """One decode step of ``b`` live requests in random order: runner output == oracle
        (== the eager backend's, with ``eager``); the new tokens join the requests' logical
        K/V."""
        h, probe = self.h, self.probe
        order = torch.randperm(len(self.live), generator=h.gen)[:b].tolist()
        reqs = [self.live[i] for i in order]
        lens = [r.length(self.lids[0]) for r in reqs]
        loc = torch.cat([h.alloc_slots(r, n, 1) for r, n in zip(reqs, lens)])
        fb = h.batch(ForwardMode.DECODE, reqs, [1] * b, loc, [n + 1 for n in lens])
        fb.token_to_kv_pool, fb.req_to_token_pool = h.pool, h.req_pool
        ids = torch.randperm(512, generator=h.gen)[:b]
        step = Step(reqs, fb, ids, torch.tensor(lens), [ids[t:t + 1] for t in range(b)],
                    list(range(b)))
        expected = tree_oracle(h, probe, step)
        dev_ids, pos = ids.to(h.device), step.positions.to(h.device)
        assert self.runner.can_run(fb)
        with torch.no_grad():
            out = self.runner(dev_ids, pos, fb)
            assert_close(out.cpu(), expected)
            if eager:
                h.backend.init_forward_metadata(fb)   # fresh host metadata
                assert_close(probe(dev_ids, pos, fb).cpu(), expected)
        for i, layer in enumerate(probe.layers):
            lid, new = layer.kv_cache_layer_id, ids.to(h.device)
            for t, r in enumerate(reqs):
                r.k[lid] = torch.cat([r.k[lid], h.quantize(probe.k[i][new[t:t + 1]].cpu())])
                r.v[lid] = torch.cat([r.v[lid], h.quantize(probe.v[i][new[t:t + 1]].cpu())])
        return out


def _setup(page_size: int, mla: bool = False, device="cpu"):
    kw = dict(hq=4, hkv=1, d=48, dv=32, mla=True) if mla else dict(num_layers=2, window=6)
    h = Harness(page_size, seed=500 + page_size, num_pages=4096 // page_size + 64,
                device=device, **kw)
    layers = [h.layer(0)] if mla else [h.layer(0), h.layer(1, sliding_window_size=6)]
    probe = AttentionProbe(h, layers)
    runner = GraphRunner(probe, batch_sizes=BUCKETS, debug=True,
                         emulate_graphs=torch.device(device).type == "cpu")
    return h, probe, runner, Schedule(h, probe, runner)


def decode_schedule(page_size: int, mla: bool = False, device="cpu") -> None:
    """The schedule equals the oracle; every decode step took the in-graph kind, its metadata
    views of the step buffers at fixed addresses."""
    h, probe, runner, sched = _setup(page_size, mla, device)
    addresses = {}
    for i, b in enumerate(SIZES):
        sched.step(b)
        if i % 3 == 2:
            sched.turn_over()
        for desc, meta in runner.buffers.bound.items():
            assert meta.in_graph
            ptrs = {name: t.data_ptr() for name, t in meta.tensors()}
            assert addresses.setdefault(desc, ptrs) == ptrs
    assert (runner.captures, runner.replays) == (2, 5)  # buckets 4 and 2; 4's replays
    assert sorted(d.bucket for d in runner.buffers.bound) == list(BUCKETS)


@pytest.mark.parametrize("page_size,mla", [(1, False), (16, False), (5, False), (16, True)],
                         ids=["ps1", "ps16", "ps5", "ps16-mla"])
def test_decode_metadata_in_graph_equals_oracle(page_size, mla):
    decode_schedule(page_size, mla)


def test_replayed_decode_builds_no_host_metadata(monkeypatch):
    """After the captures, replays of both buckets build and copy no metadata on the host and
    ``StepBuffers.load`` dispatches only the input copies, yet they follow the new lengths."""
    h, probe, runner, sched = _setup(16)
    for b in (3, 4, 2, 2):  # bucket 4: warm-up, capture; bucket 2: warm-up, capture
        sched.step(b)
    assert runner.captures == 2

    def refuse(*args, **kwargs):
        raise AssertionError("a replayed plain decode step built metadata on the host")
    monkeypatch.setattr(h.backend, "build_metadata", refuse)
    monkeypatch.setattr(h.backend, "init_forward_metadata", refuse)
    monkeypatch.setattr(backend_graph, "bind_metadata", refuse)
    monkeypatch.setattr(backend_graph, "refill_metadata", refuse)
    counts, load = [], runner.buffers.load

    def counted_load(*args):
        with counted_ops() as counter:
            result = load(*args)
        counts.append(counter)
        return result
    monkeypatch.setattr(runner.buffers, "load", counted_load)
    for b in (3, 2, 4):
        sched.step(b, eager=False)  # the eager reference would build host metadata
    assert runner.replays == 3
    views = {"slice", "alias"}
    for ops, padded in zip(counts, (True, False, False)):
        assert set(ops) - views <= {"copy_", "zero_", "fill_"}, ops
        # input_ids, positions, then out_cache_loc, req_pool_indices, seq_lens, seq_lens_cpu:
        # one copy_ each, and a zero_/fill_ of each padded tail
        assert sum(n for op, n in ops.items() if op not in views) == (2 + 4) * (1 + padded)


def test_other_steps_keep_host_metadata():
    """A backend with chunked-local layers keeps its decode steps on the host path, and the
    sglang hooks always fill on the host: their ``init_forward_metadata_in_graph`` writes
    nothing."""
    h = Harness(16, seed=520, chunk=32, num_pages=600)
    reqs = [h.add_request(p) for p in (9, 30)]
    loc = torch.cat([h.alloc_slots(r, p, 1) for r, p in zip(reqs, (9, 30))])
    fb = h.batch(ForwardMode.DECODE, reqs, [1, 1], loc, [10, 31])
    assert not h.backend.fills_in_graph(fb)
    plain = Harness(16, seed=521)
    reqs = [plain.add_request(p) for p in (9, 30)]
    loc = torch.cat([plain.alloc_slots(r, p, 1) for r, p in zip(reqs, (9, 30))])
    fb = plain.batch(ForwardMode.DECODE, reqs, [1, 1], loc, [10, 31])
    assert plain.backend.fills_in_graph(fb)
    plain.backend.init_cuda_graph_state(4, 4)
    plain.backend.init_forward_metadata_out_graph(fb, in_capture=True)
    meta = plain.backend.forward_metadata
    assert not meta.in_graph and meta.main.cache_seqlens.tolist() == [10, 31]
    fb.seq_lens = torch.tensor([3, 4])
    plain.backend.init_forward_metadata_in_graph(fb)  # host-filled: records nothing
    assert meta.main.cache_seqlens.tolist() == [10, 31]
    with pytest.raises(RuntimeError, match="bound metadata has in_graph=False; expected "
                                           "in_graph=True"):
        plain.backend.fill_graph_metadata(fb, plain.backend.cuda_graph_buffers, meta,
                                          in_graph=True)


@requires_gpu_graphs
class TestDeviceGraphs:
    """The schedule with real device graphs."""

    @pytest.mark.parametrize("page_size,mla", [(1, False), (16, False), (16, True)])
    def test_decode_schedule(self, page_size, mla):
        decode_schedule(page_size, mla, dev.as_device())
