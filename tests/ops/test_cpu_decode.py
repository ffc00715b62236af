"""The reference provider's CPU decode path (``xpu_ops/reference/cpu_decode.py``) against the
float64 oracle: NaN garbage past ``cache_seqlens`` and in spare pages, out-of-range page ids,
empty caches, GQA ratios, page sizes 1 and > 1, odd head dims, windows, softcap and sinks."""

from __future__ import annotations

import pytest
import torch

import xpu_ops
import xpu_ops.testing as xt
from xpu_ops.reference import cpu_decode

from . import oracle
from .utils import assert_matches_oracle

I32 = torch.int32
# (k_lens, page_size, Hq, Hkv, D, Dv): page 1 and > 1, GQA 1/3/4, MQA, odd dims, empty caches
CASES = [([5, 17, 0], 4, 8, 2, 16, 16), ([1, 33], 1, 6, 2, 8, 8), ([40, 7, 12, 1], 16, 4, 1, 80, 80),
         ([9], 3, 3, 3, 24, 40), ([0, 0], 8, 4, 2, 16, 16)]
# (window_left, softcap, sinks)
MASKS = [(-1, 0.0, False), (3, 0.0, False), (-1, 2.5, True), (0, 0.0, True)]


def _decode_call(case, mask, dtype, seed):
    """Op arguments (``oracle.flash_attn_with_kvcache`` order) of one decode step, ``out``
    poisoned with NaN."""
    k_lens, page, hq, hkv, d, dv = case
    window_left, softcap, sinks = mask
    gen = torch.Generator().manual_seed(seed)
    (k, v), table, lens = xt.paged_kv_cache(gen, k_lens, page, [(hkv, d), (hkv, dv)],
                                            dtype=dtype, device="cpu")
    b = len(k_lens)
    q = torch.randn(b, hq, d, generator=gen).to(dtype)
    sink = torch.randn(hq, generator=gen) if sinks else None
    out = torch.full((b, hq, dv), float("nan"), dtype=dtype)
    cu = torch.arange(b + 1, dtype=I32)
    args = [q, k, v, lens, table, cu, out, None, None, None, None, sink, None, None]
    kwargs = dict(max_seqlen_q=1, softmax_scale=d ** -0.5, causal=True,
                  window_size_left=window_left, window_size_right=0, softcap=softcap,
                  num_splits=0, return_softmax_lse=True)
    return args, kwargs


