"""The engine's public calls of the disaggregated decode role check before they change
anything: ``Engine.release`` refuses a request that is not running (released already, still
waiting, another engine's), ``Engine.admit_prefilled`` one that does not fit or holds a row
already, each with a ValueError; rows, pages and the request stay as they were."""

from __future__ import annotations

import pytest
import torch

from compile.engine import Engine, SamplingParams
from compile.engine.request import Req
from tests.compile.compile_helpers import tiny_model


def _engine(model) -> Engine:
    return Engine(model, page_size=4, max_running=2, max_context_len=32, max_total_tokens=96,
                  chunked_prefill_size=8)


def _state(engine: Engine) -> tuple:
    return (engine.req_to_token_pool.available_size(), len(engine.allocator.free_pages),
            len(engine.running), len(engine.waiting))


def test_release_refuses_a_request_that_is_not_running():
    model = tiny_model()
    engine, other = _engine(model), _engine(model)
    done = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=4))
    with torch.no_grad():
        engine.step()                                   # admitted, prompt cached
    engine.release(done, "abort")
    waiting = engine.add_request([4, 5], SamplingParams(max_new_tokens=2))
    foreign = other.add_request([6], SamplingParams(max_new_tokens=2))
    with torch.no_grad():
        other.step()
    for req, state in ((done, "released"), (waiting, "waiting"), (foreign, "not this "
                                                                   "engine's")):
        before, reason = _state(engine), req.finish_reason
        with pytest.raises(ValueError, match=rf"^Engine.release: req is not running; expected "
                           rf"a request of Engine.running, got request {req.rid} \({state}\)"):
            engine.release(req, "stop")
        assert _state(engine) == before and req.finish_reason == reason
    with torch.no_grad():                               # the engine still serves its queue
        assert engine.generate([[7, 8, 9]], SamplingParams(max_new_tokens=3))[0]
    assert waiting.finish_reason is not None and len(waiting.output_ids) == 2


def test_admit_prefilled_refuses_a_request_that_does_not_fit_or_runs():
    engine = Engine(tiny_model(), page_size=4, max_running=2, max_context_len=32,
                    max_total_tokens=16, chunked_prefill_size=8)
    big = Req(rid=0, prompt_ids=list(range(1, 30)), sampling=SamplingParams(max_new_tokens=2))
    before = _state(engine)
    with pytest.raises(ValueError, match=r"^Engine.admit_prefilled: req does not fit; expected "
                       r"a request without a row that has_room\(31\) accepts"):
        engine.admit_prefilled(big)                 # 31 tokens: 8 pages of a 4-page pool
    assert _state(engine) == before and big.row is None and big.pages == []
    small = Req(rid=1, prompt_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2))
    engine.admit_prefilled(small)
    admitted = _state(engine)
    with pytest.raises(ValueError, match=r"^Engine.admit_prefilled: req holds a row already"):
        engine.admit_prefilled(small)
    assert _state(engine) == admitted and small.num_cached == 2
