"""Full decode / target-verify graphs: static buffers and in-place metadata refill.

On the CPU the runner runs its static-buffer steps without capture (same padding, same
``init_forward_metadata_out_graph`` refill), so stale-metadata bugs show here too; the ``gpu``
tests capture and replay.
"""

from __future__ import annotations

from unittest import mock

import torch
from expecttest import TestCase

from compile.graphs import device as dev
from compile.batch.forward_batch import ForwardMode
from compile.graphs.graph_runner import DecodeGraphRunner, TargetVerifyGraphRunner, full_and_piecewise
from compile.graphs.piecewise import PiecewiseModel
from tests.compile.compile_helpers import Harness, tiny_model
from tests.compile.test_piecewise import _eager, _make_step
from tests.markers import requires_gpu_graphs

# batch sizes in request counts: grow, shrink across buckets, shrink inside one, grow again
SCHEDULE = ([0, 1, 2], [0, 1, 2, 3, 4], [1], [0, 1, 2], [4, 3], [0, 1, 2, 3, 4], [2, 0, 4])


def _decode_steps(test, runner, model, h, schedule=SCHEDULE, tol=1e-5):
    for rows in schedule:
        ids, pos, fb = h.decode(rows)  # every step: new slots, longer seq_lens
        with torch.no_grad():
            out = runner(ids, pos, fb)
            h.backend.init_forward_metadata(fb)  # eager reference: fresh metadata
            ref = model(ids, pos, fb)
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def _prefill(model, h, rows, lens):
    with torch.no_grad():
        model(*h.extend(rows, lens))


class TestDecodeGraphRunnerCPU(TestCase):
    def test_static_steps_equal_eager_when_batches_shrink_and_grow(self):
        model = tiny_model()
        h = Harness(model, page_size=4)
        _prefill(model, h, [0, 1, 2, 3, 4], [5, 3, 8, 1, 4])  # lengths end mid-page
        runner = DecodeGraphRunner(model, batch_sizes=(1, 2, 4, 8), capture=False)
        _decode_steps(self, runner, model, h)
        self.assertEqual(sorted(runner.graphs), [1, 2, 4, 8])  # buckets of 1, 2, 3, 5 requests
        # 7 steps - 4 first uses of a bucket (they bind instead of refilling)
        self.assertEqual(runner.replays, len(SCHEDULE) - 4)

    def test_extend_falls_back_to_forward(self):
        model = tiny_model()
        h = Harness(model)
        runner = DecodeGraphRunner(model, batch_sizes=(2,), capture=False)
        ids, pos, fb = h.extend([0, 1], [3, 2])
        with torch.no_grad():
            out = runner(ids, pos, fb)
        self.assertFalse(runner.can_run(fb))
        self.assertEqual(tuple(out.shape), (2, 64))
        self.assertEqual(runner.graphs, {})

    def test_target_verify_static_steps_equal_eager(self):
        model = tiny_model()
        h = Harness(model)
        _prefill(model, h, [0, 1, 2], [4, 7, 2])
        d = 3  # draft tokens per request
        runner = TargetVerifyGraphRunner(model, draft_token_num=d, batch_sizes=(2, 4),
                                         capture=False)
        for rows in ([0, 1, 2], [1, 2], [0, 1, 2]):
            ids, pos, fb = h.verify(rows, d)
            with torch.no_grad():
                out = runner(ids, pos, fb)
                h.backend.init_forward_metadata(fb)
                ref = model(ids, pos, fb)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            h.accept(rows)
        self.assertEqual(sorted(runner.graphs), [2, 4])


@requires_gpu_graphs
class TestDecodeGraphRunnerGPU(TestCase):
    def test_capture_replay_equals_eager_and_buffers_stay(self):
        device = dev.as_device()
        model = tiny_model(device=device)
        h = Harness(model, page_size=16, device=device)
        _prefill(model, h, [0, 1, 2, 3, 4], [17, 3, 40, 1, 16])
        runner = DecodeGraphRunner(model, batch_sizes=(1, 2, 4, 8))
        _decode_steps(self, runner, model, h, tol=1e-4)
        self.assertEqual(runner.captures, 4)  # one graph per bucket used: 1, 2, 4, 8
        ptrs = {bs: out.data_ptr() for bs, (_, _, out) in runner.graphs.items()}
        buffers = {name: t.data_ptr() for name, t in h.backend.graph_buffers.items()}
        _decode_steps(self, runner, model, h)
        self.assertEqual(runner.captures, 4)  # no new capture
        self.assertEqual({bs: out.data_ptr() for bs, (_, _, out) in runner.graphs.items()}, ptrs)
        self.assertEqual({n: t.data_ptr() for n, t in h.backend.graph_buffers.items()}, buffers)

    def test_compiled_model_capture(self):
        device = dev.as_device()
        model = tiny_model(device=device)
        h = Harness(model, device=device)
        _prefill(model, h, [0, 1, 2], [5, 9, 2])
        runner = DecodeGraphRunner(model, batch_sizes=(2, 4),
                                   forward=torch.compile(model, fullgraph=True))
        _decode_steps(self, runner, model, h, schedule=([0, 1, 2], [0, 1], [2, 1, 0]),
                      tol=1e-4)
        self.assertEqual(runner.captures, 2)


def _steps_equal_eager(test, forward, model, layers, h, steps, tol=1e-5):
    """Run ``steps`` (``(kind, rows, lens)``) through ``forward``; each output must equal the
    eager model's (layers back on the backend, fresh metadata)."""
    for kind, rows, lens in steps:
        ids, pos, fb = _make_step(h, kind, rows, lens)
        with torch.no_grad():
            out = forward(ids, pos, fb)
        h.backend.init_forward_metadata(fb)  # decode steps left graph-bound metadata behind
        torch.testing.assert_close(out, _eager(model, layers, ids, pos, fb), rtol=tol, atol=tol)


