"""One ``GraphRunner`` re-targeted between engines (each with its own pools, page size and
metadata buffers): engines stepped alternately (every step re-targets), then one engine alone
after the other (it captures and replays again). Every engine's tokens equal an eager engine's,
and the runner's step buffers belong to the engine that ran last."""

from __future__ import annotations

import torch

from compile.engine import Engine, SamplingParams
from compile.graphs import full_and_piecewise
from tests.compile.compile_helpers import tiny_model

PROMPTS = [[5, 9, 2, 7, 1], [3, 4], [8, 1, 6, 2, 2, 9, 4, 3, 1]]
SAMPLING = SamplingParams(max_new_tokens=6)


def _engine(forward, model, n: int, page_size: int) -> Engine:
    return Engine(model, forward=forward, page_size=page_size, max_running=n,
                  max_context_len=32, max_total_tokens=96, chunked_prefill_size=8)


def test_engines_stepped_alternately_and_then_alone_match_eager():
    torch._dynamo.reset()
    model = tiny_model()
    shapes = {"a": (3, 4), "b": (2, 1)}            # (requests, page size) of each engine
    with torch.no_grad():
        want = {name: _engine(model, model, n, page).generate(PROMPTS[:n], SAMPLING)
                for name, (n, page) in shapes.items()}   # before the split op is on
        runner = full_and_piecewise(model, batch_sizes=(1, 2, 4), graph_sizes=(8, 16),
                                    inductor=False, emulate_graphs=True, debug=True)
        engines = {name: _engine(runner, model, n, page) for name, (n, page) in shapes.items()}
        reqs = {name: engines[name].add_requests(PROMPTS[:shapes[name][0]], SAMPLING)
                for name in shapes}
        while any(e.has_work() for e in engines.values()):
            for e in engines.values():             # a, b, a, b, ...: each step re-targets
                if e.has_work():
                    e.step()
        for name in shapes:
            assert [r.output_ids for r in reqs[name]] == want[name], name
        assert runner.retargets >= 2
        retargets, replays = runner.retargets, runner.replays
        # back to one engine at a time: a fresh engine on a's shapes captures and replays
        again = _engine(runner, model, *shapes["a"])
        assert again.generate(PROMPTS[:3], SAMPLING) == want["a"]
        assert runner.buffers.backend is again.attn_backend
        assert runner.retargets == retargets + 1
        assert runner.replays > replays
