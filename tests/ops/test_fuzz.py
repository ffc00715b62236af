"""Hostile fuzzing, bounded for a 2-core CI (hypothesis, derandomized;
``XPU_OPS_HYPOTHESIS_EXAMPLES=500`` explores more, randomly).

- Valid inputs in odd layouts (each tensor argument drawn contiguous, strided or expanded)
  match the float64 oracle on both providers.
- Inconsistent metadata with value checks off (prefix sums past ``q``, int32 extremes in
  lengths, page ids and prefix sums, an understated or loose ``max_seqlen_q``, out-of-range
  ``loc`` slots; the append path in ``test_fuzz_append.py``): the process survives, nothing
  outside the given tensors changes (guard regions around ``out`` and the caches; ``softmax_lse``
  is returned whole), rows the metadata describes equal the oracle of API.md's "Writes" rule,
  the others keep their contents; with ``debug_checks()`` the same call raises ``ValueError``
  exactly when the metadata is inconsistent.
"""

from __future__ import annotations

import os

import pytest

from .triton_mode import provider_params, rerun_in_subprocess, running  # first

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import xpu_ops  # noqa: E402
from xpu_ops.testing import paged_kv_cache  # noqa: E402
from xpu_ops.testing_layouts import expanded_view, outside_view_unchanged, strided_view  # noqa: E402

from . import oracle  # noqa: E402
from .utils import assert_matches_oracle, bitwise_equal  # noqa: E402

_EXAMPLES = int(os.environ.get("XPU_OPS_HYPOTHESIS_EXAMPLES", "0"))


def _settings(examples: int):
    return settings(max_examples=_EXAMPLES or examples, deadline=None,
                    derandomize=not _EXAMPLES, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


PROVIDERS = provider_params()
I32 = torch.int32
E4M3 = torch.float8_e4m3fn
test_rerun_in_subprocess = rerun_in_subprocess(__file__)

requests = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 12)), min_size=1, max_size=3)
heads = st.sampled_from([(1, 1), (4, 1), (6, 2), (4, 4)])
windows = st.tuples(st.sampled_from([-1, 0, 3]), st.sampled_from([-1, 0, 2]))
layouts = st.sampled_from(["contiguous", "strided"])


def _lay(t, layout):
    """``t`` as drawn: itself, a strided view over garbage, or (``"heads"``) its first head
    broadcast over the heads dimension (stride 0; the caller compares with a dense copy)."""
    if t is None or layout == "contiguous":
        return t
    return t[:, :1].expand(t.shape) if layout == "heads" else strided_view(t)


def _cu(lens):
    return torch.tensor([0] + list(lens), dtype=I32).cumsum(0, dtype=I32)


# ---- valid inputs, odd layouts, against the oracle ------------------------------------------

@pytest.mark.parametrize("provider", PROVIDERS)
@_settings(12)
@given(reqs=requests, page_size=st.sampled_from([1, 3, 16]), hq_hkv=heads,
       d=st.sampled_from([16, 40]), causal=st.booleans(), window=windows,
       softcap=st.sampled_from([0.0, 2.5]), sinks=st.booleans(), fp8=st.booleans(),
       metadata=st.tuples(layouts, layouts, layouts),
       big=st.tuples(st.sampled_from(["contiguous", "strided", "heads"]), layouts, layouts),
       expand=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_valid_paged_inputs_in_odd_layouts_match_the_oracle(provider, reqs, page_size, hq_hkv, d,
                                                           causal, window, softcap, sinks, fp8,
                                                           metadata, big, expand, seed):
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = hq_hkv
    q_lens = [lq for lq, _ in reqs]
    (k_cache, v_cache), page_table, cache_seqlens = paged_kv_cache(
        gen, [lq + prefix for lq, prefix in reqs], page_size, [(hkv, d), (hkv, d)],
        dtype=E4M3 if fp8 else torch.float32, device="cpu")
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    descale = (torch.rand(len(reqs), hkv, generator=gen) + 0.5) if fp8 else None
    sink = torch.randn(hq, generator=gen) if sinks else None
    if expand:  # one per-tensor value broadcast, as sglang passes fp8 scales
        descale = None if descale is None else expanded_view(descale)
        sink = None if sink is None else expanded_view(sink)
    cu = _cu(q_lens)
    lay_lens, lay_table, lay_cu = metadata
    lay_q, lay_k, lay_v = big
    q_view = _lay(q, lay_q)
    q = q_view.contiguous()                         # the values the oracle sees
    with running(provider):
        out, lse = xpu_ops.flash_attn_with_kvcache(
            q_view, _lay(k_cache, lay_k), _lay(v_cache, lay_v),
            cache_seqlens=_lay(cache_seqlens, lay_lens), page_table=_lay(page_table, lay_table),
            cu_seqlens_q=_lay(cu, lay_cu), max_seqlen_q=max(q_lens), causal=causal,
            window_size=window, softcap=softcap, sinks=sink, k_descale=descale,
            v_descale=descale, return_softmax_lse=True)
    dense = None if descale is None else descale.contiguous()
    out64, lse64 = oracle.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens, page_table, cu, None, None, None, dense, dense,
        None if sink is None else sink.contiguous(), max_seqlen_q=max(q_lens),
        softmax_scale=d ** -0.5, causal=causal, window_size_left=window[0],
        window_size_right=window[1], softcap=softcap)
    assert_matches_oracle(out, out64, torch.float32, lse, lse64)


