"""Target verify (topk 1) of a hybrid model, the rollback of rejected drafts, and a MIXED step.

A tiny Qwen3-Next prefills two requests of different lengths through the engine; then rounds of
TARGET_VERIFY run D = 3 tokens per request (the last sampled token and two random drafts),
eagerly or through a ``GraphRunner`` (emulated capture: warm-up, capture, replays). Every
verify logit row must equal ``transformers``' on the same sequence; after each round a
different number of drafts is accepted per request and
``update_mamba_state_after_mtp_verify`` rolls the linear layers' states back to the accepted
ones (the KV cache needs no rollback: the next round overwrites the rejected slots), so the
next round's logits match only if the rollback was exact.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from compile.batch import ForwardBatch, ForwardMode, SpecInfo  # noqa: E402
from compile.engine import Engine, SamplingParams  # noqa: E402
from compile.graphs import GraphRunner, compile_model, full_and_piecewise  # noqa: E402
from compile.models import from_hf  # noqa: E402
from tests.models.test_qwen3_next_parity import qwen3_next_hf  # noqa: E402

D = 3
ACCEPTED = ([2, 1], [3, 2], [1, 3], [2, 2])  # accepted tokens per request, per round


@pytest.fixture(scope="module")
def hf():
    return qwen3_next_hf()


def prefill(model, page_size: int) -> Engine:
    """An engine whose two requests have prefilled and sampled their first token."""
    engine = Engine(model, page_size=page_size, max_running=2, max_context_len=64,
                    max_total_tokens=256, chunked_prefill_size=8)
    g = torch.Generator().manual_seed(5)
    engine.add_requests([torch.randint(0, 97, (n,), generator=g).tolist() for n in (13, 6)],
                        SamplingParams(max_new_tokens=40))
    while any(not r.output_ids for r in engine.running + engine.waiting):
        engine.step()
    return engine


def verify_round(engine: Engine, forward, drafts: torch.Tensor, graphs: bool):
    """One TARGET_VERIFY step over every running request; returns (logits [b * D, vocab],
    the token sequences the rows continue, prefix lengths)."""
    reqs = list(engine.running)
    prefixes = [r.num_cached for r in reqs]
    seqs = [r.prompt_ids + r.output_ids for r in reqs]  # cached tokens + the last sampled one
    ids = torch.tensor([t for s, dr in zip(seqs, drafts) for t in [s[-1]] + dr.tolist()])
    loc = torch.cat([engine._alloc(r, D) for r in reqs])
    dev = engine.device
    fb = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=len(reqs),
        req_pool_indices=torch.tensor([r.row for r in reqs], device=dev),
        seq_lens=torch.tensor(prefixes, dtype=torch.int32, device=dev),
        seq_lens_cpu=torch.tensor(prefixes, dtype=torch.int32), out_cache_loc=loc,
        positions=torch.cat([p + torch.arange(D) for p in prefixes]).to(dev),
        spec_info=SpecInfo(topk=1, draft_token_num=D))
    fb.attn_backend, fb.token_to_kv_pool = engine.attn_backend, engine.token_to_kv_pool
    fb.req_to_token_pool = engine.req_to_token_pool
    if not graphs:
        engine.attn_backend.init_forward_metadata(fb)
    with torch.inference_mode():
        logits = forward(ids, fb.positions, fb)
    full = [s + dr.tolist() for s, dr in zip(seqs, drafts)]
    return logits, full, prefixes


def accept(engine: Engine, logits: torch.Tensor, full, prefixes, accepted: list[int]) -> None:
    """Keep ``accepted[i]`` tokens of request i, roll its states back, sample the next token."""
    engine.attn_backend.update_mamba_state_after_mtp_verify(torch.tensor(accepted) - 1)
    for i, (req, n) in enumerate(zip(engine.running, accepted)):
        req.num_cached = prefixes[i] + n
        kept = full[i][len(req.prompt_ids):prefixes[i] + n]
        req.output_ids = kept + [int(logits[i * D + n - 1].argmax())]


def run_rounds(hf, engine: Engine, forward, graphs: bool) -> None:
    g = torch.Generator().manual_seed(7)
    for accepted in ACCEPTED:
        drafts = torch.randint(0, 97, (len(engine.running), D - 1), generator=g)
        logits, full, prefixes = verify_round(engine, forward, drafts, graphs)
        for i, (seq, p) in enumerate(zip(full, prefixes)):
            with torch.no_grad():
                ref = hf(torch.tensor([seq])).logits[0, p:p + D].float()
            torch.testing.assert_close(logits[i * D:(i + 1) * D], ref, atol=2e-4, rtol=1e-4)
        accept(engine, logits, full, prefixes, accepted)


@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_and_rollback_match_transformers(hf, page_size):
    model = from_hf(hf)
    engine = prefill(model, page_size)
    run_rounds(hf, engine, lambda ids, pos, fb: model(ids, pos, fb), graphs=False)


@pytest.mark.parametrize("through", ["compile_model", "full_and_piecewise"])
def test_verify_in_a_full_graph_matches_transformers(hf, through):
    """Rounds 1-4 through a ``GraphRunner`` (its step recorded through ``compile_model``, or
    through the piecewise model with both split ops, as ``--mode graphs``): warm-up, capture,
    then replays of bucket 2."""
    torch._dynamo.reset()
    model = from_hf(hf)
    engine = prefill(model, 16)
    if through == "compile_model":
        runner = GraphRunner(model, forward=compile_model(model, backend="eager"),
                             emulate_graphs=True, draft_token_num=D, batch_sizes=(1, 2, 4))
    else:
        runner = full_and_piecewise(model, inductor=False, emulate_graphs=True,
                                    draft_token_num=D, batch_sizes=(1, 2, 4),
                                    graph_sizes=(8, 16))
    run_rounds(hf, engine, runner, graphs=True)
    assert (runner.captures, runner.replays) == (1, len(ACCEPTED) - 2)  # warm-up, capture, rest


def test_mixed_step_of_a_decoding_and_an_extending_request(hf):
    """A MIXED batch: request 0 decodes its last sampled token, request 1 extends by it and
    two more tokens; both continue from their slots' states (``has_initial_state``)."""
    model = from_hf(hf)
    engine = prefill(model, 16)
    reqs, dev = list(engine.running), engine.device
    extra = [[], [41, 7]]
    new = [[r.output_ids[-1]] + e for r, e in zip(reqs, extra)]
    prefixes = [r.num_cached for r in reqs]
    loc = torch.cat([engine._alloc(r, len(n)) for r, n in zip(reqs, new)])
    lens = torch.tensor([len(n) for n in new], dtype=torch.int32)
    fb = ForwardBatch(
        forward_mode=ForwardMode.MIXED, batch_size=2,
        req_pool_indices=torch.tensor([r.row for r in reqs], device=dev),
        seq_lens=torch.tensor([r.num_cached for r in reqs], dtype=torch.int32, device=dev),
        seq_lens_cpu=torch.tensor([r.num_cached for r in reqs], dtype=torch.int32),
        out_cache_loc=loc,
        positions=torch.cat([p + torch.arange(len(n)) for p, n in zip(prefixes, new)]).to(dev),
        extend_seq_lens=lens.to(dev), extend_seq_lens_cpu=lens.tolist(),
        extend_prefix_lens=torch.tensor(prefixes, dtype=torch.int32, device=dev),
        extend_prefix_lens_cpu=prefixes)
    fb.attn_backend, fb.token_to_kv_pool = engine.attn_backend, engine.token_to_kv_pool
    fb.req_to_token_pool = engine.req_to_token_pool
    engine.attn_backend.init_forward_metadata(fb)
    assert engine.attn_backend.linear_metadata.has_initial_state.tolist() == [True, True]
    with torch.inference_mode():
        logits = model(torch.tensor([t for n in new for t in n]), fb.positions, fb,
                       return_all_logits=True)
    row = 0
    for r, n, p in zip(reqs, new, prefixes):
        seq = r.prompt_ids + r.output_ids + n[1:]
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0, p:p + len(n)].float()
        torch.testing.assert_close(logits[row:row + len(n)], ref, atol=2e-4, rtol=1e-4)
        row += len(n)
