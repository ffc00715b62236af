"""``GraphRunner`` and ``full_and_piecewise``: step buffers, in-place metadata refill, one
metadata build per step, whole-step graphs for decode / verify / draft decode, pieces for the
rest.

On the CPU the runner runs its step-buffer path without capture (same padding, same
``fill_graph_metadata`` refill) or with emulated graphs (``TapeGraph``: a replay reruns the
recorded ops, never the Python), so stale-metadata bugs show here too; the ``gpu`` tests
capture and replay.
"""

from __future__ import annotations

from unittest import mock

import torch
from expecttest import TestCase

from compile.graphs import device as dev
from compile.batch import ForwardMode, SpecInfo
from compile.engine import Engine, SamplingParams
from compile.graphs import GraphRunner, PiecewiseModel, full_and_piecewise
from tests.compile.compile_helpers import Harness, tiny_model
from tests.compile.graphs.test_piecewise import _eager, _make_step
from tests.markers import requires_gpu_graphs

# batch sizes in request counts: grow, shrink across buckets, shrink inside one, grow again
SCHEDULE = ([0, 1, 2], [0, 1, 2, 3, 4], [1], [0, 1, 2], [4, 3], [0, 1, 2, 3, 4], [2, 0, 4])


def _step_equals_eager(test, runner, model, h, ids, pos, fb, tol=1e-5):
    """One step the runner captures: its output equals the eager model's on fresh metadata."""
    test.assertTrue(runner.can_run(fb))
    with torch.no_grad():
        out = runner(ids, pos, fb)
        h.backend.init_forward_metadata(fb)  # eager reference: fresh metadata
        ref = model(ids, pos, fb)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def _decode_steps(test, runner, model, h, schedule=SCHEDULE, tol=1e-5):
    for rows in schedule:
        _step_equals_eager(test, runner, model, h, *h.decode(rows), tol=tol)  # longer seq_lens


def _prefill(model, h, rows, lens):
    with torch.no_grad():
        model(*h.extend(rows, lens))


def _draft(h, rows):
    """A draft DECODE step (topk 1, draft step 0): one new slot per request, ``seq_lens`` the
    prefix without it (the backend attends ``seq_lens + 1`` keys)."""
    ids, pos, fb = h.decode(rows, init=False)
    fb.seq_lens, fb.seq_lens_cpu = fb.seq_lens - 1, fb.seq_lens_cpu - 1
    fb.seq_lens_sum -= len(rows)
    fb.spec_info = SpecInfo(topk=1)
    return ids, pos, fb


