"""The FlashAttention-3 surface of ``flash_attn_with_kvcache`` / ``flash_attn_varlen_func``.

API.md, "Public Python functions": dense caches with ``cache_batch_idx``, ``cache_leftpad``,
``seqused_q``, ``bidirectional_block_ids`` (sglang 0.5.23 / sgl-kernel-xpu), ``num_splits``
and the speed-only keywords. Every numeric check is against the float64 oracle
(``tests/ops/oracle.py``) on fresh random inputs with NaN-poisoned outputs; the Triton kernel
runs the same features in ``test_triton_ops.py`` (interpreter) and ``test_triton_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import xpu_ops
from xpu_ops.ops.rotary import apply_rotary_emb
from xpu_ops.testing import paged_kv_cache

from . import oracle
from .utils import assert_matches_oracle, fake_like

I32 = torch.int32
NAN = float("nan")


def _paged(seed, q_lens, k_lens, *, page_size=4, hq=4, hkv=2, d=32, dv=None, room=0):
    """Packed q, a shuffled paged cache (NaN past every length, ``room`` more slots per
    request for appends) and the call's metadata."""
    gen = torch.Generator().manual_seed(seed)
    (k_cache, v_cache), page_table, cache_seqlens = paged_kv_cache(
        gen, [n + room for n in k_lens], page_size, [(hkv, d), (hkv, dv or d)],
        dtype=torch.float32, device="cpu")
    cache_seqlens = torch.tensor(k_lens, dtype=I32)
    if room:  # the appended slots hold NaN until written
        _poison_tail(k_cache, v_cache, page_table, k_lens, room)
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=I32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                page_table=page_table, cu_seqlens_q=cu, max_seqlen_q=max(q_lens))


def _poison_tail(k_cache, v_cache, page_table, k_lens, room):
    page_size = k_cache.shape[1]
    for r, n in enumerate(k_lens):
        for p in range(n, n + room):
            page = int(page_table[r, p // page_size])
            k_cache[page, p % page_size] = NAN
            v_cache[page, p % page_size] = NAN


def _oracle(t, *, causal, window=(-1, -1), **extra):
    """Oracle of a public-wrapper call ``t`` (paged, packed q)."""
    left, right = window
    return oracle.flash_attn_with_kvcache(
        t["q"], t["k_cache"], t["v_cache"], t["cache_seqlens"], t["page_table"],
        t["cu_seqlens_q"], None, None, None, None, None, None, extra.get("cache_leftpad"),
        extra.get("bidirectional_block_ids"), max_seqlen_q=t["max_seqlen_q"],
        softmax_scale=t["q"].shape[-1] ** -0.5, causal=causal, window_size_left=left,
        window_size_right=0 if causal else right, softcap=0.0)


def _call(t, **kw):
    out = torch.full((t["q"].shape[0], t["q"].shape[1], t["v_cache"].shape[-1]), NAN)
    res, lse = xpu_ops.flash_attn_with_kvcache(**t, out=out, return_softmax_lse=True, **kw)
    assert res is out
    return out, lse


# ----------------------------------------------------------------------------------------------
# cache_leftpad
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)),
                                            (True, (3, 0)), (False, (2, 1))])
def test_cache_leftpad_ignores_keys_before_it(causal, window):
    t = _paged(1, q_lens=(3, 1, 2, 2), k_lens=(9, 6, 4, 0))
    leftpad = torch.tensor([2, 6, 1, 0], dtype=I32)   # request 1: every key padded away
    slots = t["page_table"][:, :1].long() * 4          # NaN garbage in the padded slots
    t["k_cache"].view(-1, 2, 32)[slots[0, 0]:slots[0, 0] + 2] = NAN
    out, lse = _call(t, causal=causal, window_size=window, cache_leftpad=leftpad)
    want, want_lse = _oracle(t, causal=causal, window=window, cache_leftpad=leftpad)
    assert_matches_oracle(out, want, torch.float32, lse, want_lse)
    assert out[3].eq(0).all() and torch.isneginf(lse[:, 3]).all()


def test_cache_leftpad_keeps_absolute_positions():
    """Padding keys away does not move the queries: row i still sits at Lk - Lq + i, so with
    causal the visible keys are [leftpad, pos] (FlashAttention-3's test mask)."""
    t = _paged(2, q_lens=(2,), k_lens=(8,))
    out, _ = _call(t, causal=True, cache_leftpad=torch.tensor([3], dtype=I32))
    keys = oracle.paged_keys(t["k_cache"], t["page_table"], 0, 8)
    values = oracle.paged_keys(t["v_cache"], t["page_table"], 0, 8)
    for i, pos in enumerate((6, 7)):
        s = torch.einsum("hd,khd->hk", t["q"][i].double().view(2, 2, 32).flatten(0, 1),
                         keys[3:pos + 1].repeat_interleave(2, 1)) / 32 ** 0.5
        ref = torch.einsum("hk,khd->hd", s.softmax(-1), values[3:pos + 1].repeat_interleave(2, 1))
        torch.testing.assert_close(out[i].double(), ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# bidirectional_block_ids (Gemma-3 image tokens)
# ----------------------------------------------------------------------------------------------

def _block_reference(t, spans):
    """sgl-kernel-xpu's test reference written out: causal, plus each span (first, last) of a
    request fully visible inside itself; full prefill (Lq == Lk)."""
    outs = []
    cu = t["cu_seqlens_q"].tolist()
    for r, req_spans in enumerate(spans):
        n = cu[r + 1] - cu[r]
        allow = torch.ones(n, n, dtype=torch.bool).tril()
        for first, last in req_spans:
            allow[first:last + 1, first:last + 1] = True
        keys = oracle.paged_keys(t["k_cache"], t["page_table"], r, n).repeat_interleave(2, 1)
        values = oracle.paged_keys(t["v_cache"], t["page_table"], r, n).repeat_interleave(2, 1)
        s = torch.einsum("qhd,khd->hqk", t["q"][cu[r]:cu[r + 1]].double(), keys) / 32 ** 0.5
        p = s.masked_fill(~allow, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, values))
    return torch.cat(outs)


