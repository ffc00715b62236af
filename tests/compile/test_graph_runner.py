"""Full decode / target-verify graphs: static buffers and in-place metadata refill.

On the CPU the runner runs its static-buffer steps without capture (same padding, same
``init_forward_metadata_out_graph`` refill), so stale-metadata bugs show here too; the ``gpu``
tests capture and replay.
"""

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase

from compile import device as dev
from compile.forward_batch import ForwardBatch, ForwardMode, SpecInfo
from compile.graph_runner import DecodeGraphRunner, TargetVerifyGraphRunner
from tests.compile.compile_helpers import Harness, tiny_model

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
            ids, pos, fb = _verify_batch(h, rows, d)
            with torch.no_grad():
                out = runner(ids, pos, fb)
                h.backend.init_forward_metadata(fb)
                ref = model(ids, pos, fb)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            _accept_one(h, rows, d)
        self.assertEqual(sorted(runner.graphs), [2, 4])


def _verify_batch(h: Harness, rows, d: int):
    """TARGET_VERIFY over ``d`` drafts per request (``seq_lens`` = the prefix, as sglang)."""
    ids, pos, fb = h.extend(rows, [d] * len(rows), init=False)  # allocates d slots/request
    for r in rows:
        h.lens[r] -= d  # drafts are not part of the prefix yet
    seq_lens_cpu = torch.tensor([h.lens[r] for r in rows], dtype=torch.int32)
    verify = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=len(rows),
                          req_pool_indices=fb.req_pool_indices,
                          seq_lens=seq_lens_cpu.to(h.device), seq_lens_cpu=seq_lens_cpu,
                          out_cache_loc=fb.out_cache_loc, positions=fb.positions,
                          spec_info=SpecInfo(topk=1, draft_token_num=d))
    verify.attn_backend, verify.token_to_kv_pool = h.backend, h.kv_pool
    verify.req_to_token_pool = h.req_pool
    return ids, pos, verify


def _accept_one(h: Harness, rows, d: int) -> None:
    """Accept the first draft of each request; the next verify step re-allocates the rest."""
    for r in rows:
        h.lens[r] += 1


@pytest.mark.gpu
@pytest.mark.skipif(not dev.supports_graphs(dev.as_device()), reason="needs CUDA/XPU graphs")
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