class TestGraphRunnerCPU(TestCase):
    """The step-buffer path without capture (``capture=False``): same padding and in-place
    metadata refill as a captured step, so stale-metadata bugs show on the CPU."""

    def test_static_steps_equal_eager_when_batches_shrink_and_grow(self):
        model = tiny_model()
        h = Harness(model, page_size=4)
        _prefill(model, h, [0, 1, 2, 3, 4], [5, 3, 8, 1, 4])  # lengths end mid-page
        runner = GraphRunner(model, batch_sizes=(1, 2, 4, 8), capture=False)
        _decode_steps(self, runner, model, h)
        # buckets of 3, 5, 1, 3, 2, 5, 3 requests: 4, 8, 1, 4, 2, 8, 4
        self.assertEqual(sorted(d.bucket for d in runner.buffers.bound), [1, 2, 4, 8])
        self.assertEqual((runner.static_steps, runner.captures), (len(SCHEDULE), 0))

    def test_extend_builds_its_metadata_and_runs_forward(self):
        model = tiny_model()
        h = Harness(model)
        runner = GraphRunner(model, batch_sizes=(2,), capture=False)
        ids, pos, fb = h.extend([0, 1], [3, 2], init=False)  # no metadata yet: the runner's
        with torch.no_grad():
            out = runner(ids, pos, fb)
        self.assertFalse(runner.can_run(fb))
        h.backend.init_forward_metadata(fb)
        with torch.no_grad():
            torch.testing.assert_close(out, model(ids, pos, fb))
        self.assertIsNone(runner.buffers)

    def test_target_verify_static_steps_equal_eager(self):
        model = tiny_model()
        h = Harness(model)
        _prefill(model, h, [0, 1, 2], [4, 7, 2])
        d = 3  # draft tokens per request
        runner = GraphRunner(model, draft_token_num=d, batch_sizes=(2, 4), capture=False)
        for rows in ([0, 1, 2], [1, 2], [0, 1, 2]):
            _step_equals_eager(self, runner, model, h, *h.verify(rows, d))
            h.accept(rows)
        self.assertEqual(sorted(d.bucket for d in runner.buffers.bound), [2, 4])
        ids, pos, fb = h.verify([0], d + 1)
        self.assertFalse(runner.can_run(fb))  # another draft count: not this runner's graphs
        ids, pos, fb = h.verify([0], d)
        fb.spec_info = SpecInfo(topk=1, draft_token_num=d, num_tokens_per_req=d - 1)
        self.assertFalse(runner.can_run(fb))  # another width (sglang's num_tokens_per_req)

    def test_draft_decode_static_steps_equal_eager(self):
        model = tiny_model()
        h = Harness(model, page_size=2)
        _prefill(model, h, [0, 1, 2, 3], [3, 6, 1, 2])
        runner = GraphRunner(model, batch_sizes=(2, 4), capture=False)
        for rows in ([0, 1, 2], [3], [0, 1, 2, 3], [2, 0]):
            _step_equals_eager(self, runner, model, h, *_draft(h, rows))
        self.assertTrue(all(d.draft for d in runner.buffers.bound))
        ids, pos, fb = _draft(h, [0])
        fb.spec_info = SpecInfo(topk=2)
        self.assertFalse(runner.can_run(fb))  # a tree of another topk than the runner's

    def test_emulated_capture_replays_with_fixed_inputs(self):
        model = tiny_model()
        h = Harness(model, page_size=4)
        _prefill(model, h, [0, 1, 2, 3, 4], [5, 3, 8, 1, 4])
        runner = GraphRunner(model, batch_sizes=(1, 2, 4, 8), emulate_graphs=True, debug=True)
        _decode_steps(self, runner, model, h)
        # buckets 4 (3 uses) and 8 (2 uses): a warm-up step, then capture, then replays
        self.assertEqual((runner.captures, runner.replays), (2, 1))
        self.assertEqual(sorted(d.bucket for d in runner.graph.entries), [4, 8])

    def test_emulated_replay_reads_the_tensor_the_capture_read(self):
        """A forward that reads a tensor rebound between steps: the replayed step multiplies
        by the tensor of the capture (as a device graph does), not the new one."""
        model = tiny_model()
        h = Harness(model, page_size=4)
        _prefill(model, h, [0, 1, 2], [5, 3, 8])
        holder = {"scale": torch.ones(())}
        runner = GraphRunner(model, batch_sizes=(4,), emulate_graphs=True,
                             forward=lambda *a: model(*a) * holder["scale"])
        for step, scale in enumerate((1.0, 2.0, 3.0)):  # warm-up, capture, replay
            holder["scale"] = torch.full((), scale)  # rebound, not written in place
            ids, pos, fb = h.decode([0, 1, 2])
            with torch.no_grad():
                out = runner(ids, pos, fb)
                h.backend.init_forward_metadata(fb)
                ref = model(ids, pos, fb)
            torch.testing.assert_close(out, ref * min(scale, 2.0), rtol=1e-5, atol=1e-5)
        self.assertEqual((runner.captures, runner.replays), (1, 1))


