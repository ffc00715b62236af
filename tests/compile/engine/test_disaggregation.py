"""Prefill/decode disaggregation over 2 gloo processes on the CPU.

Rank 0 runs a prefill engine, rank 1 a decode engine (``Engine(disaggregation=...)``); rank 1
also runs one ordinary engine on the same random model and prompts, and the parent compares:
the greedy tokens of prefill-then-decode equal the single engine's, and the decode engine's
pools are back to their start counters afterwards (pages, rows, SWA pages).

Scenarios (one spawn runs them all): the ``--model tiny`` Llama shape with page sizes 16 -> 1
and 1 -> 16 (decode in graphs mode: ``GraphRunner`` over a Dynamo eager-backend forward), the
default model's (SmolLM2-135M: 9 query and 3 KV heads of 64) at 2 layers 16 -> 1, a
Gemma-3-shaped model on its hybrid sliding-window pool (prompts longer than the window and a
page, 4 -> 1), an MLA model (DeepSeek-V2 latent cache, 1 -> 4), a DeepSeek-V3.2-shaped
model (latent cache and DSA index keys, top-4 sparse attention, 1 -> 64) and a Qwen3-Next model
(linear-attention conv and recurrent states beside the full-attention KV, 16 -> 1; the
21-token prompt is prefilled in two chunks). A second spawn kills the
prefill process in the middle of one request's payload: the decode side fails that request
with an error naming the peer, finishes the requests it already had and ends with its pools
at their start counters; a third kills the decode process after its first request: the
prefill side fails the later requests (error naming the decode rank) and its pools are back
at their start counters. ``llama_16_to_1_one_row`` gives the decode engine one request row, so
arriving requests wait for the running one to finish (decode batches of 1 only);
``llama_headers_queued`` starts the decode rank after every header arrived, so it batches the
requests (it takes new ones while others run); ``llama_short_decode_context`` gives it fewer
tokens per request than one prompt needs, so that request is received, dropped and failed
while the others finish; ``llama_kv_dtype_mismatch``
gives it a bfloat16 KV cache (the prefill side's is float32: as many elements, half the bytes),
so each request is refused with an error naming the mismatch, its payload drained.
"""

from __future__ import annotations

import datetime
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from compile.engine import Engine, SamplingParams
from compile.engine import disaggregation as disagg
from compile.engine.cli_disagg import free_port
from compile.engine.cli_models import TINY_CONFIG
from compile.graphs import GraphRunner, compile_model
from compile.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from compile.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM
from tests.compile.batch.test_swa_pages import tiny_gemma3
from tests.compile.compile_helpers import tiny_model

NEW_TOKENS = 4
TIMEOUT_S = 30


def _llama():
    shape = {k: TINY_CONFIG[k] for k in ("hidden_size", "intermediate_size", "head_dim",
                                         "num_attention_heads", "num_key_value_heads")}
    return tiny_model(num_layers=2, vocab_size=96, **shape)


def _smollm2():
    """SmolLM2-135M's shape (the CLI's default model: 9 query and 3 KV heads of 64, hidden
    576, its vocabulary), 2 of its 30 layers, random weights."""
    return tiny_model(num_layers=2, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      tie_word_embeddings=True)


def _random(model):
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    return model.eval()


def _mla():
    torch.manual_seed(0)
    return _random(DeepseekV2ForCausalLM(DeepseekV2Config(vocab_size=64, num_hidden_layers=2)))


def _dsa():
    """DeepSeek-V3.2-shaped: MLA plus the DSA indexer, top-4 keys (below every prompt length,
    so decode attends the keys its index scores pick: wrong index keys change the tokens)."""
    torch.manual_seed(0)
    cfg = DeepseekV32Config(vocab_size=64, num_hidden_layers=2, q_lora_rank=24, index_topk=4,
                            index_n_heads=4, index_head_dim=32)
    return _random(DeepseekV32ForCausalLM(cfg))


def _qwen3_next():
    from compile.models import from_hf
    from tests.models.test_qwen3_next_parity import MODELS

    return from_hf(MODELS["qwen3_next"]())


