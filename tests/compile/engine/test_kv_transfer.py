"""The state handlers of disaggregation, in one process: each pool kind's state moves bit for
bit between engines of different page sizes, and nothing else in the receiving pools is
written.

A source engine prefills one prompt (chunked); its handlers pack the request's state. A
destination engine of another page size gives a copy of the request its row and slots
(``Engine.admit_prefilled``), every state tensor of its pools is filled with all-ones bits
(NaN for floats and for fp8 keys, a value no finite state has), and its handlers unpack the
payload. Checks: packing the copy again gives the payload bit for bit, and exactly as many
pool elements changed as the payload holds (one element per value sent: nothing outside the
request's slots, window, index keys or state slot was touched). Models: the scenarios of
``test_disaggregation`` (MHA Llama, Gemma 3's sliding-window pool, MLA, DeepSeek-V3.2's DSA
index keys, Qwen3-Next's linear-attention states).
"""

from __future__ import annotations

import pytest
import torch
from xpu_ops.index_k_layout import split_blocks

from compile.batch import DSATokenToKVPool, SWAKVPool
from compile.engine import Engine, SamplingParams
from compile.engine.kv_transfer import state_handlers
from compile.engine.request import Req
from tests.compile.engine.test_disaggregation import ENGINE, SCENARIOS, _prompts

CASES = ["llama_16_to_1", "gemma3_swa_4_to_1", "mla_1_to_4", "dsa_index_keys_1_to_64",
         "qwen3_next_linear_16_to_1"]
INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width (NaNs compare by their bits)."""
    return t.view(INTS[t.element_size()])


def state_tensors(engine: Engine) -> list[torch.Tensor]:
    """Every per-token and per-request state tensor of ``engine``'s pools, once each, as views
    with one state value per element (the DSA index-key cache as its fp8 bytes and float32
    scales)."""
    pool = engine.token_to_kv_pool
    pools = [pool.full_kv_pool, pool.swa_kv_pool] if isinstance(pool, SWAKVPool) else [pool]
    out = []
    for p in pools:
        for name in ("k_buffer", "v_buffer", "kv_buffer"):
            out += list(getattr(p, name, []))
        if isinstance(p, DSATokenToKVPool):
            out += [v for t in p.index_k_with_scale_buffer for v in split_blocks(t)]
    if engine.state_pool is not None:
        out += [engine.state_pool.conv, engine.state_pool.ssm]
    # a layer without a cache of its own (KV sharing, linear attention) lists its target's
    # buffer: each buffer once
    return list({(t.data_ptr(), t.dtype): t for t in out}.values())


@pytest.mark.parametrize("name", CASES)
def test_state_moves_bit_exact_and_nothing_else_is_written(name):
    build, src_ps, dst_ps, _, lens = SCENARIOS[name]
    model = build()
    prompt = _prompts(model.config.vocab_size, lens)[0]
    sampling = SamplingParams(max_new_tokens=4)
    src = Engine(model, page_size=src_ps, **ENGINE)
    req = src.add_requests([prompt], sampling)[0]
    while req.num_cached < len(prompt):
        src.step()
    sent = [t.clone() for h in state_handlers(src) for t in h.pack(req)]

    dst = Engine(model, page_size=dst_ps, **ENGINE)
    copy = Req(0, list(prompt), sampling, output_ids=list(req.output_ids))
    dst.admit_prefilled(copy)
    pools = state_tensors(dst)
    for t in pools:
        bits(t).fill_(-1)
    before = [t.clone() for t in pools]
    at = 0
    for h in state_handlers(dst):
        k = len(h.buffers(0))
        h.unpack(copy, sent[at:at + k])
        at += k
    got = [t for h in state_handlers(dst) for t in h.pack(copy)]
    assert len(got) == len(sent) and at == len(sent)
    for g, s in zip(got, sent):
        assert g.dtype == s.dtype and torch.equal(bits(g), bits(s))
    changed = sum(int((bits(a) != bits(b)).sum()) for a, b in zip(before, pools))
    assert changed == sum(t.numel() for t in sent)
