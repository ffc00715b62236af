"""``Engine.release`` (public: the disaggregated decode role calls it) refuses a request that
is not running (released already, still waiting, another engine's) with a ValueError before
changing anything: its rows, pages and the request's ``finish_reason`` stay as they were."""

from __future__ import annotations

import pytest
import torch

from compile.engine import Engine, SamplingParams
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
