"""Compiles stay bounded over long random schedules: ``STEPS`` steps mixing extend, decode and
target-verify batches of random lengths and batch sizes, through ``torch.compile``,
``compile_model`` and ``PiecewiseModel``, each step equal to eager, with the number of Dynamo
graphs (and piecewise compiles and captures) asserted against a bound written as a formula.

Each ``PiecewiseModel`` has its own recompile budget: with one budget shared by every model of
a process on the model's ``forward`` (its own backend fails the others' BACKEND_MATCH guard),
the ninth model would fail with ``FailOnRecompileLimitHit`` however few steps it ran.

The draft length of verify steps is fixed per schedule, as in an engine (sglang's
``speculative_num_draft_tokens``); everything else is drawn at random with a fixed seed.
"""

from __future__ import annotations

import inspect
import random
from collections import Counter
from typing import Callable

import pytest
import torch

from compile.graphs import device as dev
from compile.graphs.compiled_model import GRAPHS_BOUND, compile_model
from compile.graphs import PiecewiseModel
from tests.compile.compile_helpers import Harness, eager_without_split_op, tiny_model
from tests.markers import requires_gpu_graphs

STEPS = 200
KINDS = ("extend", "decode", "verify")
DRAFT = 3  # verify: draft tokens per request
ROWS, CONTEXT = 10, 160  # requests of the harness; tokens per request before it restarts


class CountingBackend:
    """A ``torch.compile`` backend that counts the Dynamo graphs it gets, per step kind (the
    test sets ``kind`` before each step), and runs them as they are (or through Inductor)."""

    def __init__(self, inductor: bool = False):
        self.kind, self.graphs, self.inductor = None, Counter(), inductor

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        self.graphs[self.kind] += 1
        if self.inductor:
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        return gm.forward


