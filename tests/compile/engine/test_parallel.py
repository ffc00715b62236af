"""Tensor parallelism and decode context parallelism over 2 gloo processes on the CPU.

One ``torch.multiprocessing.spawn`` of 2 ranks (module fixture ``ranks``) runs every scenario,
each an ``Engine`` generating greedily from the same prompts (chunked prefill with a cached
prefix, then decode) while recording every step's logits; the parent runs the same schedule in
one process on an unsharded copy of the same random model and compares:

- ``tp``: TP=2 under ``torch.compile(fullgraph=True)`` (a break would raise), tied embeddings
  (vocabulary-parallel embedding and LM head over one matrix, vocabulary padded), the
  collectives counted in every Dynamo graph.
- ``tp_kv1``: TP=2 piecewise (split at attention, pieces run uncompiled), one KV head
  (replicated on both ranks), untied LM head, sinks, biases on every projection.
- ``dcp``: DCP=2 piecewise (the DCP backend writes the split op's output), page size 2 (virtual
  pages of 4 tokens, each rank storing 2 of them), sinks.
"""

from __future__ import annotations

import os
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from compile.backend.parallel_state import ParallelConfig, ParallelGroup, all_reduce, tp_heads
from compile.engine import Engine, SamplingParams
from compile.graphs import compile_piecewise, full_and_piecewise
from compile.models.tensor_parallel import tensor_parallel
from tests.compile.compile_helpers import tiny_model

PROMPTS = [[1, 5, 9, 3, 7, 2, 8], [4, 4, 10, 11], [2, 3]]
NEW_TOKENS = 5
LAYERS = 2
SCENARIOS = {  # name -> tiny_model overrides
    "tp": dict(tie_word_embeddings=True, vocab_size=63),   # 63: padded to 2 x 32 rows
    "tp_kv1": dict(num_key_value_heads=1, attention_sinks=True, attention_bias=True,
                   o_proj_bias=True, mlp_bias=True),   # row-parallel biases added once
    "dcp": dict(attention_sinks=True),
    "tp_graphs": dict(),   # GPU only (tests/compile/engine/test_parallel_gpu.py)
}
CPU_SCENARIOS = ("tp", "tp_kv1", "dcp")
COLLECTIVES = ("all_reduce", "all_gather_into_tensor")


class Recorder:
    """Calls ``forward`` and keeps a copy of every step's logits."""

    def __init__(self, forward):
        self.forward, self.logits = forward, []

    def __call__(self, input_ids, positions, forward_batch):
        out = self.forward(input_ids, positions, forward_batch)
        self.logits.append(out.clone())
        return out


def generate(model, forward=None, parallel: Optional[ParallelConfig] = None):
    """``(token ids per prompt, logits per step, engine)`` of a greedy run: 9 prefill tokens a
    step, so both extend steps hold 2 requests and the second prompt's last 2 tokens extend
    over its cached first 2; then 5 decode steps of 3 requests."""
    rec = Recorder(model if forward is None else forward)
    engine = Engine(model, forward=rec, page_size=2, max_running=4, max_context_len=32,
                    max_total_tokens=128, chunked_prefill_size=9, parallel=parallel)
    tokens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS))
    return tokens, rec.logits, engine


def collective_counts(graphs: list) -> list[dict[str, int]]:
    """Per Dynamo graph, how many nodes call each functional collective."""
    out = []
    for gm in graphs:
        names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        out.append({c: sum(f"_c10d_functional.{c}" in t for t in names) for c in COLLECTIVES})
    return out


def _scenario(name: str, group: ParallelGroup, device: str = "cpu") -> dict:
    model = tiny_model(LAYERS, device=device, **SCENARIOS[name])
    if name == "dcp":
        torch._dynamo.reset()
        pieces = compile_piecewise(model, inductor=False)
        tokens, logits, engine = generate(model, pieces, ParallelConfig(dcp=group))
        return dict(tokens=tokens, logits=logits, pool_slots=engine.token_to_kv_pool.size)
    model = tensor_parallel(model, group)
    heads = model.model.layers[0].self_attn.attn.tp_q_head_num
    if name == "tp_graphs":   # GPU only: decode steps captured whole, NCCL inside the graphs
        tokens, logits, _ = generate(model, full_and_piecewise(model), ParallelConfig(tp=group))
        return dict(tokens=tokens, logits=logits)
    if name != "tp":
        torch._dynamo.reset()
        pieces = compile_piecewise(model, inductor=False)
        tokens, logits, _ = generate(model, pieces, ParallelConfig(tp=group))
        return dict(tokens=tokens, logits=logits, hq=heads, stats=pieces.backend.stats)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    tokens, logits, _ = generate(model, compiled, ParallelConfig(tp=group))
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return dict(tokens=tokens, logits=logits, collectives=collective_counts(graphs),
                graph_breaks=breaks, hq=heads)


