"""The state handlers of disaggregation, in one process: each pool kind's state moves bit for
bit between engines of different page sizes, and nothing else in the receiving pools is
written.

A source engine prefills one prompt (chunked); its handlers pack the request's state. A
destination engine of another page size gives a copy of the request its row and slots
(``Engine.admit_prefilled``), every state tensor of its pools is filled with all-ones bits
(NaN for floats and for fp8 keys, a value no finite state has), and its handlers unpack the
payload. Checks: packing the copy again gives the payload bit for bit, and exactly as many
pool elements changed as the payload holds values other than the poison (one element per value
sent: nothing outside the request's slots, window, index keys or state slot was touched). Models: the scenarios of
``test_disaggregation`` (MHA Llama, Gemma 3's sliding-window pool, MLA, DeepSeek-V3.2's DSA
index keys, with a bfloat16 and an fp8 latent cache, Qwen3-Next's linear-attention states).
"""

from __future__ import annotations

import pytest
import torch
from xpu_ops.index_k_layout import split_blocks

from compile.batch import DSATokenToKVPool, SWAKVPool
from compile.engine import Engine, SamplingParams
from compile.engine.kv_transfer import state_handlers
from compile.engine.request import Req
from compile.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM
from tests.compile.engine.test_disaggregation import ENGINE, SCENARIOS, _prompts, _random

CASES = ["llama_16_to_1", "gemma3_swa_4_to_1", "mla_1_to_4", "dsa_index_keys_1_to_64",
         "qwen3_next_linear_16_to_1", "dsa_fp8_latent_1_to_64"]


def _dsa_rank_128():
    """The DeepSeek-V3.2 scenario's model with R = 128, the least an fp8 latent cache takes."""
    torch.manual_seed(0)
    cfg = DeepseekV32Config(vocab_size=64, num_hidden_layers=2, q_lora_rank=24, kv_lora_rank=128,
                            index_topk=4, index_n_heads=4, index_head_dim=32)
    return _random(DeepseekV32ForCausalLM(cfg))


# name -> (a SCENARIOS-like entry, kv_dtype): on an fp8 latent cache the DSA pool holds
# FlashMLA's fp8 token bytes, which move as stored
KV_DTYPE_CASES = {"dsa_fp8_latent_1_to_64": ((_dsa_rank_128, 1, 64, False, (9, 14)),
                                             torch.float8_e4m3fn)}
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
    scenario, kv_dtype = KV_DTYPE_CASES.get(name, (SCENARIOS.get(name), None))
    build, src_ps, dst_ps, _, lens = scenario
    model = build()
    prompt = _prompts(model.config.vocab_size, lens)[0]
    sampling = SamplingParams(max_new_tokens=4)
    src = Engine(model, page_size=src_ps, kv_dtype=kv_dtype, **ENGINE)
    req = src.add_requests([prompt], sampling)[0]
    while req.num_cached < len(prompt):
        src.step()
    sent = [t.clone() for h in state_handlers(src) for t in h.pack(req)]

    dst = Engine(model, page_size=dst_ps, kv_dtype=kv_dtype, **ENGINE)
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
    # every value sent lands on one poisoned element (a sent value equal to the poison, a 0xff
    # byte of an fp8 token's scale or rope part, changes nothing)
    assert changed == sum(int((bits(t) != -1).sum()) for t in sent)
    assert changed > 0.99 * sum(t.numel() for t in sent)