def _block_ids(q_lens, spans):
    ids, block = [], 0
    for n, req_spans in zip(q_lens, spans):
        row = [-1] * n
        for first, last in req_spans:
            row[first:last + 1] = [block] * (last - first + 1)
            block += 1
        ids += row
    return torch.tensor(ids, dtype=I32)


@pytest.mark.parametrize("causal", [False, True], ids=["sgl-kernel-xpu-noncausal", "causal"])
def test_bidirectional_blocks_full_prefill(causal):
    """sglang 0.5.23 passes causal=False with the ids; either way text stays causal and each
    image block (id 0 included) is bidirectional inside itself."""
    q_lens = (7, 5, 4)
    spans = [[(1, 3), (5, 6)], [(0, 1)], []]
    t = _paged(3, q_lens=q_lens, k_lens=q_lens)
    ids = _block_ids(q_lens, spans)
    out, lse = _call(t, causal=causal, bidirectional_block_ids=ids)
    want, want_lse = _oracle(t, causal=True, bidirectional_block_ids=ids)
    assert_matches_oracle(out, want, torch.float32, lse, want_lse)
    torch.testing.assert_close(out.double(), _block_reference(t, spans), rtol=1e-5, atol=1e-5)
    plain = _call(t, causal=True)[0]
    assert (out - plain).abs().max() > 0.05       # the mask has an effect
    torch.testing.assert_close(out[12:], plain[12:], rtol=0, atol=0)   # text-only request


def test_bidirectional_blocks_after_a_cached_prefix_and_window():
    """Keys of the cached prefix carry no id (causal only); the left window still applies to
    same-block keys."""
    t = _paged(4, q_lens=(4,), k_lens=(10,), page_size=1)
    ids = torch.tensor([0, 0, 0, -1], dtype=I32)
    for window in ((-1, -1), (2, 0)):
        out, lse = _call(t, causal=True, window_size=window, bidirectional_block_ids=ids)
        want, want_lse = _oracle(t, causal=True, window=window, bidirectional_block_ids=ids)
        assert_matches_oracle(out, want, torch.float32, lse, want_lse)
    mask = oracle.visible_mask(4, 10, causal=True, left=2, block_ids=[0, 0, 0, -1])
    assert mask[0].nonzero().flatten().tolist() == [4, 5, 6, 7, 8]   # pos 6, left 2, block 6..8


# ----------------------------------------------------------------------------------------------
# Dense caches, cache_batch_idx, int cache_seqlens, tensor window_size
# ----------------------------------------------------------------------------------------------

def test_dense_cache_with_cache_batch_idx():
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn(6, 12, 2, 32, generator=gen), torch.randn(6, 12, 2, 32,
                                                                               generator=gen)
    lens = torch.tensor([12, 5, 0], dtype=I32)
    rows = torch.tensor([4, 0, 2], dtype=I32)
    for r, n in zip(rows.tolist(), lens.tolist()):
        k_cache[r, n:] = NAN
        v_cache[r, n:] = NAN
    q = torch.randn(3, 2, 4, 32, generator=gen)
    out, lse = xpu_ops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                               cache_batch_idx=rows, causal=True,
                                               return_softmax_lse=True)
    table = rows.view(3, 1)                          # a dense row is one page of s_cache tokens
    want, want_lse = oracle.flash_attn_with_kvcache(
        q.flatten(0, 1), k_cache, v_cache, lens, table, torch.tensor([0, 2, 4, 6], dtype=I32),
        None, None, None, None, None, None, max_seqlen_q=2, softmax_scale=32 ** -0.5,
        causal=True, window_size_left=-1, window_size_right=0, softcap=0.0)
    assert out.shape == (3, 2, 4, 32) and lse.shape == (3, 4, 2)
    assert_matches_oracle(out.flatten(0, 1), want, torch.float32,
                          lse.transpose(0, 1).flatten(1), want_lse)


def test_paged_cache_with_cache_batch_idx_picks_page_table_rows():
    t = _paged(6, q_lens=(2, 1, 3), k_lens=(7, 3, 9))
    order = torch.tensor([2, 0, 1], dtype=I32)
    picked = dict(t, q=t["q"], cache_seqlens=t["cache_seqlens"][order.long()])
    got, _ = _call(dict(picked, page_table=t["page_table"]), cache_batch_idx=order,
                   causal=True)
    want, want_lse = _oracle(dict(picked, page_table=t["page_table"][order.long()]),
                             causal=True)
    assert_matches_oracle(got, want, torch.float32)


