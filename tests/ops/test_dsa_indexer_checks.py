"""DSA indexer ops' argument checks: every check names its function and argument, eagerly and in
the fakes alike; a rejected store writes nothing; the debug value checks reject inconsistent
slots and paged metadata before any write (with them off, the same calls clamp)."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import xpu_ops

from .utils import bitwise_equal, fake_like

I32 = torch.int32
E4M3 = torch.float8_e4m3fn


def _mqa_call(**over):
    call = dict(q=torch.randn(3, 4, 16).to(E4M3), kv=(torch.randn(5, 16).to(E4M3),
                                                      torch.rand(5)),
                weights=torch.randn(3, 4), cu_seqlen_ks=torch.zeros(3, dtype=I32),
                cu_seqlen_ke=torch.full((3,), 5, dtype=I32))
    call.update(over)
    return call


def _paged_call(**over):
    call = dict(q=torch.randn(2, 1, 4, 16).to(E4M3),
                kv_cache=torch.zeros(3, 4, 1, 20, dtype=torch.uint8), weights=torch.randn(2, 4),
                context_lens=torch.tensor([3, 5], dtype=I32),
                block_table=torch.tensor([[0, 1], [2, 1]], dtype=I32), schedule_meta=None,
                max_context_len=8)
    call.update(over)
    return call


def _topk_call(**over):
    call = dict(score=torch.randn(3, 10), lengths=torch.full((3,), 10, dtype=I32), topk=4)
    call.update(over)
    return call


BAD_CALLS = [
    (xpu_ops.fp8_mqa_logits, _mqa_call(q=torch.randn(3, 4, 16)), "q has dtype torch.float32"),
    (xpu_ops.fp8_mqa_logits, _mqa_call(kv=torch.randn(5, 16)), "kv is not a pair"),
    (xpu_ops.fp8_mqa_logits, _mqa_call(kv=(torch.randn(5, 8).to(E4M3), torch.rand(5))),
     "k has the wrong size in dimension 1"),
    (xpu_ops.fp8_mqa_logits, _mqa_call(kv=(torch.randn(5, 16).to(E4M3), torch.rand(4))),
     "k_scale has the wrong size"),
    (xpu_ops.fp8_mqa_logits, _mqa_call(weights=torch.randn(3, 2)), "weights has the wrong size"),
    (xpu_ops.fp8_mqa_logits, _mqa_call(cu_seqlen_ks=torch.zeros(3, dtype=torch.int64)),
     "cu_seqlen_ks has dtype torch.int64"),
    (xpu_ops.fp8_mqa_logits, _mqa_call(cu_seqlen_ke=torch.zeros(2, dtype=I32)),
     "cu_seqlen_ke has the wrong size"),
    (xpu_ops.fp8_mqa_logits, _mqa_call(max_seqlen_k=-1), "max_seqlen_k is negative"),
    (xpu_ops.fp8_mqa_logits, _mqa_call(clean_logits="yes"), "clean_logits is not a bool"),
    (xpu_ops.fp8_paged_mqa_logits, _paged_call(kv_cache=torch.zeros(3, 4, 1, 20)),
     "kv_cache has dtype torch.float32"),
    (xpu_ops.fp8_paged_mqa_logits, _paged_call(kv_cache=torch.zeros(3, 4, 1, 24,
                                                                      dtype=torch.uint8)),
     "kv_cache has the wrong size in dimension 3"),
    (xpu_ops.fp8_paged_mqa_logits, _paged_call(weights=torch.randn(3, 4)),
     "weights has the wrong size in dimension 0"),
    (xpu_ops.fp8_paged_mqa_logits, _paged_call(context_lens=torch.tensor([[3, 5]], dtype=I32)),
     "context_lens has the wrong size in dimension 0"),
    (xpu_ops.fp8_paged_mqa_logits, _paged_call(block_table=torch.zeros(2, 2)),
     "block_table has dtype torch.float32"),
    (xpu_ops.fp8_paged_mqa_logits, _paged_call(max_context_len=2.0),
     "max_context_len is not an integer"),
    (xpu_ops.fp8_paged_mqa_logits, _paged_call(schedule_meta=[1]), "schedule_meta is not a tensor"),
    (xpu_ops.fast_topk_v2, _topk_call(score=torch.randn(3, 10).half()),
     "score has dtype torch.float16"),
    (xpu_ops.fast_topk_v2, _topk_call(lengths=torch.ones(2, dtype=I32)),
     "lengths has the wrong size"),
    (xpu_ops.fast_topk_v2, _topk_call(topk=0), "topk is not positive"),
    (xpu_ops.fast_topk_v2, _topk_call(row_starts=torch.ones(3)), "row_starts has dtype"),
    (xpu_ops.fast_topk_transform_fused,
     dict(_topk_call(), page_table_size_1=torch.zeros(2, 4, dtype=I32),
          cu_seqlens_q=torch.zeros(2, dtype=I32)), "cu_seqlens_q has the wrong size"),
    (xpu_ops.hadamard_transform, dict(x=torch.ones(4, dtype=torch.int32)), "x has dtype"),
    (xpu_ops.hadamard_transform, dict(x=torch.ones(4), scale=math.nan), "scale is not finite"),
    (xpu_ops.hadamard_transform, dict(x=torch.tensor(1.0)), "x is a 0-D tensor"),
]


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("call,kwargs,expected", BAD_CALLS,
                         ids=[f"{c.__name__}-{e.split()[0]}-{i}"
                              for i, (c, _, e) in enumerate(BAD_CALLS)])
def test_bad_argument_names_itself(call, kwargs, expected, fake):
    """House format ``<function>: <argument> ...``, eagerly and in the fakes alike."""
    mode = FakeTensorMode() if fake else None

    def prepare(v):
        if isinstance(v, tuple):
            return tuple(prepare(t) for t in v)
        return fake_like(mode, v) if fake else v

    args = {k: prepare(v) for k, v in kwargs.items()}
    with pytest.raises((ValueError, TypeError)) as info:
        if fake:
            with mode:
                call(**args)
        else:
            call(**args)
    message = str(info.value)
    assert expected in message and message.split(":")[0] in call.__name__, message


STORE_BAD = [
    (dict(index_k=torch.randn(3, 8)), "index_k_cache has the wrong size in dimension 3"),
    (dict(loc=torch.tensor([1, 2])), "loc has the wrong size in dimension 0"),
    (dict(loc=torch.tensor([1.0, 2.0, 3.0])), "loc has dtype torch.float32"),
    (dict(index_k=torch.randn(3, 16).to(torch.int32)), "index_k has dtype torch.int32"),
    (dict(index_k_cache=torch.zeros(2, 4, 1, 20)), "index_k_cache has dtype torch.float32"),
    (dict(scale_fmt="ue4m3"), "scale_fmt is not a known scale format"),
]


@pytest.mark.parametrize("over,expected", STORE_BAD, ids=[e.split()[0] for _, e in STORE_BAD])
def test_a_rejected_store_names_its_argument_and_writes_nothing(over, expected):
    call = dict(index_k_cache=torch.full((2, 4, 1, 20), 0x7F, dtype=torch.uint8),
                loc=torch.tensor([1, 2, 3]), index_k=torch.randn(3, 16))
    call.update(over)
    before = call["index_k_cache"].clone()
    with pytest.raises((ValueError, TypeError), match="store_index_k_cache: " + expected):
        xpu_ops.store_index_k_cache(**call)
    assert bitwise_equal(call["index_k_cache"], before)


@pytest.mark.parametrize("loc,message", [
    ([3, -2, 5], r"loc has a token slot out of range; .* got loc\[1\] = -2"),
    ([3, 8, 1], r"loc has a token slot out of range; .* got loc\[1\] = 8"),
    ([3, -1, 3], "loc has a repeated token slot")])
def test_debug_checks_reject_bad_store_slots_before_writing(loc, message):
    cache = torch.full((2, 4, 1, 20), 0x7F, dtype=torch.uint8)
    before = cache.clone()
    with xpu_ops.debug_checks(), pytest.raises(ValueError, match=message):
        xpu_ops.store_index_k_cache(cache, torch.tensor(loc), torch.randn(3, 16))
    assert bitwise_equal(cache, before)
    xpu_ops.store_index_k_cache(cache, torch.tensor(loc), torch.randn(3, 16))   # checks off


@pytest.mark.parametrize("over,message", [
    (dict(block_table=torch.tensor([[0, 7], [2, 1]], dtype=I32),
          context_lens=torch.tensor([6, 5], dtype=I32)), "block_table has a page id out of range"),
    (dict(context_lens=torch.tensor([3, 9], dtype=I32)), "context_lens is out of range")])
def test_debug_checks_reject_bad_paged_metadata(over, message):
    call = _paged_call(**over)
    with xpu_ops.debug_checks(), pytest.raises(ValueError, match=message):
        xpu_ops.fp8_paged_mqa_logits(**call)
    xpu_ops.fp8_paged_mqa_logits(**call)                            # clamped when off