@requires_gpu_graphs
class TestGraphRunnerGPU(TestCase):
    def test_capture_replay_equals_eager_and_buffers_stay(self):
        device = dev.as_device()
        model = tiny_model(device=device)
        h = Harness(model, page_size=16, device=device)
        _prefill(model, h, [0, 1, 2, 3, 4], [17, 3, 40, 1, 16])
        runner = GraphRunner(model, batch_sizes=(1, 2, 4, 8), debug=True)
        _decode_steps(self, runner, model, h, schedule=SCHEDULE + SCHEDULE, tol=1e-4)
        self.assertEqual(runner.captures, 4)  # every bucket used twice or more: 1, 2, 4, 8
        ptrs = {d: e.output.data_ptr() for d, e in runner.graph.entries.items()}
        buffers = {name: t.data_ptr() for name, t in runner.buffers.metadata.items()}
        _decode_steps(self, runner, model, h, tol=1e-4)
        self.assertEqual(runner.captures, 4)  # replays only
        self.assertEqual({d: e.output.data_ptr() for d, e in runner.graph.entries.items()}, ptrs)
        self.assertEqual({n: t.data_ptr() for n, t in runner.buffers.metadata.items()}, buffers)

    def test_compiled_model_capture(self):
        device = dev.as_device()
        model = tiny_model(device=device)
        h = Harness(model, device=device)
        _prefill(model, h, [0, 1, 2], [5, 9, 2])
        runner = GraphRunner(model, batch_sizes=(2, 4),
                             forward=torch.compile(model, fullgraph=True))
        _decode_steps(self, runner, model, h, schedule=([0, 1, 2], [0, 1], [2, 1, 0]) * 2,
                      tol=1e-4)
        # buckets 4 (4 uses: warm-up, capture, 2 replays) and 2 (2 uses: captured last)
        self.assertEqual((runner.captures, runner.replays), (2, 2))


def _steps_equal_eager(test, forward, model, layers, h, steps, tol=1e-5):
    """Run ``steps`` (``(kind, rows, lens)``) through ``forward`` (which builds the metadata);
    each output must equal the eager model's (layers back on the backend, fresh metadata)."""
    for kind, rows, lens in steps:
        ids, pos, fb = _make_step(h, kind, rows, lens)
        with torch.no_grad():
            out = forward(ids, pos, fb)
        h.backend.init_forward_metadata(fb)  # decode steps left graph-bound metadata behind
        torch.testing.assert_close(out, _eager(model, layers, ids, pos, fb), rtol=tol, atol=tol)


def _record_piece_sizes(pw):
    """Patch ``pw.graph_size_for`` to log ``(mode, batch_size, bucket)`` of every step it pads
    (full-graph steps never ask it)."""
    log, graph_size_for = [], pw.graph_size_for

    def logged(num_tokens, fb):
        size = graph_size_for(num_tokens, fb)
        log.append((fb.forward_mode, fb.batch_size, size))
        return size

    pw.graph_size_for = logged
    return log


# (kind, rows, lens); buckets: requests (1, 2, 4) for full graphs, tokens (4, 8, 16) for pieces;
# a descriptor's first step warms up, the second captures, later ones replay
FULL_AND_PIECEWISE_STEPS = [
    ("extend", [0, 1], [3, 4]),  # T 7 -> 8: piece warm-up
    ("extend", [2, 3], [5, 3]),  # T 8 -> 8: piece capture
    ("decode", [0, 1, 2], None), ("decode", [0, 1, 2, 3], None),  # full bucket 4: warm-up,
    ("decode", [2, 1, 0], None),  # capture, replay
    ("decode", [0, 1], None), ("decode", [1, 0], None),  # full bucket 2: warm-up, capture
    ("mixed", [0, 1], [1, 3]), ("mixed", [2, 3], [2, 1]),  # T 4, 3 -> 4: warm-up, capture
    ("extend", [3, 0], [1, 6]),  # cached prefix, T 7 -> 8: piece replay
    ("decode", [0, 1, 2], None), ("decode", [3, 1], None),  # full 4 and 2: replays
    ("decode", [2], None),  # full bucket 1: warm-up
    ("decode", [0, 1, 2, 3, 4], None), ("decode", [0, 1, 2, 3, 4], None),  # 5 > 4 requests:
]  # pieces, token bucket 8: warm-up, capture


