"""Extend from a cached prefix that another request computed (a prefix-cache hit, sglang's
``copy_from`` of the mamba state): request B's row maps request A's prefix pages (their KV)
and B's state slot is a fork of A's (``LinearStatePool.fork``), so B's extend step runs only
its suffix, from the prefix's conv window and recurrent state. B's extend logits must equal
``transformers``' on the whole prompt and its greedy tokens ``generate``'s; a wrong fork
(zeros, another slot's state, a missing conv window) or a wrong prefix length changes them.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from compile.engine import Engine, SamplingParams  # noqa: E402
from compile.models import from_hf  # noqa: E402
from tests.compile.batch.test_swa_pages import Recorder  # noqa: E402
from tests.models.test_qwen3_next_parity import qwen3_next_hf  # noqa: E402

SUFFIX, NEW_TOKENS = 9, 4


@pytest.fixture(scope="module")
def hf():
    return qwen3_next_hf()


def share_prefix(engine: Engine, a, b, prefix: int) -> None:
    """Give admitted request ``b`` the first ``prefix`` tokens of request ``a``: its pages
    (KV) and a copy of its state slot (``a`` has cached exactly ``prefix`` tokens)."""
    engine.state_pool.free([b.row])  # the fresh zeroed slot _admit gave it
    engine.state_pool.fork(a.row, b.row)
    table = engine.req_to_token_pool.req_to_token
    table[b.row, :prefix] = table[a.row, :prefix]
    b.pages, b.num_cached = list(a.pages[:-(-prefix // engine.page_size)]), prefix


@pytest.mark.parametrize("page_size, prefix", [(1, 29), (16, 32)])
def test_extend_from_a_forked_prefix_matches_transformers(hf, page_size, prefix):
    model = from_hf(hf)
    rec = Recorder(model)
    engine = Engine(model, forward=rec, page_size=page_size, max_running=2, max_context_len=64,
                    max_total_tokens=160, chunked_prefill_size=64)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, hf.config.vocab_size, (prefix + SUFFIX,), generator=g).tolist()
    a, = engine.add_requests([ids[:prefix]], SamplingParams(max_new_tokens=2 * NEW_TOKENS))
    engine.step()  # A's prefill: its slot holds the prefix's state, its pages the prefix's KV
    assert a.num_cached == prefix and a.finish_reason is None
    b, = engine.add_requests([ids], SamplingParams(max_new_tokens=NEW_TOKENS))
    engine._admit()
    share_prefix(engine, a, b, prefix)
    engine.step()  # B's extend: SUFFIX tokens over a cached prefix of `prefix`
    batch = engine.last_batch
    assert batch.extend_prefix_lens.tolist() == [prefix]
    assert batch.extend_seq_lens.tolist() == [SUFFIX]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(rec.logits[-1][0], ref, atol=1e-4, rtol=1e-4)
    while b.finish_reason is None:  # decode steps of A and B together
        engine.step()
    want = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                       pad_token_id=0)[0, len(ids):].tolist()
    assert b.output_ids == want