@pytest.mark.parametrize("return_lse", [True, False], ids=["lse", "no-lse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", MASKS, ids=["causal", "window3", "softcap-sinks", "window0-sinks"])
@pytest.mark.parametrize("case", CASES, ids=["gqa4-ps4", "ps1", "mqa-d80", "mha-odd", "empty"])
def test_decode_path_matches_oracle(case, mask, dtype, return_lse):
    """Without the LSE (``[Hq, 0]`` returned), calls without sinks or softcap whose requests
    all have keys run torch SDPA; the others, and every call with the LSE, the explicit path."""
    args, kwargs = _decode_call(case, mask, dtype, seed=len(case[0]) + mask[0])
    kwargs["return_softmax_lse"] = return_lse
    assert cpu_decode.applies(args[0], args[1], args[4], args[5], 1, *args[7:11], *args[12:])
    with xpu_ops.use_provider("reference"):
        lse = torch.ops.xpu_ops.flash_attn_with_kvcache(*args, **kwargs)
    want, want_lse = oracle.flash_attn_with_kvcache(*args, **kwargs)
    assert_matches_oracle(args[6], want, dtype, lse, want_lse)


def test_decode_path_equals_the_general_reference_path(monkeypatch):
    """The fast path and the general path agree (both are the reference's semantics)."""
    args, kwargs = _decode_call(CASES[2], MASKS[2], torch.float32, seed=5)
    with xpu_ops.use_provider("reference"):
        lse = torch.ops.xpu_ops.flash_attn_with_kvcache(*args, **kwargs)
        fast = args[6].clone()
        monkeypatch.setattr(cpu_decode, "applies", lambda *a: False)
        args[6].fill_(float("nan"))
        general_lse = torch.ops.xpu_ops.flash_attn_with_kvcache(*args, **kwargs)
    torch.testing.assert_close(fast, args[6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, general_lse, atol=1e-5, rtol=1e-5)


def _applies(**changes) -> bool:
    args, kwargs = _decode_call(CASES[0], MASKS[0], torch.float32, seed=0)
    names = ["q", "k_cache", "v_cache", "cache_seqlens", "page_table", "cu_seqlens_q", "out",
             "qv", "q_descale", "k_descale", "v_descale", "sinks", "cache_leftpad",
             "bidirectional_block_ids"]
    values = {**dict(zip(names, args)), "max_seqlen_q": 1, **changes}
    return cpu_decode.applies(values["q"], values["k_cache"], values["page_table"],
                              values["cu_seqlens_q"], values["max_seqlen_q"], values["qv"],
                              values["q_descale"], values["k_descale"], values["v_descale"],
                              values["cache_leftpad"], values["bidirectional_block_ids"])


def test_only_plain_cpu_decode_calls_take_the_path():
    assert _applies()
    assert not _applies(max_seqlen_q=2)                                       # extend
    assert not _applies(cu_seqlens_q=torch.tensor([0, 1, 1, 3], dtype=I32))  # rows elsewhere
    assert not _applies(cache_leftpad=torch.zeros(3, dtype=I32))
    assert not _applies(k_descale=torch.ones(3, 2))
    assert not _applies(k_cache=torch.zeros(2, 4, 2, 16, dtype=torch.float8_e4m3fn))
    assert not _applies(q=torch.zeros(3, 8, 16, device="meta"))
    assert not _applies(page_table=torch.zeros(3, 0, dtype=I32))              # no key slot


@pytest.mark.parametrize("return_lse", [True, False])
def test_a_page_table_without_columns_gives_empty_rows(return_lse):
    """Decode requests with a ``[b, 0]`` page table (no key slot at all) get output 0 and LSE
    -inf; the decode path's reductions over zero keys raised IndexError."""
    q, kc = torch.randn(2, 4, 8), torch.randn(3, 4, 2, 8)
    out = torch.full((2, 4, 8), float("nan"))
    with xpu_ops.use_provider("reference"):
        lse = torch.ops.xpu_ops.flash_attn_with_kvcache(
            q, kc, kc, torch.zeros(2, dtype=I32), torch.zeros(2, 0, dtype=I32),
            torch.arange(3, dtype=I32), out, None, None, None, None, None, None, None, 1, 0.25,
            True, -1, 0, 0.0, 0, return_lse)
    assert torch.equal(out, torch.zeros_like(out))
    assert lse.shape == ((4, 2) if return_lse else (4, 0)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("paged", [False, True])
def test_cpu_store_writes_in_range_slots_only(paged):
    """The reference store's CPU path: in-range slots get the new rows, out-of-range ones are
    skipped, nothing else changes (expected values written one slot at a time here)."""
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(12, 2, 8, generator=gen)
    v_cache = torch.randn(12, 2, 8, generator=gen)
    loc = torch.tensor([7, -1, 0, 12, 11])
    k, v = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(loc.tolist()):
        if 0 <= slot < 12:
            want_k[slot], want_v[slot] = k[i], v[i]
    caches = (k_cache.view(6, 2, 2, 8), v_cache.view(6, 2, 2, 8)) if paged else (k_cache, v_cache)
    with xpu_ops.use_provider("reference"):
        xpu_ops.store_kv_cache(*caches, loc, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_a_batch_of_no_request_returns_empty_results():
    """b = 0 with a 4-D q ``[0, 1, Hq, D]`` (a decode step of no request) gives empty results;
    the decode path's reshape of 0 elements raised a RuntimeError."""
    k_cache, v_cache = torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8)
    out, lse = xpu_ops.flash_attn_with_kvcache(
        torch.randn(0, 1, 4, 8), k_cache, v_cache, cache_seqlens=torch.zeros(0, dtype=I32),
        page_table=torch.zeros(0, 2, dtype=I32), return_softmax_lse=True)
    assert out.shape == (0, 1, 4, 8) and lse.shape == (0, 4, 1)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_strided_caches_and_out_of_range_page_ids_match_the_oracle(layout):
    """Both gathers (one ``index_select`` of a contiguous cache, an index by page and offset of
    any other) and both ways of handling hidden keys (read another key of the request, or
    zero what was read): an out-of-range page id inside the lengths hides its keys, a request
    whose every page is out of range gives 0 and LSE -inf, NaN between the pages never leaks."""
    args, kwargs = _decode_call(CASES[0], MASKS[0], torch.float32, seed=11)
    if layout == "strided":  # every other page of a buffer twice as long, NaN between them
        for i in (1, 2):
            buf = torch.full((2 * args[i].shape[0], *args[i].shape[1:]), float("nan"))
            buf[::2] = args[i]
            args[i] = buf[::2]
    assert args[1].is_contiguous() == (layout == "contiguous")
    # The oracle reads page ids in range only; hidden keys 0-3 of request 1 are its
    # cache_leftpad 4, and request 0 (no key visible) gives 0 and -inf.
    oracle_args = list(args)
    oracle_args[12] = torch.tensor([0, 4, 0], dtype=I32)
    want, want_lse = oracle.flash_attn_with_kvcache(*oracle_args, **kwargs)
    want[0], want_lse[:, 0] = 0.0, float("-inf")
    table = args[4].clone()
    table[0, :2] = args[1].shape[0] + 5   # request 0 (5 keys on pages 0, 1): nothing visible
    table[1, 0] = -1                      # request 1 (17 keys): keys 0-3 hidden
    args[4] = table
    assert cpu_decode.applies(args[0], args[1], args[4], args[5], 1, *args[7:11], *args[12:])
    with xpu_ops.use_provider("reference"):
        lse = torch.ops.xpu_ops.flash_attn_with_kvcache(*args, **kwargs)
    assert_matches_oracle(args[6], want, torch.float32, lse, want_lse)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=["ps1-gqa3", "mqa-d80"])
def test_calls_without_the_lse_run_sdpa_and_match_the_oracle(case, layout, monkeypatch):
    """The SDPA path serves a plain decode call without the LSE, on both gathers (one
    ``index_select`` of a contiguous cache; an index by page and offset of strided pages with
    NaN between them), NaN past ``cache_seqlens`` masked out."""
    args, kwargs = _decode_call(case, MASKS[1], torch.float32, seed=13)
    if layout == "strided":
        for i in (1, 2):
            buf = torch.full((2 * args[i].shape[0], *args[i].shape[1:]), float("nan"))
            buf[::2] = args[i]
            args[i] = buf[::2]
    calls = []
    sdpa = cpu_decode._sdpa
    monkeypatch.setattr(cpu_decode, "_sdpa", lambda *a: calls.append(1) or sdpa(*a))
    with xpu_ops.use_provider("reference"):
        lse = torch.ops.xpu_ops.flash_attn_with_kvcache(*args, **dict(kwargs,
                                                                     return_softmax_lse=False))
    want, _ = oracle.flash_attn_with_kvcache(*args, **kwargs)
    assert calls == [1] and lse.shape == (args[0].shape[1], 0)
    assert_matches_oracle(args[6], want, torch.float32)


def _sdpa_served(monkeypatch) -> list:
    """Record each ``_sdpa`` result (True: SDPA served the call)."""
    results, sdpa = [], cpu_decode._sdpa
    monkeypatch.setattr(cpu_decode, "_sdpa", lambda *a: results.append(sdpa(*a)) or results[-1])
    return results


@pytest.mark.parametrize("mask", [MASKS[0], MASKS[1]], ids=["causal", "window3"])
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]], ids=["ps1", "ps16-mqa", "mha-odd"])
def test_sdpa_ignores_garbage_page_ids_past_each_requests_last_page(case, mask, monkeypatch):
    """Page-table entries past a request's last page (random ids, some out of range) are never
    read: SDPA still serves the call (hidden keys read the request's last key), NaN past
    ``cache_seqlens`` never leaks, ``out`` (NaN-poisoned) matches the float64 oracle."""
    args, kwargs = _decode_call(case, mask, torch.float32, seed=21)
    kwargs["return_softmax_lse"] = False
    table, lens = args[4], args[3]
    garbage = ((table < 0) | (table >= args[1].shape[0])).any()
    assert garbage  # paged_kv_cache's spare column holds such ids (the case is meaningful)
    served = _sdpa_served(monkeypatch)
    with xpu_ops.use_provider("reference"):
        torch.ops.xpu_ops.flash_attn_with_kvcache(*args, **kwargs)
    want, _ = oracle.flash_attn_with_kvcache(*args, **kwargs)
    assert served == [True]
    assert_matches_oracle(args[6], want, torch.float32)