def test_int_cache_seqlens_and_tensor_window_size():
    """FA3 accepts ``cache_seqlens`` as an int and its tests pass ``window_size`` as a
    2-element tensor."""
    t = _paged(7, q_lens=(2, 2), k_lens=(8, 8))
    want, want_lse = _oracle(t, causal=False, window=(3, 1))
    got, lse = _call(dict(t, cache_seqlens=8), window_size=torch.tensor([3, 1]))
    assert_matches_oracle(got, want, torch.float32, lse, want_lse)


# ----------------------------------------------------------------------------------------------
# seqused_q, num_splits and the speed-only keywords
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_varlen_seqused_q_and_seqused_k(causal):
    """Rows past ``seqused_q`` give exactly 0 (LSE -inf); the used rows align to
    ``seqused_k - seqused_q`` (FA3's padding masks), so garbage in unused rows never leaks."""
    gen = torch.Generator().manual_seed(8)
    q_lens, k_lens = (5, 3, 4), (6, 4, 9)
    q = torch.randn(sum(q_lens), 4, 32, generator=gen)
    k, v = torch.randn(sum(k_lens), 2, 32, generator=gen), torch.randn(sum(k_lens), 2, 16,
                                                                       generator=gen)
    cu_q = torch.tensor([0, 5, 8, 12], dtype=I32)
    cu_k = torch.tensor([0, 6, 10, 19], dtype=I32)
    used_q, used_k = torch.tensor([3, 0, 4], dtype=I32), torch.tensor([4, 4, 0], dtype=I32)
    q[3:5] = NAN                                    # unused rows of request 0
    k[4:6] = NAN                                    # unused keys of request 0
    out = torch.full((12, 4, 16), NAN)
    _, lse = xpu_ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 9, seqused_q=used_q,
                                            seqused_k=used_k, causal=causal, out=out,
                                            return_softmax_lse=True)
    want, want_lse = oracle.flash_attn_varlen_func(
        q.nan_to_num(), k, v, cu_q, cu_k, causal=causal, softmax_scale=32 ** -0.5,
        seqused_k=used_k, seqused_q=used_q)
    assert_matches_oracle(out, want, torch.float32, lse, want_lse)
    unused = torch.tensor([3, 4, 5, 6, 7])
    assert out[unused].eq(0).all() and torch.isneginf(lse[:, unused]).all()


