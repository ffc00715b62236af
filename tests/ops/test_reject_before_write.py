"""A rejected call changes nothing: every check of an op runs before its first write.

``flash_attn_with_kvcache`` with ``k``/``v`` appends the new keys into the cache before it
attends (FA3's in-call append, ``xpu_ops/ops/kvcache_append.py``); each bad argument of the
attention part, and each inconsistent ``cu_seqlens_k_new`` under the debug checks, must raise
before that store. Each test snapshots every cache and ``out`` and compares them bitwise after.
"""

from __future__ import annotations

import math

import pytest
import torch

import xpu_ops

from .utils import bitwise_equal

I32 = torch.int32
FN = "flash_attn_with_kvcache"


def _append_call(**overrides) -> dict:
    """A small valid append call: 2 requests, 2 cached + 1/2 new keys, page size 4."""
    gen = torch.Generator().manual_seed(3)
    d = 8
    call = dict(q=torch.randn(3, 4, d, generator=gen),
                k_cache=torch.randn(4, 4, 2, d, generator=gen),
                v_cache=torch.randn(4, 4, 2, d, generator=gen),
                k=torch.randn(3, 2, d, generator=gen), v=torch.randn(3, 2, d, generator=gen),
                cache_seqlens=torch.tensor([2, 2], dtype=I32),
                page_table=torch.tensor([[1, 0], [3, 2]], dtype=I32),
                cu_seqlens_q=torch.tensor([0, 1, 3], dtype=I32),
                cu_seqlens_k_new=torch.tensor([0, 1, 3], dtype=I32),
                out=torch.full((3, 4, d), math.nan), causal=True)
    call.update(overrides)
    return call


def _assert_rejected_without_writes(call: dict, arg: str, exc=(ValueError, TypeError)) -> None:
    before = {name: t.clone() for name, t in call.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(exc, match=f"^{FN}: {arg}[ ;/]"):
        xpu_ops.flash_attn_with_kvcache(**call)
    for name, t in before.items():
        assert bitwise_equal(call[name], t), f"{name} was written by a rejected call"


D = 8
BAD_APPEND_ARGS = [
    ("out", dict(out=torch.full((3, 4, D + 1), math.nan))),
    ("out", dict(out=torch.full((3, 4, D), math.nan, dtype=torch.float16))),
    ("softcap", dict(softcap=-1.0)),
    ("softcap", dict(softcap=math.nan)),
    ("sinks", dict(sinks=torch.zeros(3))),
    ("sinks", dict(sinks=torch.zeros(4, dtype=torch.int32))),
    ("softmax_scale", dict(softmax_scale=math.nan)),
    ("softmax_scale", dict(softmax_scale=math.inf)),
    ("qv", dict(qv=torch.zeros(3, 4, D + 1))),
    ("q_descale", dict(q_descale=torch.ones(2, 2))),
    ("k_descale", dict(k_descale=torch.ones(2, 2))),
    ("v_descale", dict(v_descale=torch.ones(2, 2))),
    ("cache_leftpad", dict(cache_leftpad=torch.zeros(2, dtype=torch.int64))),
    ("cache_leftpad", dict(cache_leftpad=torch.zeros(3, dtype=I32))),
    ("bidirectional_block_ids", dict(bidirectional_block_ids=torch.zeros(2, dtype=I32))),
    ("q", dict(q=torch.randn(3, 3, D), out=None)),  # Hq = 3 is not a multiple of Hkv = 2
    ("q", dict(q=torch.randn(3, 4, D + 2))),       # head dim of q differs from the cache's
]


@pytest.mark.parametrize("arg, overrides", BAD_APPEND_ARGS,
                         ids=[f"{a}-{i}" for i, (a, _) in enumerate(BAD_APPEND_ARGS)])
def test_a_rejected_append_writes_nothing(arg, overrides):
    _assert_rejected_without_writes(_append_call(**overrides), arg)


def test_a_rejected_4d_append_writes_nothing():
    """The batch form (4-D q and k) with a bad ``out``: checked before the store too."""
    gen = torch.Generator().manual_seed(4)
    call = _append_call(q=torch.randn(2, 1, 4, D, generator=gen), cu_seqlens_q=None,
                        k=torch.randn(2, 1, 2, D, generator=gen), cu_seqlens_k_new=None,
                        v=torch.randn(2, 1, 2, D, generator=gen),
                        out=torch.full((2, 1, 4, D), math.nan), softcap=-2.0)
    _assert_rejected_without_writes(call, "softcap")


@pytest.mark.parametrize("cu, problem", [
    ([1, 2, 3], "does not start at 0"),
    ([0, 3, 1], "decreases"),              # s_new < 0 for request 1: not cache_seqlens' fault
    ([0, 2, 5], "reaches past the packed k"),
], ids=["not-from-0", "decreasing", "past-k"])
def test_debug_checks_name_an_inconsistent_cu_seqlens_k_new(cu, problem):
    call = _append_call(cu_seqlens_k_new=torch.tensor(cu, dtype=I32))
    with xpu_ops.debug_checks():
        _assert_rejected_without_writes(call, f"cu_seqlens_k_new {problem}")


def test_padding_past_cu_seqlens_k_new_is_legal_under_debug_checks():
    """Packed k may end with padding rows that no request owns: they are not stored."""
    call = _append_call(cu_seqlens_k_new=torch.tensor([0, 1, 2], dtype=I32))
    before = call["k_cache"].clone()
    with xpu_ops.debug_checks():
        xpu_ops.flash_attn_with_kvcache(**call)
    # request 0 stores its key at position 2 of page 1, request 1 at position 2 of page 3
    torch.testing.assert_close(call["k_cache"][1, 2], call["k"][0], rtol=0, atol=0)
    torch.testing.assert_close(call["k_cache"][3, 2], call["k"][1], rtol=0, atol=0)
    changed = (call["k_cache"] != before).flatten(1).any(1)
    assert changed.tolist() == [False, True, False, True]
    assert bitwise_equal(call["k_cache"][3, 3], before[3, 3])  # the padding row k[2]