class TestFullAndPiecewiseCPU(TestCase):
    """``full_and_piecewise`` on the CPU, both kinds of graph emulated."""

    def setUp(self):
        torch._dynamo.reset()

    def test_schedule_equals_eager_and_full_steps_never_pad_pieces(self):
        num_layers = 2
        model = tiny_model(num_layers=num_layers)
        h = Harness(model, page_size=4)
        runner = full_and_piecewise(model, batch_sizes=(1, 2, 4), graph_sizes=(4, 8, 16),
                                    inductor=False, emulate_graphs=True, debug=True)
        pw = runner.forward
        self.assertIsInstance(pw, PiecewiseModel)
        log = _record_piece_sizes(pw)
        _steps_equal_eager(self, runner, model, pw.layers, h, FULL_AND_PIECEWISE_STEPS)
        self.assertEqual((runner.captures, runner.replays), (2, 3))  # buckets 4 (2), 2 (1)
        self.assertEqual(runner.static_steps, 8)  # decode steps of <= 4 requests
        # the pieces padded only the non-full steps: 5 extend/mixed, 2 decode of 5 requests
        self.assertEqual([s for mode, b, s in log if mode == ForwardMode.DECODE], [8, 8])
        self.assertEqual(len(log), 5 + 2)
        # extend at 8, mixed at 4, decode (5 requests) at 8: num_layers + 1 pieces each
        self.assertEqual(pw.backend.stats["captures"], 3 * (num_layers + 1))
        # Dynamo graphs: extend, decode (dynamic: the full steps and the 5-request steps share
        # it), mixed, decode (1 request, specialised)
        self.assertEqual(pw.backend.stats["graphs"], 4)
        self.assertIs(runner.buffers.tokens, pw.tokens)  # one pair of padded token buffers

    def test_piece_capture_inside_an_outer_capture_raises(self):
        model = tiny_model()
        h = Harness(model)
        pw = PiecewiseModel(model, graph_sizes=(8,), inductor=False, emulate_graphs=True)
        with torch.no_grad():
            pw(*h.extend([0, 1], [3, 4]))  # warm-up at bucket 8
            with mock.patch("compile.graphs.graph_wrapper.capture_in_progress",
                            return_value=True), \
                    self.assertRaisesRegex(RuntimeError, "graphs cannot nest"):
                pw(*h.extend([0, 1], [2, 2]))  # would capture inside "another capture"
        self.assertEqual(pw.backend.stats["captures"], 0)


class TestOneMetadataBuildPerStep(TestCase):
    """The engine's steps make their attention metadata exactly once: eagerly every step builds
    it on the host; under graphs the captured plain DECODE steps build none on the host (their
    graph computes it from the step buffers) and every other step builds it once (before, the
    engine built it and the runner built it again)."""

    def test_builds_equal_steps(self):
        forwards = {
            "eager": lambda m: m,
            "graphs": lambda m: full_and_piecewise(m, batch_sizes=(1, 2, 4),
                                                   graph_sizes=(8, 16), inductor=False,
                                                   emulate_graphs=True),
        }
        outputs = {}
        for mode, make in forwards.items():
            torch._dynamo.reset()
            model = tiny_model()
            forward = make(model)
            engine = Engine(model, forward=forward, page_size=4, max_running=3,
                            max_context_len=32, max_total_tokens=96, chunked_prefill_size=8)
            builds, build = [], engine.attn_backend.build_metadata
            engine.attn_backend.build_metadata = lambda fb, graph=False: (
                builds.append(fb.forward_mode), build(fb, graph))[1]
            prompts = [[5, 9, 2, 7, 1], [3, 4], [8, 1, 6, 2, 2, 9, 4, 3, 1]]
            with torch.no_grad():
                outputs[mode] = engine.generate(prompts, SamplingParams(max_new_tokens=6))
            in_graph = getattr(forward, "static_steps", 0)  # plain decode steps, <= 4 requests
            self.assertEqual(len(builds), engine.stats.steps - in_graph, mode)  # 1 per step
            if mode == "eager":
                self.assertGreater(builds.count(ForwardMode.DECODE), 3, mode)
            else:
                self.assertGreater(in_graph, 3, mode)
                self.assertEqual(builds.count(ForwardMode.DECODE), 0, mode)
        self.assertEqual(outputs["graphs"], outputs["eager"])