def _record_piece_sizes(pw):
    """Patch ``pw.graph_size_for`` to log ``(mode, batch_size, bucket)`` of every step."""
    log, graph_size_for = [], pw.graph_size_for

    def logged(num_tokens, fb):
        size = graph_size_for(num_tokens, fb)
        log.append((fb.forward_mode, fb.batch_size, size))
        return size

    pw.graph_size_for = logged
    return log


# (kind, rows, lens); buckets: requests (1, 2, 4) for decode graphs, tokens (4, 8, 16) for pieces
FULL_AND_PIECEWISE_STEPS = [
    ("extend", [0, 1], [3, 4]),  # T 7 -> 8: piece warm-up
    ("extend", [2, 3], [5, 3]),  # T 8 -> 8: piece capture
    ("decode", [0, 1, 2], None),  # -> bucket 4: decode graph (static step on the CPU)
    ("decode", [0, 1], None), ("decode", [0, 1, 2, 3], None), ("decode", [2], None),
    ("mixed", [0, 1], [1, 3]), ("mixed", [2, 3], [2, 1]),  # T 4, 3 -> 4: warm-up, capture
    ("extend", [3, 0], [1, 6]),  # cached prefix, T 7 -> 8: piece replay
    ("decode", [0, 1, 2], None), ("decode", [3, 1], None),  # decode graph replays
    ("decode", [0, 1, 2, 3, 4], None), ("decode", [0, 1, 2, 3, 4], None),  # 5 > 4 requests:
]  # pieces, token bucket 8: warm-up, capture


class TestFullAndPiecewiseCPU(TestCase):
    """``full_and_piecewise`` on the CPU: the decode runner's static-buffer steps, pieces
    captured as ``EmulatedGraph``s."""

    def setUp(self):
        torch._dynamo.reset()

    def test_schedule_equals_eager_and_decode_never_captured_by_pieces(self):
        num_layers = 2
        model = tiny_model(num_layers=num_layers)
        h = Harness(model, page_size=4)
        runner = full_and_piecewise(model, batch_sizes=(1, 2, 4), graph_sizes=(4, 8, 16),
                                    inductor=False, emulate_graphs=True, debug=True)
        pw = runner.forward
        self.assertIsInstance(pw, PiecewiseModel)
        self.assertFalse(runner.capture)  # CPU: the static-buffer path, no device graphs
        log = _record_piece_sizes(pw)
        _steps_equal_eager(self, runner, model, pw.layers, h, FULL_AND_PIECEWISE_STEPS)
        # decode steps of <= 4 requests: buckets 4, 2, 4, 1, 4, 2 -> first uses 4, 2, 1 bind
        self.assertEqual(sorted(runner.graphs), [1, 2, 4])
        self.assertEqual(runner.replays, 6 - 3)
        decode = [size for mode, b, size in log if mode == ForwardMode.DECODE and b <= 4]
        self.assertEqual(decode, [None] * 6)  # the pieces never bucket a full-graph step
        self.assertEqual([s for mode, b, s in log if mode == ForwardMode.DECODE and b > 4],
                         [8, 8])  # decode past the largest request bucket: pieces captured
        # extend at 8, mixed at 4, decode (5 requests) at 8: num_layers + 1 pieces each
        self.assertEqual(pw.backend.stats["captures"], 3 * (num_layers + 1))
        # Dynamo graphs: extend, decode (1 request, specialised), decode (dynamic; the runner's
        # steps and the 5-request steps share it), mixed
        self.assertEqual(pw.backend.stats["graphs"], 4)

    def test_piece_capture_inside_an_outer_capture_raises(self):
        model = tiny_model()
        h = Harness(model)
        pw = PiecewiseModel(model, graph_sizes=(8,), inductor=False, emulate_graphs=True)
        with torch.no_grad():
            pw(*h.extend([0, 1], [3, 4]))  # warm-up at bucket 8
            with mock.patch("compile.graphs.piece_runner._capture_in_progress", return_value=True), \
                    self.assertRaisesRegex(RuntimeError, "graphs cannot nest"):
                pw(*h.extend([0, 1], [2, 2]))  # would capture inside "another capture"
        self.assertEqual(pw.backend.stats["captures"], 0)


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
        self.assertEqual(runner.captures, 3)  # request buckets 1, 2, 4
        self.assertEqual(pw.backend.stats["captures"], 3 * (num_layers + 1))  # as on the CPU
        self.assertTrue(all(size is None for mode, b, size in log
                            if mode == ForwardMode.DECODE and b <= 4))
        outputs = {bs: out.data_ptr() for bs, (_, _, out) in runner.graphs.items()}
        pieces = [{s: [t.data_ptr() for t in _tensor_list(o)] for s, (_, _, o) in r.graphs.items()}
                  for r in pw.compiled_pieces()]
        _steps_equal_eager(self, runner, model, pw.layers, h, FULL_AND_PIECEWISE_STEPS[2:],
                           tol=1e-4)  # replays only: growing, shrinking, interleaved extends
        self.assertEqual(runner.captures, 3)
        self.assertEqual(pw.backend.stats["captures"], 3 * (num_layers + 1))
        self.assertEqual({bs: out.data_ptr() for bs, (_, _, out) in runner.graphs.items()},
                         outputs)
        self.assertEqual([{s: [t.data_ptr() for t in _tensor_list(o)]
                           for s, (_, _, o) in r.graphs.items()}
                          for r in pw.compiled_pieces()], pieces)


def _tensor_list(out):
    items = out if isinstance(out, (tuple, list)) else [out]
    return [t for t in items if isinstance(t, torch.Tensor)]