@pytest.mark.parametrize("provider", PROVIDERS)
@_settings(8)
@given(reqs=requests, hq_hkv=heads, causal=st.booleans(), seqused=st.booleans(),
       lay=st.tuples(layouts, layouts, layouts, layouts), seed=st.integers(0, 2 ** 16))
def test_valid_varlen_inputs_in_odd_layouts_match_the_oracle(provider, reqs, hq_hkv, causal,
                                                            seqused, lay, seed):
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = hq_hkv
    q_lens = [lq for lq, _ in reqs]
    k_lens = [lq + prefix for lq, prefix in reqs]
    q = torch.randn(sum(q_lens), hq, 16, generator=gen)
    k, v = (torch.randn(sum(k_lens), hkv, 16, generator=gen) for _ in range(2))
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    used = torch.tensor([max(n - 1, 0) for n in k_lens], dtype=I32) if seqused else None
    with running(provider):
        out, lse = xpu_ops.flash_attn_varlen_func(
            _lay(q, lay[0]), _lay(k, lay[1]), v, _lay(cu_q, lay[2]), _lay(cu_k, lay[3]),
            seqused_k=_lay(used, lay[3]), causal=causal, return_softmax_lse=True)
    out64, lse64 = oracle.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=causal,
                                                 softmax_scale=0.25, seqused_k=used)
    assert_matches_oracle(out, out64, torch.float32, lse, lse64)


# ---- inconsistent metadata with value checks off ------------------------------------------

GUARD = 2
corrupt_lengths = st.sampled_from([-(2 ** 31), -3, 0, 1, 5, 40, 2 ** 30, 2 ** 31 - 1])
corrupt_pages = st.sampled_from([-(2 ** 31), -1, 0, 1, 6, 7, 2 ** 31 - 1])


def _guarded(t):
    """``t`` inside a NaN buffer with GUARD rows on each side: ``(buffer, view)``."""
    buffer = torch.full((t.shape[0] + 2 * GUARD, *t.shape[1:]), float("nan"), dtype=t.dtype,
                        device=t.device)
    view = buffer[GUARD:GUARD + t.shape[0]]
    view.copy_(t)
    return buffer, view