class TestOneRunnerManyEngines(TestCase):
    """One runner passed to engines made one after another (a bench's engine per batch size):
    each engine's decode steps replay graphs captured on its own pools and metadata buffers
    (before, the second engine's first captured step raised "cannot use the step buffers made
    for another backend"), and every engine's tokens equal the eager engine's."""

    def test_second_engine_recaptures_on_its_own_buffers(self):
        torch._dynamo.reset()
        model = tiny_model()
        prompts = [[5, 9, 2, 7, 1], [3, 4], [8, 1, 6, 2, 2, 9, 4, 3, 1]]

        def generate(forward, n):
            engine = Engine(model, forward=forward, page_size=4, max_running=n,
                            max_context_len=32, max_total_tokens=96, chunked_prefill_size=8)
            with torch.no_grad():
                return engine, engine.generate(prompts[:n], SamplingParams(max_new_tokens=5))

        want = {n: generate(model, n)[1] for n in (3, 2)}  # before the split op is on
        runner = full_and_piecewise(model, batch_sizes=(1, 2, 4), graph_sizes=(8, 16),
                                    inductor=False, emulate_graphs=True, debug=True)
        for i, n in enumerate((3, 2)):  # two engines: their own pools, buffers and buckets
            engine, ids = generate(runner, n)
            self.assertEqual(ids, want[n], n)
            self.assertIs(runner.buffers.backend, engine.attn_backend)
            self.assertEqual(runner.retargets, i)
            self.assertGreaterEqual(runner.replays, 1)
        self.assertGreaterEqual(runner.captures, 2)  # one per engine at least


@requires_gpu_graphs
class TestFullAndPiecewiseGPU(TestCase):
    def setUp(self):
        torch._dynamo.reset()  # earlier tests' graphs of the same forward count to its limit

    def test_capture_both_equals_eager_with_fixed_outputs(self):
        device = dev.as_device()
        num_layers = 2
        model = tiny_model(num_layers=num_layers, device=device)
        h = Harness(model, page_size=16, device=device)
        runner = full_and_piecewise(model, batch_sizes=(1, 2, 4), graph_sizes=(4, 8, 16),
                                    debug=True)
        pw = runner.forward
        log = _record_piece_sizes(pw)
        steps = [("extend", [0, 1, 2, 3, 4], [17, 3, 20, 1, 16])]  # T 57 > 16: uncaptured
        steps += FULL_AND_PIECEWISE_STEPS
        _steps_equal_eager(self, runner, model, pw.layers, h, steps, tol=1e-4)
        self.assertEqual((runner.captures, runner.replays), (2, 3))  # as on the CPU
        self.assertEqual(pw.backend.stats["captures"], 3 * (num_layers + 1))  # as on the CPU
        self.assertEqual([s for mode, b, s in log if mode == ForwardMode.DECODE], [8, 8])
        outputs = {d: e.output.data_ptr() for d, e in runner.graph.entries.items()}
        pieces = [{d: [t.data_ptr() for t in _tensor_list(e.output)]
                   for d, e in r.entries.items()} for r in pw.compiled_pieces()]
        _steps_equal_eager(self, runner, model, pw.layers, h, FULL_AND_PIECEWISE_STEPS[2:],
                           tol=1e-4)  # growing, shrinking, interleaved extends
        self.assertEqual(runner.captures, 3)  # request bucket 1: its second use
        self.assertEqual(pw.backend.stats["captures"], 3 * (num_layers + 1))
        self.assertEqual({d: runner.graph.entries[d].output.data_ptr() for d in outputs},
                         outputs)
        self.assertEqual([{d: [t.data_ptr() for t in _tensor_list(e.output)]
                           for d, e in r.entries.items()} for r in pw.compiled_pieces()], pieces)


def _tensor_list(out):
    items = out if isinstance(out, (tuple, list)) else [out]
    return [t for t in items if isinstance(t, torch.Tensor)]