def _restart(h: Harness, row: int) -> None:
    """Free request ``row``'s pages and start it again from an empty cache."""
    n, ps = h.lens[row], h.kv_pool.page_size
    if n:
        slots = h.req_pool.req_to_token[row, :n:ps].long()
        h.allocator.free((slots // ps).unique().tolist())
    h.lens[row] = 0


def random_steps(h: Harness, seed: int, steps: int = STEPS):
    """Yield ``(kind, ids, positions, forward_batch, rows)`` of ``steps`` random steps: 2/5
    extend (1-6 requests of 1-9 new tokens), 2/5 decode (1-6 requests), 1/5 verify (1-6
    requests of ``DRAFT`` drafts, 1 to ``DRAFT`` accepted after the step). A request restarts
    empty before it would pass ``CONTEXT`` tokens; decode and verify need a cached prefix, so
    they turn into extend steps when a picked request is empty."""
    rng = random.Random(seed)
    for _ in range(steps):
        kind = rng.choice(("extend", "extend", "decode", "decode", "verify"))
        rows = rng.sample(range(ROWS), rng.randint(1, 6))
        lens = [rng.randint(1, 9) for _ in rows]
        for r, n in zip(rows, lens):
            if h.lens[r] + max(n, DRAFT) > CONTEXT:
                _restart(h, r)
        if kind != "extend" and any(h.lens[r] == 0 for r in rows):
            kind = "extend"
        if kind == "extend":
            yield (kind, *h.extend(rows, lens), rows)
        elif kind == "decode":
            yield (kind, *h.decode(rows), rows)
        else:
            yield (kind, *h.verify(rows, DRAFT, init=True), rows)
            h.accept(rows, rng.randint(1, DRAFT))


def run_schedule(forward, model, h: Harness, seed: int, on_step=None, layers=None,
                 check_every: int = 3) -> Counter:
    """Every step of ``random_steps`` through ``forward``; every ``check_every``-th compared
    with eager (the split-op ``layers`` switched back for the reference; an eager step rewrites
    the same KV slots with the same values). ``on_step(kind, ids, forward_batch)`` runs before
    each step. Returns steps per kind."""
    kinds = Counter()
    for i, (kind, ids, pos, fb, _) in enumerate(random_steps(h, seed)):
        if on_step is not None:
            on_step(kind, ids, fb)
        with torch.inference_mode():
            out = forward(ids, pos, fb)
        kinds[kind] += 1
        if i % check_every:
            continue
        if layers is None:
            with torch.inference_mode():
                ref = model(ids, pos, fb)
        else:
            ref = eager_without_split_op(model, layers, ids, pos, fb)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    return kinds


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def size_pattern(ids, fb) -> tuple[bool, ...]:
    """Which of the step's varying sizes equal 1: requests, tokens, page-table width,
    max_seqlen_q (Dynamo specialises size 1, so each pattern may need its own graph)."""
    main = fb.attn_backend.forward_metadata.main
    return (fb.batch_size == 1, ids.shape[0] == 1, main.page_table.shape[1] == 1,
            main.max_seqlen_q == 1)


def compiled_schedule(forward, backend: CountingBackend, model, h, seed: int) -> None:
    """``run_schedule`` through a compiled ``forward``; asserts ``GRAPHS_BOUND``'s formula."""
    patterns = {kind: set() for kind in KINDS}

    def on_step(kind, ids, fb):
        backend.kind = kind
        patterns[kind].add(size_pattern(ids, fb))

    kinds = run_schedule(forward, model, h, seed, on_step=on_step)
    assert sum(kinds.values()) == STEPS and set(kinds) == set(KINDS), kinds
    for kind in KINDS:
        # one graph per pattern of sizes equal to 1, + the kind's first graph (sizes static)
        assert backend.graphs[kind] <= len(patterns[kind]) + 1, (backend.graphs, patterns)
    assert sum(backend.graphs.values()) <= GRAPHS_BOUND


def test_compile_model_graphs_bounded_over_a_random_schedule():
    model = tiny_model(num_layers=1)
    h = Harness(model, max_reqs=ROWS, context=CONTEXT)
    backend = CountingBackend()
    compiled_schedule(compile_model(model, backend=backend, fullgraph=True), backend, model, h,
                      seed=1)


def test_compile_model_budget_without_the_recompile_limit_argument(monkeypatch):
    """On a torch whose torch.compile takes no recompile_limit (2.11 on the GPU machine) the
    budget is Dynamo's global limit for the duration of each call."""
    from compile.graphs import compiled_model
    monkeypatch.setattr(compiled_model, "_RECOMPILE_BUDGET", {})
    seen = []

    def backend(gm, example_inputs):
        seen.append(torch._dynamo.config.recompile_limit)
        return gm.forward

    model = tiny_model(num_layers=1)
    h = Harness(model)
    default = torch._dynamo.config.recompile_limit
    with torch.inference_mode():
        compile_model(model, backend=backend, fullgraph=True)(*h.extend([0, 1], [3, 2]))
    assert seen == [GRAPHS_BOUND] and torch._dynamo.config.recompile_limit == default


def test_piecewise_graphs_compiles_and_captures_bounded_over_a_random_schedule():
    num_layers, graph_sizes = 1, (4, 8, 16)
    model = tiny_model(num_layers=num_layers)
    h = Harness(model, max_reqs=ROWS, context=CONTEXT)
    pw = PiecewiseModel(model, graph_sizes=graph_sizes, inductor=False, emulate_graphs=True)
    kinds = run_schedule(pw, model, h, seed=2, layers=pw.layers)
    assert set(kinds) == set(KINDS), kinds
    stats = pw.backend.stats
    # The traced graph reads input_ids and positions (views of the static buffers marked
    # dynamic, or inputs marked dynamic past the largest bucket; never of size 1) and, in
    # extend steps, extend_seq_lens [b]: one graph per kind, plus two for extend (b static in
    # its first graph, then dynamic; b = 1 specialised).
    assert stats["graphs"] <= len(KINDS) + 2, stats
    # Pieces per graph: num_layers + 1 around the attention calls, plus at most one cut (the
    # LM-head tail that reads extend_seq_lens); identical pieces compile once.
    assert stats["pieces"] == stats["graphs"] * (num_layers + 1), stats
    assert stats["compiles"] <= stats["pieces"] + stats["cuts"], stats
    # Every captured piece is captured once per bucket it ran at.
    assert stats["captures"] <= stats["pieces"] * len(graph_sizes), stats
    buckets = [d.bucket for r in pw.compiled_pieces() for d in r.entries]
    assert len(buckets) == stats["captures"] and set(buckets) <= set(graph_sizes), buckets


def test_many_piecewise_models_in_one_process():
    """Each PiecewiseModel has its own recompile budget (``isolate_recompiles`` where torch has
    it): before, the ninth model of the process failed with FailOnRecompileLimitHit."""
    if "isolate_recompiles" not in inspect.signature(torch.compile).parameters:
        pytest.skip("this torch has no isolate_recompiles: PiecewiseModels share one budget")
    model = tiny_model(num_layers=1)
    h = Harness(model)
    for _ in range(torch._dynamo.config.recompile_limit + 1):  # the 9th model failed
        pw = PiecewiseModel(model, graph_sizes=(8,), inductor=False, emulate_graphs=True)
        ids, pos, fb = h.extend([0, 1], [3, 4])
        with torch.inference_mode():
            out = pw(ids, pos, fb)
        torch.testing.assert_close(out, eager_without_split_op(model, pw.layers, ids, pos, fb))
        assert pw.backend.stats["graphs"] == 1  # each model compiles its own graph


@requires_gpu_graphs
def test_gpu_piecewise_and_compiled_graphs_bounded_over_a_random_schedule():
    """The same schedule on the GPU: Inductor pieces captured as device graphs per bucket, and
    ``compile_model`` with Inductor."""
    device = dev.as_device()
    model = tiny_model(num_layers=2, device=device)
    h = Harness(model, max_reqs=ROWS, context=CONTEXT, device=device)
    pw = PiecewiseModel(model, graph_sizes=(4, 8, 16))
    run_schedule(pw, model, h, seed=2, layers=pw.layers)
    stats = pw.backend.stats
    assert stats["graphs"] <= len(KINDS) + 2, stats  # see the CPU tests for each bound
    assert stats["captures"] <= stats["pieces"] * 3, stats  # 3 buckets
    torch._dynamo.reset()
    model = tiny_model(num_layers=2, device=device, seed=1)
    h = Harness(model, max_reqs=ROWS, context=CONTEXT, device=device)
    backend = CountingBackend(inductor=True)
    compiled_schedule(compile_model(model, backend=backend, fullgraph=True), backend, model, h,
                      seed=1)