def _paged_metadata_valid(cu, total_q, max_seqlen_q, lens, table, page_size, num_pages) -> bool:
    """API.md's conditions, checked value by value: what the debug checks must enforce."""
    cu, lens = cu.tolist(), lens.tolist()
    if cu[0] != 0 or cu[-1] != total_q or any(b < a for a, b in zip(cu, cu[1:])):
        return False
    if any(b - a > max_seqlen_q for a, b in zip(cu, cu[1:])):
        return False
    capacity = table.shape[1] * page_size
    for r, n in enumerate(lens):
        if not 0 <= n <= capacity:
            return False
        if any(not 0 <= int(p) < num_pages for p in table[r, :-(-n // page_size)].tolist()):
            return False
    return True


def _corrupted_paged_call(data, gen):
    """A valid small paged call, then some of its metadata overwritten by drawn values."""
    q_lens = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=3), label="q_lens")
    b, page_size, hq, hkv, d = len(q_lens), data.draw(st.sampled_from([1, 4])), 4, 2, 16
    k_lens = [lq + data.draw(st.integers(0, 6)) for lq in q_lens]
    num_pages = sum(-(-n // page_size) for n in k_lens) + 2
    cache = torch.randn(num_pages, page_size, hkv, d, generator=gen)   # finite everywhere
    perm = torch.randperm(num_pages, generator=gen).to(I32)
    width = max(-(-n // page_size) for n in k_lens) + 1
    table = perm[torch.arange(b * width) % num_pages].view(b, width).contiguous()
    cu, lens = _cu(q_lens), torch.tensor(k_lens, dtype=I32)
    max_seqlen_q = max(max(q_lens), 1)
    for _ in range(data.draw(st.integers(1, 3), label="corruptions")):
        what = data.draw(st.sampled_from(["cu", "lens", "page", "max_q"]))
        if what == "cu":
            cu[data.draw(st.integers(0, b))] = data.draw(
                st.sampled_from([-(2 ** 31), -5, -1, 1, 2, sum(q_lens) + 1, 50, 2 ** 30,
                                 2 ** 31 - 1]))
        elif what == "lens":
            lens[data.draw(st.integers(0, b - 1))] = data.draw(corrupt_lengths)
        elif what == "page":
            table[data.draw(st.integers(0, b - 1)), data.draw(st.integers(0, width - 1))] = \
                data.draw(corrupt_pages)
        else:  # understated, or loose up to the int32 limit (the tight bound's result)
            max_seqlen_q = data.draw(st.one_of(st.integers(1, max_seqlen_q),
                                               st.sampled_from([2 ** 31 - 1])))
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    return q, cache, torch.randn_like(cache), lens, table, cu, max_seqlen_q


@pytest.mark.parametrize("provider", PROVIDERS)
@_settings(20)
@given(data=st.data(), causal=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_inconsistent_paged_metadata_stays_inside_the_tensors(provider, data, causal, seed):
    _check_inconsistent_paged_call(provider, "cpu", data, causal, seed)


@pytest.mark.gpu
@_settings(60)
@given(data=st.data(), causal=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_inconsistent_paged_metadata_stays_inside_the_tensors_on_gpu(data, causal, seed):
    """Compiled Triton on the GPU: no illegal address, the same rows as the oracle."""
    _check_inconsistent_paged_call("triton", "cuda", data, causal, seed)
    torch.cuda.synchronize()


def _check_inconsistent_paged_call(provider, device, data, causal, seed):
    # The GPU runs compiled Triton: no interpreter switch there.
    using = (lambda: running(provider)) if device == "cpu" else (
        lambda: xpu_ops.use_provider(provider))
    gen = torch.Generator().manual_seed(seed)
    call_args = _corrupted_paged_call(data, gen)
    q, k_cache, v_cache, lens, table, cu, max_seqlen_q = call_args
    out_buffer, out = _guarded(torch.full((q.shape[0], q.shape[1], v_cache.shape[-1]),
                                          float("nan"), device=device))
    k_buffer, k_view = _guarded(k_cache.to(device))
    v_buffer, v_view = _guarded(v_cache.to(device))
    caches_before = (k_buffer.clone(), v_buffer.clone())
    call = dict(cache_seqlens=lens.to(device), page_table=table.to(device),
                cu_seqlens_q=cu.to(device), max_seqlen_q=max_seqlen_q, causal=causal,
                return_softmax_lse=True)
    with using(), xpu_ops.debug_checks(False):
        _, lse = xpu_ops.flash_attn_with_kvcache(q.to(device), k_view, v_view, out=out, **call)
    out, lse, out_buffer = out.cpu(), lse.cpu(), out_buffer.cpu()
    assert torch.isnan(out_buffer[:GUARD]).all() and torch.isnan(out_buffer[-GUARD:]).all()
    assert bitwise_equal(k_buffer, caches_before[0]) and bitwise_equal(v_buffer, caches_before[1])
    want, want_lse, owners = oracle.flash_attn_with_kvcache_unchecked(
        q, k_cache, v_cache, lens, table, cu, max_seqlen_q=max_seqlen_q,
        softmax_scale=q.shape[-1] ** -0.5, causal=causal, window_size_right=0 if causal else -1)
    owners = torch.tensor(owners, dtype=torch.long)
    once, unwritten = owners == 1, owners == 0
    assert torch.isnan(out[unwritten]).all(), "a row no request describes was written"
    assert torch.isfinite(out[owners > 1]).all()
    assert_matches_oracle(out[once], want[once], torch.float32, lse[:, once], want_lse[:, once])
    valid = _paged_metadata_valid(cu, q.shape[0], max_seqlen_q, lens, table, k_cache.shape[1],
                                  k_cache.shape[0])
    with using(), xpu_ops.debug_checks():
        if valid:
            xpu_ops.flash_attn_with_kvcache(q.to(device), k_view, v_view, **call)
        else:
            with pytest.raises(ValueError, match=r"^flash_attn_with_kvcache: (cu_seqlens_q|"
                               r"max_seqlen_q|cache_seqlens|page_table) .*, got .*\d"):
                xpu_ops.flash_attn_with_kvcache(q.to(device), k_view, v_view, **call)


@pytest.mark.parametrize("provider", PROVIDERS)
@_settings(10)
@given(n=st.integers(1, 6), wild=st.lists(st.sampled_from([-(2 ** 40), -1, 24, 25, 2 ** 40]),
                                           max_size=3),
       page_size=st.sampled_from([1, 4]), fp8=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_store_with_wild_slots_writes_only_in_range_slots(provider, n, wild, page_size, fp8,
                                                          seed):
    gen = torch.Generator().manual_seed(seed)
    slots, hkv, d = 24, 2, 8
    dtype = E4M3 if fp8 else torch.float32
    wide = torch.randn(slots // page_size, page_size, hkv, d + 3, generator=gen).to(dtype)
    k_cache = wide[..., 1:1 + d]                                   # pages not adjacent, padded
    v_cache = torch.randn(slots, hkv, d, generator=gen).to(dtype)
    good = torch.randperm(slots, generator=gen)[:n]
    loc = torch.cat([good, torch.tensor(wild, dtype=torch.long)])
    loc = loc[torch.randperm(loc.shape[0], generator=gen)]
    k, v = (torch.randn(loc.shape[0], hkv, d, generator=gen).to(dtype).float() for _ in range(2))
    in_range = (loc >= 0) & (loc < slots)
    want_k = oracle.store_kv(k_cache, loc[in_range], k[in_range])
    want_v = oracle.store_kv(v_cache, loc[in_range], v[in_range])
    wide_before = wide.clone()
    with running(provider), xpu_ops.debug_checks(False):
        xpu_ops.store_kv_cache(k_cache, v_cache, loc, k, v)
    assert outside_view_unchanged(k_cache, wide_before)
    assert bitwise_equal(k_cache.contiguous(), want_k) and bitwise_equal(v_cache, want_v)
    if wild:
        with xpu_ops.debug_checks(), pytest.raises(ValueError, match=r"^store_kv_cache: loc has "
                                                                      r"a token slot out of range"):
            xpu_ops.store_kv_cache(k_cache, v_cache, loc, k, v)


# ---- the reported cases on the other ops ------------------------------------------------

@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("cu_k, seqused, max_k, dense_cu_k, dense_used", [
    ([0, 5, 50], None, None, [0, 5, 9], None),             # cu_seqlens_k past the rows of k
    ([0, 5, 9], [3, 10], None, [0, 5, 9], [3, 4]),        # seqused_k past a request's keys
    ([0, 5, 9], [-4, 2], None, [0, 5, 9], [0, 2]),        # negative seqused_k: no keys
    ([0, 5, 9], None, 3, [0, 5, 9], [3, 3]),              # max_seqlen_k understates the keys
], ids=["cu_k-past-k", "seqused-past-range", "seqused-negative", "max_seqlen_k-small"])
def test_inconsistent_varlen_metadata_is_clamped(provider, cu_k, seqused, max_k, dense_cu_k,
                                                 dense_used):
    """Every provider clamps as API.md's "Writes" states: equal to the oracle on the clamped
    (consistent) metadata, nothing written outside ``out``; debug checks reject the call."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(n, h, 16, generator=gen) for n, h in ((3, 2), (9, 1), (9, 1)))
    cu_q = torch.tensor([0, 1, 3], dtype=I32)
    buffer, out = _guarded(torch.full((3, 2, 16), float("nan")))
    call = dict(seqused_k=None if seqused is None else torch.tensor(seqused, dtype=I32),
                max_seqlen_k=max_k, causal=False)
    with running(provider), xpu_ops.debug_checks(False):
        _, lse = xpu_ops.flash_attn_varlen_func(q, k, v, cu_q, torch.tensor(cu_k, dtype=I32),
                                                out=out, return_softmax_lse=True, **call)
    want, want_lse = oracle.flash_attn_varlen_func(
        q, k, v, cu_q, torch.tensor(dense_cu_k, dtype=I32), causal=False, softmax_scale=0.25,
        seqused_k=None if dense_used is None else torch.tensor(dense_used, dtype=I32))
    assert torch.isnan(buffer[:GUARD]).all() and torch.isnan(buffer[-GUARD:]).all()
    assert_matches_oracle(out, want, torch.float32, lse, want_lse)
    with running(provider), xpu_ops.debug_checks(), pytest.raises(
            ValueError, match=r"^flash_attn_varlen_func: (cu_seqlens_k|seqused_k|max_seqlen_k) "):
        xpu_ops.flash_attn_varlen_func(q, k, v, cu_q, torch.tensor(cu_k, dtype=I32), **call)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_mla_decode_with_wild_page_ids_and_lengths(provider):
    """A page id of 2**31 - 1 hides its keys and a length of 2**30 is cut to the page table's
    capacity (Triton crashed, the reference read another page)."""
    gen = torch.Generator().manual_seed(8)
    kv_cache = torch.randn(3, 4, 24, generator=gen)
    q_nope, q_rope = torch.randn(2, 2, 16, generator=gen), torch.randn(2, 2, 8, generator=gen)
    table = torch.tensor([[0, 2 ** 31 - 1], [1, 2]], dtype=I32)
    lens = torch.tensor([6, 2 ** 30], dtype=I32)
    ws = torch.zeros(xpu_ops.flash_mla_get_workspace_size(8, 2, 2), dtype=torch.uint8)
    with running(provider), xpu_ops.debug_checks(False):
        out = xpu_ops.flash_mla_decode(q_nope, q_rope, kv_cache, lens, table, ws, 0.2)
    keys = [kv_cache[0], kv_cache[[1, 2]].flatten(0, 1)]          # request 0: page 0 only
    for r in range(2):
        q = torch.cat([q_nope[r], q_rope[r]], -1)[None]
        k = keys[r][:, None]
        want, _ = oracle.attend(q, k, k[..., :16], torch.ones(1, k.shape[0], dtype=torch.bool),
                                scale=0.2)
        torch.testing.assert_close(out[r].double(), want[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_swa_spec_prefix_lens_out_of_range_are_clamped(provider):
    table = torch.arange(12, dtype=I32).view(2, 6)
    drafts = torch.tensor([[100, 101], [200, 201]], dtype=I32)
    mask = torch.tensor([[True, False], [True, True]]).expand(2, 2, 2).contiguous()
    with running(provider), xpu_ops.debug_checks(False):
        got, lens = xpu_ops.prepare_swa_spec_page_table(table, torch.tensor([9, -3], dtype=I32),
                                                        drafts, mask)
    with running("reference"):
        want, want_lens = xpu_ops.prepare_swa_spec_page_table(
            table, torch.tensor([6, 0], dtype=I32), drafts, mask)
    assert torch.equal(got, want) and torch.equal(lens, want_lens)