def _worker(rank: int, world: int, path: str, device: str = "cpu",
            names: tuple = tuple(SCENARIOS)) -> None:
    """One rank: gloo on the CPU; on GPUs NCCL, rank ``r`` on ``cuda:r``."""
    torch.set_num_threads(1)
    if device != "cpu":
        device = f"{device}:{rank}"
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if device == "cpu" else "nccl",
                            init_method=f"file://{path}/init", rank=rank, world_size=world)
    try:
        group = ParallelGroup.of(dist.group.WORLD)
        results = {name: _scenario(name, group, device) for name in names}
        torch.save(results, os.path.join(path, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results (``_scenario``), from one 2-process spawn."""
    path = str(tmp_path_factory.mktemp("parallel"))
    mp.spawn(_worker, args=(2, path, "cpu", CPU_SCENARIOS), nprocs=2, join=True)
    return [torch.load(os.path.join(path, f"rank{r}.pt")) for r in range(2)]


@pytest.fixture(scope="module")
def single() -> dict:
    """The same runs in this process on unsharded models: ``name -> (tokens, logits)``."""
    torch.manual_seed(0)
    return {name: generate(tiny_model(LAYERS, **SCENARIOS[name]))[:2] for name in CPU_SCENARIOS}


def _assert_same_run(result: dict, expected, tol: float = 1e-5) -> None:
    tokens, logits = expected
    assert result["tokens"] == tokens
    assert len(result["logits"]) == len(logits)
    for got, want in zip(result["logits"], logits):
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["tp_kv1", "dcp"])
def test_logits_equal_one_process(ranks, single, name):
    for r in range(2):
        _assert_same_run(ranks[r][name], single[name])


def test_tp_splits_heads(ranks):
    # tiny_model: Hq = 4 query heads over 2 ranks
    assert [ranks[r][name]["hq"] for r in range(2) for name in ("tp", "tp_kv1")] == [2] * 4


def test_dcp_pool_holds_half_the_tokens(ranks):
    # 128 tokens in virtual pages of 2 * 2: 32 pages + page 0, 2 physical slots per page
    assert [ranks[r]["dcp"]["pool_slots"] for r in range(2)] == [(128 // 4 + 1) * 2] * 2


def test_tp_fullgraph_has_collectives_and_no_breaks(ranks, single):
    for r in range(2):
        result = ranks[r]["tp"]
        _assert_same_run(result, single["tp"])
        assert result["graph_breaks"] == 0
        # per graph: 1 embedding + 2 per layer (o_proj, down_proj) all-reduces; 1 logits gather
        want = {"all_reduce": 1 + 2 * LAYERS, "all_gather_into_tensor": 1}
        assert all(c == want for c in result["collectives"])
        assert len(result["collectives"]) == 2   # dynamic=True: one extend, one decode graph


def test_tp_piecewise_splits_only_at_attention(ranks):
    for r in range(2):
        stats = ranks[r]["tp_kv1"]["stats"]
        # per Dynamo graph: LAYERS attention calls, LAYERS + 1 pieces around them
        assert stats["graphs"] >= 2   # extend and decode
        assert stats["split_ops"] == LAYERS * stats["graphs"]
        assert stats["pieces"] == (LAYERS + 1) * stats["graphs"]


@pytest.mark.parametrize("overrides, kv_dtype, message", [
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4), None,
     "expected an MHATokenToKVPool"),
    (dict(), torch.float8_e4m3fn, "KV cache dtype torch.float8_e4m3fn is not supported"),
])
def test_dcp_rejects_what_it_cannot_serve(overrides, kv_dtype, message):
    model = tiny_model(LAYERS, **overrides)
    two = ParallelConfig(dcp=ParallelGroup(0, 2, group=object()))   # no collective runs
    with pytest.raises(NotImplementedError, match=message):
        Engine(model, page_size=2, max_total_tokens=64, kv_dtype=kv_dtype, parallel=two)


def test_tp_of_one_rank_is_the_plain_model():
    model = tiny_model(LAYERS)
    linears = {n: type(m) for n, m in model.named_modules() if n.endswith("_proj")}
    assert tensor_parallel(model, ParallelGroup()) is model
    assert {n: type(m) for n, m in model.named_modules() if n.endswith("_proj")} == linears
    assert set(linears.values()) == {nn.Linear}
    x = torch.randn(3, 4)
    assert all_reduce(x, ParallelGroup()) is x


@pytest.mark.parametrize("hq, hkv, size, want", [
    (8, 4, 2, [(4, 2, 0), (4, 2, 2)]),                 # both split
    (8, 2, 4, [(2, 1, 0), (2, 1, 0), (2, 1, 1), (2, 1, 1)]),  # KV heads replicated 2x
])
def test_tp_heads(hq, hkv, size, want):
    groups = [ParallelGroup(r, size, group=object()) for r in range(size)]
    assert [tp_heads(hq, hkv, g) for g in groups] == want


@pytest.mark.parametrize("hq, hkv, size", [(6, 2, 4), (8, 3, 2)])
def test_tp_heads_rejects_indivisible_heads(hq, hkv, size):
    with pytest.raises(ValueError, match="cannot be split over"):
        tp_heads(hq, hkv, ParallelGroup(0, size, group=object()))


def _cli_error(monkeypatch, capsys, world: str, *flags: str) -> str:
    from compile.__main__ import main
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "tiny", "--device", "cpu", *flags])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_cli_tp_needs_one_process_per_rank(monkeypatch, capsys):
    err = _cli_error(monkeypatch, capsys, "1", "--tp", "2")
    assert "tp * dcp must equal the number of processes; expected 2" in err


def test_cli_dcp_is_not_captured_whole(monkeypatch, capsys):
    err = _cli_error(monkeypatch, capsys, "2", "--dcp", "2", "--mode", "graphs")
    assert "argument --dcp: DCP steps are not captured as whole-step graphs" in err


def test_cli_tp_that_cannot_split_the_heads_is_a_one_line_error(capsys):
    # SmolLM2-135M (the default model) has 9 query heads: `--tp 2` must not end in a traceback.
    import argparse

    from compile.engine.cli_args import CliParser
    from compile.engine.cli_parallel import shard_model
    parser = CliParser(prog="generate")
    args = argparse.Namespace(parallel=ParallelConfig(tp=ParallelGroup(0, 3, group=object())),
                              error=parser.error)
    with pytest.raises(SystemExit) as exit_info:
        shard_model(args, tiny_model(num_layers=1))   # 4 query heads, 2 KV heads over 3 ranks
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "argument --tp: tp_heads: num_heads=4 / num_kv_heads=2 cannot be split over 3" in err


@pytest.mark.parametrize("dcp", [1, 2])
def test_cli_dcp_refusal_is_a_one_line_error(dcp, capsys):
    # --dcp with a model DCP does not split (Gemma 3's hybrid SWA pool) must not end in a
    # traceback; without --dcp the same error is internal and keeps it.
    import argparse

    from compile.engine.cli_args import CliParser
    from compile.engine.cli_parallel import unsupported_by_dcp
    args = argparse.Namespace(dcp=dcp, error=CliParser(prog="generate").error)
    refusal = NotImplementedError("DCPAttentionBackend: the KV pool is a HybridSWAKVPool")
    with pytest.raises(SystemExit if dcp > 1 else NotImplementedError) as raised:
        with unsupported_by_dcp(args):
            raise refusal
    err = capsys.readouterr().err
    if dcp > 1:
        assert raised.value.code == 2 and err.count("\n") == 1, err
        assert "argument --dcp: DCPAttentionBackend: the KV pool is a HybridSWAKVPool" in err
    else:
        assert raised.value is refusal and err == ""


@pytest.mark.parametrize("deterministic", [False, True])
def test_dcp_backend_reads_deterministic_inference(deterministic):
    two = ParallelConfig(dcp=ParallelGroup(0, 2, group=object()))   # no collective runs
    engine = Engine(tiny_model(LAYERS), page_size=2, max_total_tokens=64, parallel=two,
                    enable_deterministic_inference=deterministic)
    assert type(engine.attn_backend).__name__ == "DCPAttentionBackend"
    assert engine.attn_backend.num_splits == (1 if deterministic else 0)
