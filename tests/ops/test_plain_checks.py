"""The ops' fast acceptance of plain valid calls (``_is_plain_valid_*``) never accepts a call that
the full checks reject: every argument of a valid call is changed in dtype, rank, each size and
device, one at a time, and wherever the full check raises the fast path must say False."""

from __future__ import annotations

import pytest
import torch

from xpu_ops.ops import kv_cache, merge_state, paged_attention

I32 = dict(dtype=torch.int32)


def _attention():
    b, hq, hkv, d, page, pages = 3, 8, 2, 16, 4, 6
    args = [torch.randn(b, hq, d), torch.randn(pages, page, hkv, d),
            torch.randn(pages, page, hkv, d), torch.tensor([5, 1, 8], **I32),
            torch.zeros(b, 2, **I32), torch.arange(b + 1, **I32), torch.empty(b, hq, d)]

    def full(*t, scale=0.25, left=-1, right=0):
        paged_attention._check_flash_attn_with_kvcache(
            *t, *[None] * 7, max_seqlen_q=1, softmax_scale=scale, window_size_left=left,
            window_size_right=right, softcap=0.0, num_splits=0)

    def fast(*t, scale=0.25, left=-1, right=0):
        return paged_attention._is_plain_valid_flash_attn_with_kvcache(*t, True, 1, scale, left,
                                                                       right, 0.0, 0)
    return args, full, fast


def _store():
    args = [torch.zeros(10, 2, 4), torch.zeros(10, 2, 3), torch.tensor([1, 7]),
            torch.randn(2, 2, 4), torch.randn(2, 2, 3)]

    def full(*t):
        kv_cache._check_store_kv_cache(*t, None, None)
    return args, full, kv_cache._is_plain_valid_store_kv_cache


def _merge():
    args = [torch.randn(3, 2, 8), torch.randn(3, 2), torch.randn(3, 2, 8), torch.randn(3, 2),
            torch.empty(3, 2, 8), torch.empty(3, 2)]
    return args, merge_state._check_merge_state_v2, merge_state._is_plain_valid_merge_state_v2


def _variants(t: torch.Tensor):
    """``t`` in other dtypes, ranks, sizes and on another device."""
    for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32):
        if dtype != t.dtype:
            yield f"dtype {dtype}", t.to(dtype)
    yield "one dim fewer", t[0] if t.dim() > 1 else t.reshape(1, -1)
    yield "one dim more", t.unsqueeze(0)
    for dim in range(t.dim()):
        grown = list(t.shape)
        grown[dim] += 1
        yield f"dim {dim} + 1", torch.zeros(grown, dtype=t.dtype)
    yield "device meta", t.to("meta")


@pytest.mark.parametrize("make", [_attention, _store, _merge], ids=["attention", "store", "merge"])
def test_fast_path_accepts_nothing_the_full_checks_reject(make):
    args, full, fast = make()
    full(*args)
    assert fast(*args)                       # the plain valid call takes the fast path
    rejected = 0
    for i, arg in enumerate(args):
        for what, variant in _variants(arg):
            changed = args[:i] + [variant] + args[i + 1:]
            try:
                full(*changed)
            except (ValueError, TypeError):
                rejected += 1
                assert not fast(*changed), f"argument {i} ({what}) is rejected by the checks"
    assert rejected >= 4 * len(args)         # the mutations do reach the checks


@pytest.mark.parametrize("scalars", [dict(scale=float("nan")), dict(scale=float("inf")),
                                     dict(scale=-float("inf")), dict(left=-2), dict(right=-5)],
                         ids=["nan-scale", "inf-scale", "-inf-scale", "left-2", "right-5"])
def test_attention_scalars_are_checked_by_the_op_and_refused_by_the_fast_path(scalars):
    """A direct ``torch.ops`` call with a non-finite ``softmax_scale`` or a window side below
    -1 is refused as the wrapper's is (the op's full check, which its fake runs too), and the
    fast path never accepts it."""
    args, full, fast = _attention()
    assert not fast(*args, **scalars)
    arg = "softmax_scale" if "scale" in scalars else (
        "window_size_left" if "left" in scalars else "window_size_right")
    with pytest.raises(ValueError, match=arg):
        full(*args, **scalars)