def test_num_splits_and_speed_hints_never_change_the_result():
    # Bitwise, except num_splits=1: the reference then runs each request on its own (batch
    # invariant, tests/ops/test_batch_invariance.py), which may round differently.
    t = _paged(9, q_lens=(1, 4), k_lens=(30, 11))
    ref = _call(t, causal=True)[0]
    for kw in (dict(num_splits=1), dict(num_splits=3), dict(pack_gqa=True), dict(sm_margin=4),
               dict(max_seqlen_k=32), dict(scheduler_metadata=torch.zeros(4, dtype=I32)),
               dict(rotary_seqlens=t["cache_seqlens"])):
        tol = 1e-5 if kw.get("num_splits") == 1 else 0
        torch.testing.assert_close(_call(t, causal=True, **kw)[0], ref, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------------------------
# Appending k/v (cache_seqlens before the append) and rotary embedding
# ----------------------------------------------------------------------------------------------

def _append_expected(k_cache, v_cache, page_table, lens, new_k, new_v):
    """The caches after writing request r's new token j at position lens[r] + j, slot by slot."""
    k_want, v_want = k_cache.clone(), v_cache.clone()
    page_size = k_cache.shape[1]
    for r, (ks, vs) in enumerate(zip(new_k, new_v)):
        for j in range(ks.shape[0]):
            p = int(lens[r]) + j
            page = int(page_table[r, p // page_size])
            k_want[page, p % page_size], v_want[page, p % page_size] = ks[j], vs[j]
    return k_want, v_want


@pytest.mark.parametrize("packed", [False, True], ids=["4d-k", "cu_seqlens_k_new"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_append_writes_the_cache_then_attends_over_it(packed, page_size):
    t = _paged(11, q_lens=(2, 2, 2), k_lens=(5, 0, 8), page_size=page_size, room=2)
    gen = torch.Generator().manual_seed(12)
    s_new = (2, 1, 0) if packed else (2, 2, 2)
    new_k = [torch.randn(n, 2, 32, generator=gen) for n in s_new]
    new_v = [torch.randn(n, 2, 32, generator=gen) for n in s_new]
    lens = t["cache_seqlens"].clone()
    k_want, v_want = _append_expected(t["k_cache"], t["v_cache"], t["page_table"], lens, new_k,
                                      new_v)
    if packed:
        extra = dict(k=torch.cat(new_k), v=torch.cat(new_v),
                     cu_seqlens_k_new=torch.tensor([0, 2, 3, 3], dtype=I32))
    else:
        extra = dict(k=torch.stack(new_k), v=torch.stack(new_v))
    out, lse = _call(t, causal=True, **extra)
    for got, want in ((t["k_cache"], k_want), (t["v_cache"], v_want)):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))   # only the new slots
    total = dict(t, cache_seqlens=lens + torch.tensor(s_new, dtype=I32))
    want_out, want_lse = _oracle(total, causal=True)
    assert_matches_oracle(out, want_out, torch.float32, lse, want_lse)
    assert torch.equal(t["cache_seqlens"], lens)      # the caller's lengths are not advanced


def test_append_into_a_dense_cache_with_cache_batch_idx():
    gen = torch.Generator().manual_seed(13)
    k_cache, v_cache = torch.randn(4, 10, 2, 32, generator=gen), torch.randn(4, 10, 2, 32,
                                                                               generator=gen)
    rows, lens = torch.tensor([3, 1], dtype=I32), torch.tensor([4, 8], dtype=I32)
    k, v = torch.randn(2, 2, 2, 32, generator=gen), torch.randn(2, 2, 2, 32, generator=gen)
    q = torch.randn(2, 1, 4, 32, generator=gen)
    before = k_cache.clone()
    out = xpu_ops.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                          cache_batch_idx=rows)
    want_k = before.clone()
    want_k[3, 4:6], want_k[1, 8:10] = k[0], k[1]
    assert torch.equal(k_cache, want_k)
    want, _ = oracle.flash_attn_with_kvcache(
        q.flatten(0, 1), k_cache, v_cache, lens + 2, rows.view(2, 1),
        torch.tensor([0, 1, 2], dtype=I32), None, None, None, None, None, None, max_seqlen_q=1,
        softmax_scale=32 ** -0.5, causal=False, window_size_left=-1, window_size_right=-1,
        softcap=0.0)
    assert_matches_oracle(out.flatten(0, 1), want, torch.float32)


def test_append_past_the_capacity_is_skipped():
    """A new token whose position has no page-table entry is never written anywhere."""
    t = _paged(14, q_lens=(1,), k_lens=(8,), page_size=4)
    t["page_table"] = t["page_table"][:, :2]                   # 2 pages: capacity 8 tokens
    before = [t["k_cache"].clone(), t["v_cache"].clone()]
    _call(t, causal=True, k=torch.randn(1, 1, 2, 32), v=torch.randn(1, 1, 2, 32))
    for got, want in zip((t["k_cache"], t["v_cache"]), before):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def test_append_with_padding_past_cu_seqlens_k_new_stores_only_the_owned_rows():
    """Packed new keys with trailing padding (``cu_seqlens_k_new[-1] < k.shape[0]``, as fixed
    graph buffers have): the padding rows are never stored; the result is the unpadded call's
    (it raised a bare RuntimeError from repeat_interleave)."""
    t = _paged(21, q_lens=(2, 1), k_lens=(3, 6), page_size=4, room=2)
    gen = torch.Generator().manual_seed(22)
    new_k = [torch.randn(n, 2, 32, generator=gen) for n in (2, 1)]
    new_v = [torch.randn(n, 2, 32, generator=gen) for n in (2, 1)]
    lens = t["cache_seqlens"].clone()
    k_want, v_want = _append_expected(t["k_cache"], t["v_cache"], t["page_table"], lens, new_k,
                                      new_v)
    pad = torch.randn(3, 2, 32, generator=gen)
    out, lse = _call(t, causal=True, k=torch.cat([*new_k, pad]), v=torch.cat([*new_v, pad]),
                     cu_seqlens_k_new=torch.tensor([0, 2, 3], dtype=I32))
    for got, want in ((t["k_cache"], k_want), (t["v_cache"], v_want)):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    want_out, want_lse = _oracle(dict(t, cache_seqlens=lens + torch.tensor([2, 1], dtype=I32)),
                                 causal=True)
    assert_matches_oracle(out, want_out, torch.float32, lse, want_lse)


def test_append_with_a_negative_cache_seqlens_writes_no_other_slot():
    """Checks off: a negative length before the append stores nothing for that request (its
    position -1 used to index the page table's last, unused entry: another request's page)."""
    t = _paged(23, q_lens=(1, 1), k_lens=(2, 6), page_size=4, room=1)
    shared = t["page_table"][1, 0].item()
    t["page_table"] = torch.cat([t["page_table"][:, :2],
                                 torch.tensor([[shared], [shared]], dtype=I32)], dim=1)
    t["cache_seqlens"] = torch.tensor([-1, 6], dtype=I32)
    gen = torch.Generator().manual_seed(24)
    k, v = torch.randn(2, 1, 2, 32, generator=gen), torch.randn(2, 1, 2, 32, generator=gen)
    k_want, v_want = _append_expected(t["k_cache"], t["v_cache"], t["page_table"],
                                      torch.tensor([0, 6], dtype=I32), [k[0, :0], k[1]],
                                      [v[0, :0], v[1]])
    _call(t, causal=True, k=k, v=v)
    for got, want in ((t["k_cache"], k_want), (t["v_cache"], v_want)):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def test_paged_cache_batch_idx_out_of_range_reads_no_keys_and_debug_names_it():
    """Checks off: a ``cache_batch_idx`` past the page table's rows reads no keys (output 0,
    LSE -inf) and leaves the other requests' results alone (it raised IndexError from
    index_select); with debug checks it is a ValueError naming cache_batch_idx."""
    t = _paged(25, q_lens=(1, 2), k_lens=(5, 7))
    idx = torch.tensor([1, 9], dtype=I32)
    picked = dict(t, cache_seqlens=t["cache_seqlens"][[1, 1]])
    out, lse = _call(picked, cache_batch_idx=idx, causal=True)
    one = dict(t, q=t["q"][:1], page_table=t["page_table"][1:2],
               cache_seqlens=t["cache_seqlens"][1:2], cu_seqlens_q=torch.tensor([0, 1], dtype=I32))
    want, want_lse = _oracle(one, causal=True)
    assert_matches_oracle(out[:1], want, torch.float32, lse[:, :1], want_lse)
    assert torch.equal(out[1:], torch.zeros_like(out[1:])) and torch.isneginf(lse[:, 1:]).all()
    with xpu_ops.debug_checks(), pytest.raises(
            ValueError, match=r"cache_batch_idx has a row out of range; expected 0 <= "
                              r"cache_batch_idx < 2 \(page_table.shape\[0\]\), got "
                              r"cache_batch_idx\[1\] = 9"):
        _call(picked, cache_batch_idx=idx, causal=True)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("causal, rotary_seqlens", [(True, None), (False, None), (True, (1, 6))])
def test_rotary_on_appended_keys_and_queries(interleaved, causal, rotary_seqlens):
    """FA3: new key j rotated at base + j; queries at base + i when causal or local, else all at
    base (base = rotary_seqlens or cache_seqlens); rotary_dim 16 of D 32."""
    t = _paged(15, q_lens=(3, 2), k_lens=(4, 6), page_size=4, room=3)
    gen = torch.Generator().manual_seed(16)
    k, v = torch.randn(2, 3, 2, 32, generator=gen), torch.randn(2, 3, 2, 32, generator=gen)
    angle = torch.rand(16, 8, generator=gen) * 6.283
    cos, sin = angle.cos(), angle.sin()
    lens = t["cache_seqlens"].clone()
    base = lens if rotary_seqlens is None else torch.tensor(rotary_seqlens, dtype=I32)
    q_before = t["q"].clone()
    kw = dict(k=k, v=v, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
              rotary_seqlens=None if rotary_seqlens is None else base)
    out, lse = _call(t, causal=causal, **kw)
    assert torch.equal(t["q"], q_before)                 # the caller's q is not rotated in place
    k_rot = [oracle.apply_rotary_emb(k[r], cos, sin, base[r] + torch.arange(3),
                                     interleaved=interleaved) for r in range(2)]
    q_pos = torch.cat([base[r] + (torch.arange(n) if causal else torch.zeros(n, dtype=torch.long))
                       for r, n in enumerate((3, 2))])
    q_rot = oracle.apply_rotary_emb(q_before, cos, sin, q_pos, interleaved=interleaved)
    for r in range(2):
        for j in range(3):
            p = int(lens[r]) + j
            slot = t["k_cache"][int(t["page_table"][r, p // 4]), p % 4]
            torch.testing.assert_close(slot.double(), k_rot[r][j], rtol=1e-6, atol=1e-6)
    total = dict(t, q=q_rot.float(), cache_seqlens=lens + 3)
    want, want_lse = _oracle(total, causal=causal)
    assert_matches_oracle(out, want, torch.float32, lse, want_lse)


def test_rotary_positions_past_the_tables_take_the_last_row_and_debug_names_them():
    """API.md: with value checks off, a position past ``rotary_cos``/``rotary_sin`` is clamped to
    the tables' last row (a 4-row table acts as one whose later rows repeat row 3); under
    ``debug_checks()`` it is a ValueError naming cache_seqlens (positions 4..8 here)."""
    gen = torch.Generator().manual_seed(18)
    angle = torch.rand(4, 8, generator=gen) * 6.283
    k, v = torch.randn(2, 3, 2, 32, generator=gen), torch.randn(2, 3, 2, 32, generator=gen)
    results = []
    for rows in (angle, torch.cat([angle, angle[-1:].expand(12, 8)])):   # 4 rows, 16 rows
        t = _paged(19, q_lens=(3, 2), k_lens=(4, 6), page_size=4, room=3)
        out, lse = _call(t, causal=True, k=k, v=v, rotary_cos=rows.cos(), rotary_sin=rows.sin())
        assert not out.isnan().any()
        results.append((out, lse, t["k_cache"]))
    for short, full in zip(*results):
        assert torch.equal(short.nan_to_num(7.0), full.nan_to_num(7.0))
    t = _paged(19, q_lens=(3, 2), k_lens=(4, 6), page_size=4, room=3)
    with xpu_ops.debug_checks(), pytest.raises(
            ValueError, match=r"cache_seqlens reaches past the rotary tables; expected positions "
                              r"in \[0, rotary_cos.shape\[0\] = 4\), got position 4"):
        _call(t, causal=True, k=k, v=v, rotary_cos=angle.cos(), rotary_sin=angle.sin())


def test_rotary_op_matches_oracle_and_leaves_the_tail():
    gen = torch.Generator().manual_seed(17)
    x = torch.randn(6, 2, 24, generator=gen)
    angle = torch.rand(10, 4, generator=gen)
    pos = torch.tensor([0, 9, 3, 3, 5, 1], dtype=I32)
    for interleaved in (False, True):
        y = apply_rotary_emb(x, angle.cos(), angle.sin(), pos, interleaved=interleaved)
        want = oracle.apply_rotary_emb(x, angle.cos(), angle.sin(), pos, interleaved=interleaved)
        torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
        assert torch.equal(y[..., 8:], x[..., 8:])


# ----------------------------------------------------------------------------------------------
# Checks (one per new branch) and fake tensors
# ----------------------------------------------------------------------------------------------

def _bad_calls(t):
    n = t["cache_seqlens"].shape[0]
    total_q = t["q"].shape[0]
    k4 = torch.randn(n, 1, 2, 32)                       # one new token per request
    cu_new = torch.arange(n + 1, dtype=I32)
    cos, wide = torch.rand(8, 4), torch.rand(8, 17)
    return {
        "cache_leftpad int64": (dict(cache_leftpad=torch.zeros(n, dtype=torch.int64)),
                                ValueError, "cache_leftpad has dtype torch.int64"),
        "cache_leftpad size": (dict(cache_leftpad=torch.zeros(n + 1, dtype=I32)), ValueError,
                               r"cache_leftpad has the wrong size in dimension 0; expected "
                               r"cache_seqlens.shape\[0\] \(b\)"),
        "block ids size": (dict(bidirectional_block_ids=torch.zeros(total_q - 1, dtype=I32)),
                           ValueError, r"bidirectional_block_ids has the wrong size in "
                           r"dimension 0; expected q.shape\[0\] \(total_q\)"),
        "block ids float": (dict(bidirectional_block_ids=torch.zeros(total_q)), ValueError,
                            "bidirectional_block_ids has dtype torch.float32"),
        "block ids list": (dict(bidirectional_block_ids=[0] * total_q), TypeError,
                           "bidirectional_block_ids is not a tensor"),
        "cache_batch_idx int64": (dict(cache_batch_idx=torch.zeros(n, dtype=torch.int64)),
                                  ValueError, "cache_batch_idx has dtype torch.int64"),
        "pack_gqa int": (dict(pack_gqa=1), TypeError, "pack_gqa is not a bool"),
        "sm_margin negative": (dict(sm_margin=-2), ValueError, "sm_margin is negative"),
        "max_seqlen_k float": (dict(max_seqlen_k=3.0), TypeError, "max_seqlen_k is not an "
                               "integer"),
        "scheduler_metadata list": (dict(scheduler_metadata=[1]), TypeError,
                                    "scheduler_metadata is not a tensor"),
        "window tensor of 3": (dict(window_size=torch.tensor([1, 2, 3])), TypeError,
                               "window_size is not a pair"),
        "k without v": (dict(k=k4), ValueError, "v is missing; expected k and v together"),
        "v without k": (dict(v=k4), ValueError, "k is missing; expected k and v together"),
        "k dtype": (dict(k=k4.half(), v=k4.half()), ValueError, "k has dtype torch.float16"),
        "k batch": (dict(k=k4[:1].expand(n + 1, 1, 2, 32), v=k4[:1].expand(n + 1, 1, 2, 32)),
                    ValueError, r"k has the wrong size in dimension 0; expected "
                    r"cache_seqlens.shape\[0\] \(b\)"),
        "k heads": (dict(k=k4[:, :, :1], v=k4[:, :, :1]), ValueError,
                    r"k has the wrong size in dimension -2; expected k_cache.shape\[2\]"),
        "v head dim": (dict(k=k4, v=k4[..., :16]), ValueError,
                       r"v has the wrong size in dimension -1; expected v_cache.shape\[3\]"),
        "cu_seqlens_k_new with 4-D k": (dict(k=k4, v=k4, cu_seqlens_k_new=cu_new), ValueError,
                                        "cu_seqlens_k_new is given with a 4-D k"),
        "packed k without cu_seqlens_k_new": (dict(k=k4[0], v=k4[0]), ValueError,
                                              "cu_seqlens_k_new is missing for a packed 3-D k"),
        "cu_seqlens_k_new without k": (dict(cu_seqlens_k_new=cu_new), ValueError,
                                       "cu_seqlens_k_new is given without k/v"),
        "rotary without k": (dict(rotary_cos=cos, rotary_sin=cos), ValueError,
                             "rotary_cos is given without k/v"),
        "rotary_sin missing": (dict(k=k4, v=k4, rotary_cos=cos), ValueError,
                               "rotary_sin is missing; expected rotary_cos and rotary_sin"),
        "rotary too wide": (dict(k=k4, v=k4, rotary_cos=wide, rotary_sin=wide), ValueError,
                            "rotary_cos has more columns than half the head dim"),
        "rotary_sin shape": (dict(k=k4, v=k4, rotary_cos=cos, rotary_sin=cos[:3]), ValueError,
                             r"rotary_sin has the wrong size in dimension 0; expected "
                             r"rotary_cos.shape\[0\]"),
        "rotary_seqlens size": (dict(k=k4, v=k4, rotary_cos=cos, rotary_sin=cos,
                                     rotary_seqlens=torch.zeros(n + 2, dtype=I32)), ValueError,
                                "rotary_seqlens has the wrong size in dimension 0"),
        "rotary_interleaved int": (dict(rotary_interleaved=1), TypeError,
                                   "rotary_interleaved is not a bool"),
    }


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("name", sorted(_bad_calls(_paged(0, (2,), (5,)))))
def test_new_checks_name_the_argument(name, fake):
    t = _paged(0, (2,), (5,))
    change, exc, match = _bad_calls(t)[name]
    kwargs = dict(t, **change)
    if fake:
        mode = FakeTensorMode()
        kwargs = {k: fake_like(mode, v) if isinstance(v, torch.Tensor) else v
                  for k, v in kwargs.items()}
        with mode, pytest.raises(exc, match=f"^flash_attn_with_kvcache: {match}"):
            xpu_ops.flash_attn_with_kvcache(**kwargs)
    else:
        with pytest.raises(exc, match=f"^flash_attn_with_kvcache: {match}"):
            xpu_ops.flash_attn_with_kvcache(**kwargs)


def test_append_into_an_fp8_cache_is_not_implemented():
    t = _paged(0, (1,), (5,), room=1)
    t["k_cache"], t["v_cache"] = (c.to(torch.float8_e4m3fn) for c in (t["k_cache"], t["v_cache"]))
    k = torch.randn(1, 1, 2, 32).to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="^flash_attn_with_kvcache: appending k/v into "
                                                  "an fp8 cache is not implemented"):
        xpu_ops.flash_attn_with_kvcache(**t, k=k, v=k, k_descale=torch.ones(1, 2),
                                        v_descale=torch.ones(1, 2))


@pytest.mark.parametrize("change, match", [
    (dict(x=torch.zeros(3, 32)), "x has the wrong number of dimensions"),
    (dict(sin=torch.zeros(5, 4)), r"sin has the wrong size in dimension 0; expected cos.shape"),
    (dict(cos=torch.zeros(8, 17), sin=torch.zeros(8, 17)),
     "cos has more columns than half the head dim"),
    (dict(positions=torch.zeros(2, dtype=I32)), r"positions has the wrong size in dimension 0"),
    (dict(positions=torch.zeros(3)), "positions has dtype torch.float32"),
])
def test_rotary_op_checks(change, match):
    kwargs = dict(x=torch.zeros(3, 2, 32), cos=torch.zeros(8, 4), sin=torch.zeros(8, 4),
                  positions=torch.zeros(3, dtype=I32), **{})
    kwargs.update(change)
    with pytest.raises(ValueError, match=f"^apply_rotary_emb: {match}"):
        apply_rotary_emb(**kwargs)


def test_varlen_seqused_q_check():
    q, k = torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    cu = torch.tensor([0, 2, 4], dtype=I32)
    with pytest.raises(ValueError, match=r"^flash_attn_varlen_func: seqused_q has the wrong size "
                                         r"in dimension 0; expected cu_seqlens_q.shape\[0\] - 1"):
        xpu_ops.flash_attn_varlen_func(q, k, k, cu, cu, seqused_q=torch.zeros(3, dtype=I32))


def test_fake_trace_with_the_new_arguments_keeps_symbolic_sizes():
    t = _paged(10, q_lens=(3, 2), k_lens=(6, 9))
    mode = FakeTensorMode(shape_env=ShapeEnv())
    extra = dict(cache_leftpad=torch.tensor([1, 0], dtype=I32),
                 bidirectional_block_ids=torch.tensor([0, 0, -1, 1, 1], dtype=I32),
                 cache_batch_idx=torch.tensor([1, 0], dtype=I32))
    dynamic = dict(q=(0,), bidirectional_block_ids=(0,), cache_seqlens=(0,), cache_leftpad=(0,),
                   cache_batch_idx=(0,), page_table=(0, 1), cu_seqlens_q=(0,))
    f = {k: fake_like(mode, v, dynamic.get(k, ())) if isinstance(v, torch.Tensor) else v
         for k, v in dict(t, **extra).items()}
    with mode:
        out, lse = xpu_ops.flash_attn_with_kvcache(**f, causal=True, num_splits=1,
                                                   return_softmax_lse=True)
    total_q = f["q"].shape[0]
    assert isinstance(out.shape[0], torch.SymInt) and str(out.shape[0]) == str(total_q)
    assert str(lse.shape[1]) == str(total_q) and lse.dtype == torch.float32


def test_append_with_rotary_traces_fullgraph():
    """The composed append (rotary, store, attention ops) compiles with fullgraph=True, writes
    the caller's caches and gives the eager result."""
    def run(t, k, v, cos, sin):
        return xpu_ops.flash_attn_with_kvcache(**t, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
                                               causal=True)
    gen = torch.Generator().manual_seed(18)
    k, v = torch.randn(2, 2, 2, 32, generator=gen), torch.randn(2, 2, 2, 32, generator=gen)
    angle = torch.rand(12, 8, generator=gen)
    eager_t = _paged(19, q_lens=(2, 2), k_lens=(3, 5), room=2)
    compiled_t = {name: x.clone() if isinstance(x, torch.Tensor) else x
                  for name, x in eager_t.items()}
    want = run(eager_t, k, v, angle.cos(), angle.sin())
    torch._dynamo.reset()
    got = torch.compile(run, fullgraph=True, backend="aot_eager")(compiled_t, k, v, angle.cos(),
                                                                  angle.sin())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(compiled_t[name].nan_to_num(7.0), eager_t[name].nan_to_num(7.0))


def test_debug_value_checks_of_the_new_arguments():
    """With ``xpu_ops.debug_checks()``: leftpad past the keys, seqused_q past the rows, an append
    past the cache's capacity (nothing written) and rotary positions past the tables raise."""
    t = _paged(20, q_lens=(1,), k_lens=(8,), page_size=4)
    t["page_table"] = t["page_table"][:, :2]                   # capacity 8 tokens
    one = torch.randn(1, 1, 2, 32)
    with xpu_ops.debug_checks():
        with pytest.raises(ValueError, match=r"^flash_attn_with_kvcache: cache_leftpad is out of "
                                             r"range; .* got cache_leftpad\[0\] = 9"):
            _call(t, cache_leftpad=torch.tensor([9], dtype=I32))
        before = t["k_cache"].clone()
        with pytest.raises(ValueError, match="^flash_attn_with_kvcache: cache_seqlens"):
            _call(t, k=one, v=one)
        assert torch.equal(t["k_cache"].nan_to_num(7.0), before.nan_to_num(7.0))
        t2 = _paged(21, q_lens=(1,), k_lens=(8,), page_size=4, room=1)
        angle = torch.rand(8, 4)
        with pytest.raises(ValueError, match=r"^flash_attn_with_kvcache: cache_seqlens reaches "
                                             r"past the rotary tables; .* got position 8"):
            _call(t2, k=one, v=one, rotary_cos=angle.cos(), rotary_sin=angle.sin())
        q, k = torch.randn(4, 2, 16), torch.randn(4, 2, 16)
        cu = torch.tensor([0, 2, 4], dtype=I32)
        with pytest.raises(ValueError, match=r"^flash_attn_varlen_func: seqused_q is out of "
                                             r"range; .* got seqused_q\[1\] = 3"):
            xpu_ops.flash_attn_varlen_func(q, k, k, cu, cu,
                                           seqused_q=torch.tensor([2, 3], dtype=I32))


def test_fake_trace_of_an_append_with_rotary_and_of_seqused_q():
    """Symbolic token counts through the composed append (rotary, store, attention) and through
    varlen with seqused_q: outputs keep the symbols, nothing reads tensor values."""
    t = _paged(22, q_lens=(2, 3), k_lens=(4, 6), room=3)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    extra = dict(k=torch.randn(5, 2, 32), v=torch.randn(5, 2, 32),
                 cu_seqlens_k_new=torch.tensor([0, 2, 5], dtype=I32),
                 rotary_cos=torch.rand(16, 8), rotary_sin=torch.rand(16, 8))
    dynamic = dict(q=(0,), k=(0,), v=(0,), cu_seqlens_q=(0,), cu_seqlens_k_new=(0,),
                   cache_seqlens=(0,), page_table=(0, 1), rotary_cos=(0,), rotary_sin=(0,))
    f = {k: fake_like(mode, v, dynamic.get(k, ())) if isinstance(v, torch.Tensor) else v
         for k, v in dict(t, **extra).items()}
    with mode:
        out = xpu_ops.flash_attn_with_kvcache(**f, causal=True)
        q = fake_like(mode, torch.randn(7, 4, 32), (0,))
        k = fake_like(mode, torch.randn(9, 2, 32), (0,))
        cu_q, cu_k = (fake_like(mode, torch.zeros(3, dtype=I32)) for _ in range(2))
        used = fake_like(mode, torch.zeros(2, dtype=I32))
        varlen = xpu_ops.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 4, 5, seqused_q=used,
                                                causal=True)
    assert str(out.shape[0]) == str(f["q"].shape[0]) and out.shape[1:] == (4, 32)
    assert str(varlen.shape[0]) == str(q.shape[0])


def test_build_bidirectional_block_ids():
    """sgl-kernel-xpu's builder contract (Gemma-3 imports it from sgl_kernel.flash_attn): one id
    per span over the batch, -1 elsewhere, None without spans; bad spans raise."""
    from xpu_ops.compat import SGL_KERNEL_FLASH_ATTN_NAMES
    assert "build_bidirectional_block_ids" in SGL_KERNEL_FLASH_ATTN_NAMES
    build = xpu_ops.build_bidirectional_block_ids
    assert build([5], [[(1, 2)]]).tolist() == [-1, 0, 0, -1, -1]
    ids = build([4, 3, 2], [[(0, 1), (3, 3)], [], [(0, 1)]])
    assert ids.dtype == I32 and ids.tolist() == [0, 0, -1, 1, -1, -1, -1, 2, 2]
    assert build([4, 4], [[], []]) is None
    for seq_lens, spans, match in (([4], [[], []], "block_spans has a different length"),
                                   ([4], [[(2, 5)]], "block_spans has a span outside sequence 0"),
                                   ([4], [[(3, 1)]], "block_spans has a span outside sequence 0")):
        with pytest.raises(ValueError, match=f"^build_bidirectional_block_ids: {match}"):
            build(seq_lens, spans)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_cache_batch_idx_of_another_batch_names_itself(paged):
    """A ``cache_batch_idx`` whose length is not the batch's was reported as a page_table of the
    wrong size (a tensor the caller may not have passed)."""
    t = _paged(27, q_lens=(1, 1), k_lens=(3, 4))
    call = dict(t) if paged else dict(t, page_table=None, k_cache=torch.randn(4, 8, 2, 32),
                                      v_cache=torch.randn(4, 8, 2, 32))
    with pytest.raises(ValueError, match=r"^flash_attn_with_kvcache: cache_batch_idx has one "
                                         r"row per request of another batch; expected \[b\] "
                                         r"with b = cache_seqlens.shape\[0\] = 2, got shape "
                                         r"\(3,\)"):
        _call(call, cache_batch_idx=torch.tensor([0, 1, 2], dtype=I32), causal=True)