# name -> (model builder, prefill page size, decode page size, decode in graphs mode, lens)
SCENARIOS = {
    "llama_16_to_1": (_llama, 16, 1, False, (19, 5, 33)),
    "llama_1_to_16_graphs": (_llama, 1, 16, True, (19, 5, 33)),
    "smollm2_shape_16_to_1": (_smollm2, 16, 1, False, (19, 5, 33)),
    "gemma3_swa_4_to_1": (tiny_gemma3, 4, 1, False, (21, 6, 3)),
    "mla_1_to_4": (_mla, 1, 4, False, (9, 14)),
    "dsa_index_keys_1_to_64": (_dsa, 1, 64, False, (9, 14)),
    "qwen3_next_linear_16_to_1": (_qwen3_next, 16, 1, False, (21, 6)),
}
ENGINE = dict(max_running=4, max_context_len=64, max_total_tokens=256, chunked_prefill_size=16)
# a decode engine with one request row: the 2nd and 3rd headers wait until a request finishes
SCENARIOS["llama_16_to_1_one_row"] = SCENARIOS["llama_16_to_1"]
# a decode engine of 30 tokens per request: the 33-token prompt is received, drained and failed
SCENARIOS["llama_short_decode_context"] = SCENARIOS["llama_16_to_1"]
# the decode rank starts after every header has arrived: it takes the 2nd and 3rd requests while
# the 1st runs (gloo's irecv reports no completion until waited: compile.engine.disaggregation
# waits headers on a helper thread there)
SCENARIOS["llama_headers_queued"] = SCENARIOS["llama_16_to_1"]
DECODE_DELAY_S = {"llama_headers_queued": 1.0}
# graphs mode: enough steps at one batch size, once every request runs, to replay a graph
NEW_TOKENS_OF = {"llama_1_to_16_graphs": 12}
# a decode engine of a bfloat16 KV cache (as many elements as the prefill side's float32, half
# the bytes): every request is refused, its payload drained, the stream goes on
SCENARIOS["llama_kv_dtype_mismatch"] = SCENARIOS["llama_16_to_1"]
DECODE_ENGINE = {"llama_16_to_1_one_row": dict(ENGINE, max_running=1),
                 "llama_short_decode_context": dict(ENGINE, max_context_len=30),
                 "llama_kv_dtype_mismatch": dict(ENGINE, kv_dtype=torch.bfloat16)}
MISMATCH = "state does not match this engine's pools"
FAILS = {"llama_short_decode_context": {2: "needs more pages, rows or context"},
         "llama_kv_dtype_mismatch": {0: MISMATCH, 1: MISMATCH, 2: MISMATCH}}


def _prompts(vocab: int, lens) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def counters(engine: Engine) -> dict:
    """Free pages, rows (and SWA pages, state slots) of an engine's pools."""
    out = {"pages": len(engine.allocator.free_pages),
           "rows": engine.req_to_token_pool.available_size()}
    if engine.swa_pages is not None:
        out["swa_pages"] = engine.swa_pages.available_pages()
    if engine.state_pool is not None:
        out["state_slots"] = engine.state_pool.available_size()
    return out


def _decode_engine(name: str, model, page_size: int, graphs: bool) -> Engine:
    forward = (GraphRunner(model, forward=compile_model(model, backend="eager"),
                           emulate_graphs=True) if graphs else None)
    return Engine(model, forward=forward, page_size=page_size, disaggregation="decode",
                  **DECODE_ENGINE.get(name, ENGINE))


def _run_scenario(rank: int, name: str) -> dict:
    build, p_ps, d_ps, graphs, lens = SCENARIOS[name]
    model = build()
    prompts = _prompts(model.config.vocab_size, lens)
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS_OF.get(name, NEW_TOKENS))
    if rank == 0:
        engine = Engine(model, page_size=p_ps, disaggregation="prefill", **ENGINE)
        start = counters(engine)
        engine.generate(prompts, sampling)
        engine.disagg.close()
        return {"prefill_errors": engine.disagg.errors,
                "prefill_pools": [start, counters(engine)]}
    torch._dynamo.reset()
    engine = _decode_engine(name, model, d_ps, graphs)
    start = counters(engine)
    time.sleep(DECODE_DELAY_S.get(name, 0.0))
    engine.generate([])
    got = engine.disagg.outputs()
    want = Engine(model, page_size=d_ps, **ENGINE).generate(prompts, sampling)  # all fit
    return {"got": [got.get(i) for i in range(len(prompts))], "want": want,
            "decode_errors": engine.disagg.errors, "decode_pools": [start, counters(engine)],
            "decode_steps": engine.stats.decode_steps,
            "decode_batches": sorted({b for b, _ in engine.stats.decode_step_log}),
            "graphs": [getattr(engine.forward, k, 0) for k in ("captures", "replays")]}