def test_sdpa_follows_values_rewritten_in_place(monkeypatch):
    """Consecutive calls on the same page-table and length buffers rewritten in place (as a
    graph runner or engine does between steps), and the same values over a cache of another
    page count, each read what their values say (nothing of an earlier call is reused)."""
    gen = torch.Generator().manual_seed(4)
    (k, v), table, lens = xt.paged_kv_cache(gen, [20, 9, 31], 4, [(2, 8), (2, 8)],
                                            dtype=torch.float32, device="cpu")
    q = torch.randn(3, 4, 8, generator=gen)
    served = _sdpa_served(monkeypatch)

    def check(k_cache, v_cache):
        out = torch.full((3, 4, 8), float("nan"))
        args = [q, k_cache, v_cache, lens, table, torch.arange(4, dtype=I32), out, None, None,
                None, None, None, None, None]
        kwargs = dict(max_seqlen_q=1, softmax_scale=0.3, causal=True, window_size_left=-1,
                      window_size_right=0, softcap=0.0, num_splits=0, return_softmax_lse=False)
        with xpu_ops.use_provider("reference"):
            torch.ops.xpu_ops.flash_attn_with_kvcache(*args, **kwargs)
        want, _ = oracle.flash_attn_with_kvcache(*args, **kwargs)
        assert_matches_oracle(out, want, torch.float32)

    check(k, v)
    check(k, v)
    lens.sub_(torch.tensor([3, 0, 12], dtype=I32))  # shorter: keys 17-19, 19-30 now hidden
    check(k, v)
    table[[0, 1]] = table[[1, 0]].clone()         # rows swapped: request 0 reads 1's pages
    lens[[0, 1]] = lens[[1, 0]].clone()
    check(k, v)
    extra = torch.full((4, 4, 2, 8), float("nan"))  # more pages, same values of table/lens
    check(torch.cat([k, extra]), torch.cat([v, extra]))
    assert served == [True] * 5


def test_sdpa_window_never_reads_keys_left_of_the_window(monkeypatch):
    """With a window, the keys left of it may hold anything (a sliding-window pool frees their
    pages): NaN there never reaches ``out``, whose hidden keys read the request's last key."""
    args, kwargs = _decode_call(CASES[2], MASKS[1], torch.float32, seed=8)
    kwargs["return_softmax_lse"] = False
    want, _ = oracle.flash_attn_with_kvcache(*args, **kwargs)  # before the poison (it reads it)
    k_cache, v_cache, lens, table = args[1], args[2], args[3], args[4]
    page = k_cache.shape[1]
    for r, n in enumerate(lens.tolist()):
        for j in range(max(0, n - 1 - 3)):                  # left of window_left = 3
            for cache in (k_cache, v_cache):
                cache[table[r, j // page], j % page] = float("nan")
    served = _sdpa_served(monkeypatch)
    with xpu_ops.use_provider("reference"):
        torch.ops.xpu_ops.flash_attn_with_kvcache(*args, **kwargs)
    assert served == [True]
    assert_matches_oracle(args[6], want, torch.float32)