def _init(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _scenarios_worker(rank: int, port: int, out_dir: str) -> None:
    _init(rank, port)
    results = {name: _run_scenario(rank, name) for name in SCENARIOS}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("disagg")
    mp.spawn(_scenarios_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {name: {**ranks[0][name], **ranks[1][name]} for name in SCENARIOS}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_prefill_then_decode_equals_one_engine(results, name):
    r = results[name]
    fails = FAILS.get(name, {})
    assert r["prefill_errors"] == {}
    assert {int(k) for k in r["decode_errors"]} == set(fails)
    for rid, why in fails.items():
        assert why in r["decode_errors"][str(rid)]
    ok = [i for i in range(len(r["want"])) if i not in fails]
    assert [r["got"][i] for i in ok] == [r["want"][i] for i in ok]
    assert all(len(r["got"][i]) == NEW_TOKENS_OF.get(name, NEW_TOKENS) for i in ok)
    assert r["decode_steps"] > 0 or not ok
    for before, after in (r["prefill_pools"], r["decode_pools"]):
        assert after == before


def test_decode_waits_for_a_free_row(results):
    assert results["llama_16_to_1_one_row"]["decode_batches"] == [1]


def test_decode_batches_requests_that_arrive_while_others_run(results):
    assert max(results["llama_headers_queued"]["decode_batches"]) > 1


def test_decode_side_runs_in_graphs_mode(results):
    r = results["llama_1_to_16_graphs"]
    captures, replays = r["graphs"]
    assert captures > 0 and replays > 0


# ----------------------------------------------------------------------- failure


class _DieMidPayload:
    """Wraps ``dist.isend`` on the prefill rank: at the ``limit``-th send the process exits,
    once every earlier send completed (the 2nd request's header and ids are received, its KV
    never comes)."""

    def __init__(self, real, limit: int):
        self.real, self.limit, self.works = real, limit, []

    def __call__(self, tensor, dst, *args, **kwargs):
        if len(self.works) + 1 == self.limit:
            for w in self.works:  # header and ids are out: the decode side allocates pages
                w.wait()
            os._exit(0)
        self.works.append(self.real(tensor, dst, *args, **kwargs))
        return self.works[-1]


def _failure_setup(rank: int, port: int):
    """Join the group; ``(model, 3 prompts, sampling)`` of the failure tests."""
    _init(rank, port)
    model = _llama()
    return model, _prompts(model.config.vocab_size, (7, 9, 5)), SamplingParams(
        max_new_tokens=NEW_TOKENS)


def _first_request(engine: Engine, prompts, sampling) -> None:
    """Prefill rank: prefill and send the 1st request alone, then meet the decode rank."""
    engine.add_requests(prompts[:1], sampling)
    engine.step()
    dist.barrier()  # the decode side has taken it in


def _take_first(engine: Engine) -> None:
    """Decode rank: poll until the 1st request runs, then meet the prefill rank."""
    while not engine.running:
        engine.disagg.poll()
    dist.barrier()


def _dump(out_dir: str, name: str, result: dict) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(result, f)


def _failure_worker(rank: int, port: int, out_dir: str) -> None:
    model, prompts, sampling = _failure_setup(rank, port)
    if rank == 0:
        engine = Engine(model, page_size=4, disaggregation="prefill", **ENGINE)
        n_first = 2 + len(engine.disagg.handlers[0].buffers(1))  # header, ids, K, V
        # 2nd request: header, ids, then die before K
        disagg.dist.isend = _DieMidPayload(dist.isend, n_first + 3)
        _first_request(engine, prompts, sampling)
        engine.generate(prompts[1:], sampling)
        return
    engine = Engine(model, page_size=1, disaggregation="decode", **ENGINE)
    start = counters(engine)
    _take_first(engine)
    engine.generate([])
    want = Engine(model, page_size=1, **ENGINE).generate(prompts[:1], sampling)
    result = {"outputs": engine.disagg.outputs(), "errors": engine.disagg.errors,
              "broken": engine.disagg.broken, "pools": [start, counters(engine)],
              "want0": want[0], "running": len(engine.running)}
    _dump(out_dir, "decode.json", result)
    dist.destroy_process_group()  # join gloo's threads before exit (the peer is gone: no barrier)


def test_prefill_peer_dies_mid_transfer(tmp_path):
    mp.spawn(_failure_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r = json.loads((tmp_path / "decode.json").read_text())
    outputs = {int(k): v for k, v in r["outputs"].items()}
    errors = {int(k): v for k, v in r["errors"].items()}
    assert outputs[0] == r["want0"]  # the request already received finished normally
    assert set(errors) == {1} and "prefill rank 0" in errors[1] and "failed" in errors[1]
    assert r["broken"] and r["running"] == 0
    before, after = r["pools"]
    assert after == before


def _decode_dies_worker(rank: int, port: int, out_dir: str) -> None:
    model, prompts, sampling = _failure_setup(rank, port)
    if rank == 1:  # takes the 1st request in, then this process is gone
        _take_first(Engine(model, page_size=1, disaggregation="decode", **ENGINE))
        os._exit(0)
    engine = Engine(model, page_size=4, disaggregation="prefill", **ENGINE)
    start = counters(engine)
    _first_request(engine, prompts, sampling)
    reqs = engine.add_requests(prompts[1:], sampling)
    while engine.has_work():
        engine.step()
    engine.disagg.close()
    result = {"errors": engine.disagg.errors, "pools": [start, counters(engine)],
              "reasons": [r.finish_reason for r in reqs]}
    _dump(out_dir, "prefill.json", result)
    dist.destroy_process_group()  # join gloo's threads before exit (the peer is gone: no barrier)


def test_decode_peer_dies(tmp_path):
    mp.spawn(_decode_dies_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r = json.loads((tmp_path / "prefill.json").read_text())
    errors = {int(k): v for k, v in r["errors"].items()}
    assert set(errors) == {1, 2}
    assert all("decode rank 1" in why and "failed" in why for why in errors.values())
    assert r["reasons"] == [disagg.FAILED, disagg.FAILED]
    before, after = r["pools"]
    assert after == before
