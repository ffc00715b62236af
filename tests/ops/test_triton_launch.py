"""How ``paged_attention`` plans a launch: its split-KV plan and which kernel entry it binds.

Splits (``plan_splits``) depend on shapes only (a graph captures them); the kernel then cuts
each request's own visible keys into even shares of at least ``min_split_tiles`` tiles. The
planning tests restate the goal on an H200-sized machine (132 multiprocessors): at small batch
every (request, KV head) pair spreads over enough splits to keep the device busy, whatever the
request's length and however wide the page table. The kernel tests run under Triton's
interpreter against the float64 oracle, with page tables far wider than the lengths, garbage
page ids and NaN slots past each request, NaN-poisoned outputs and scratch, and check from the
partial LSEs which splits did work.

Entries: the plain form of a call (paged cache, K and V with the same strides, unit-stride
metadata, none of the rare features, the launcher's own scratch) takes
``_paged_attention_plain_kernel`` (15 runtime arguments and 29 constexprs, plus ``num_warps``/
``num_stages``; a layer's fixed values are constexprs, and a one-split launch without an LSE
binds None for LSE, scratch and counters); every other call takes ``_paged_attention_kernel``
(67 and 25). Both run the
same program (``_attend``), so each case is also checked against the oracle.
"""

from __future__ import annotations

import pytest

from .triton_mode import (INTERPRETED, interpret_while_module_runs,  # noqa: F401  (first)
                          rerun_in_subprocess, tl, triton)

import torch  # noqa: E402

import xpu_ops.testing as xt  # noqa: E402
from xpu_ops.triton import paged_attention as pa  # noqa: E402

from . import oracle  # noqa: E402
from .utils import assert_matches_oracle  # noqa: E402

in_subprocess = pytest.mark.skipif(not INTERPRETED, reason="Triton was imported in compile mode "
                                   "before this module; test_rerun_in_subprocess covers it")
test_rerun_in_subprocess = rerun_in_subprocess(__file__)

H200_SMS = 132
CUDA = torch.device("cuda")  # the plan reads only the device type and the (patched) SM count


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _working_splits(tiles: int, num_splits: int, min_split_tiles: int) -> int:
    """Splits that get at least one of a request's ``tiles`` key tiles (the kernel's rule)."""
    share = max(min_split_tiles, _cdiv(tiles, num_splits))
    return min(num_splits, _cdiv(tiles, share))


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(pa, "num_sms", lambda device: H200_SMS)


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
@pytest.mark.parametrize("length", [1024, 4096, 32768])
@pytest.mark.parametrize("wide_table", [False, True], ids=["table-fits", "table-128k"])
@pytest.mark.parametrize("block_n", [16, 64])
def test_small_batch_decode_keeps_every_multiprocessor_busy(h200, batch, length, wide_table,
                                                            block_n):
    """b = 1..8 decode with 8 KV heads: the programs that get keys cover the device, or every
    ``DECODE_SPLIT_KEYS``-key piece of the requests when there are fewer, also when the page
    table holds 128k tokens; no split is shorter than ``DECODE_SPLIT_KEYS`` keys."""
    programs = batch * 8
    capacity = 131072 if wide_table else length
    splits, min_tiles = pa.plan_splits(CUDA, programs, capacity, block_n, decode=True)
    busy = programs * _working_splits(_cdiv(length, block_n), splits, min_tiles)
    piece = pa.DECODE_SPLIT_KEYS
    assert busy >= min(H200_SMS, programs * _cdiv(length, piece)), (splits, min_tiles)
    assert min_tiles * block_n >= piece and splits <= 64


@pytest.mark.parametrize("length, block_n, splits, min_tiles", [
    (4096, 64, 1, 64), (4096, 16, 1, 256), (8000, 64, 2, 64), (32768, 64, 8, 64)])
def test_large_batch_decode_cuts_only_requests_over_4096_keys(h200, length, block_n, splits,
                                                              min_tiles):
    """64 requests x 8 KV heads already fill the device: a request is cut only into chunks of
    >= 4096 keys (64 x 4096 ran fastest unsplit), at most 8."""
    assert pa.plan_splits(CUDA, 512, length, block_n, decode=True) == (splits, min_tiles)


def test_prefill_splits_only_a_small_grid_and_keeps_four_tiles_per_split(h200):
    assert pa.plan_splits(CUDA, 4096, 4096, 128, decode=False) == (1, 4)
    assert pa.plan_splits(CUDA, 128, 8192, 128, decode=False) == (4, 4)


# (cache_seqlens, page_size, Hq, Hkv): one request (16 planned splits on 8 "multiprocessors"),
# page 1 (per-key addressing), 16 (a page per tile), 64 (tiles inside a page); three requests,
# one empty and one of one key (6 splits).
WIDE_CASES = [([40], 16, 2, 1), ([37], 1, 4, 1), ([90], 64, 4, 1), ([50, 0, 1], 16, 1, 1)]


def _wide_decode(lens, page, hq, hkv, seed):
    """Decode inputs with a page table over 1000 keys wider than the longest request (more
    than 64 key tiles of 16: a fixed chunk of its capacity per split would exceed 2 tiles)."""
    gen = torch.Generator().manual_seed(seed)
    extra = 1024 // page
    (k, v), table, seqlens = xt.paged_kv_cache(gen, lens, page, [(hkv, 16), (hkv, 16)],
                                               dtype=torch.float32, device="cpu",
                                               extra_columns=extra)
    q = torch.randn(len(lens), hq, 16, generator=gen)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    return [q, k, v, seqlens, table, cu, out, *[None] * 7]


@pytest.fixture(params=["waves", "legacy"])
def split_schedule(request):
    """Each decode split schedule of ``split_plan`` (the default and the former rule)."""
    from xpu_ops.triton import split_plan
    previous = split_plan.set_schedule(request.param)
    yield request.param
    split_plan.set_schedule(previous)


@in_subprocess
@pytest.mark.parametrize("case", WIDE_CASES, ids=["ps16", "ps1-gqa4", "ps64", "ps16-batch3"])
def test_planned_splits_share_each_length_and_match_oracle(case, monkeypatch, split_schedule):
    """Automatic splits over a wide page table (8 "multiprocessors" and one-tile splits: the
    small-batch plan at the interpreter's scale), under each split schedule (three requests on
    16 slots: 16 splits, the legacy rule 6): the output and LSE match the oracle, and
    exactly the splits that a request's own length gives a share wrote a finite partial LSE;
    the others, and a request with one working split (it writes the result itself), leave the
    NaN-poisoned scratch alone. Fixed chunks of the table's capacity would have left every split
    but the first idle."""
    monkeypatch.setattr(pa, "num_sms", lambda device: 8)
    monkeypatch.setattr(pa, "DECODE_SPLIT_KEYS", 16)
    pa._launch_params.cache_clear()
    lens, page, hq, hkv = case
    args = _wide_decode(lens, page, hq, hkv, seed=len(lens) + page)
    q, k, v, seqlens, table, cu, out = args[:7]
    capacity = table.shape[1] * page
    splits, min_tiles = pa.plan_splits(q.device, len(lens) * hkv, capacity, 16, decode=True)
    scratch = (torch.full((splits, len(lens), hq, 16), float("nan")),
               torch.full((splits, len(lens), hq), float("nan")))
    with xt.recorded_triton_launches() as launches:
        lse = pa.paged_attention(q, k, v, out, seqlens, cu, page_table=table, cu_seqlens_k=None,
                                 max_seqlen_q=1, max_kv_len=capacity, qv=None, q_descale=None,
                                 k_descale=None, v_descale=None, sinks=None, softmax_scale=0.25,
                                 window_left=-1, window_right=0, softcap=0.0, scratch=scratch)
    assert launches[0]["NUM_SPLITS"] == splits
    want, want_lse = oracle.flash_attn_with_kvcache(
        *args, max_seqlen_q=1, softmax_scale=0.25, causal=True, window_size_left=-1,
        window_size_right=0, softcap=0.0, num_splits=0)
    assert_matches_oracle(out, want, torch.float32, lse, want_lse)
    working = [_working_splits(_cdiv(n, 16), splits, min_tiles) for n in lens]
    assert max(working) > 1, (splits, min_tiles)
    for r, n in enumerate(working):
        part_lse = scratch[1][:, r]
        written = n if n > 1 else 0
        assert torch.isfinite(part_lse[:written]).all(), (r, part_lse)
        assert torch.isnan(part_lse[written:]).all(), (r, part_lse)


PLAIN, FULL = "_paged_attention_plain_kernel", "_paged_attention_kernel"


@pytest.fixture
def bound(monkeypatch):
    """``(kernel name, positional count, keyword names)`` of every launch; launches still run."""
    seen, real = [], pa.launch

    def spy(kernel, grid, device, *args, **kwargs):
        seen.append((kernel.fn.__name__, len(args), set(kwargs)))
        return real(kernel, grid, device, *args, **kwargs)
    monkeypatch.setattr(pa, "launch", spy)
    return seen


def _decode_case(**changes):
    base = dict(reqs=((1, 40), (1, 3), (1, 0)), page_size=16, hq=4, hkv=2, d=32, causal=True)
    return xt.AttentionCase(**{**base, **changes})


# (case, kernel): the plain form at one and several splits, a sliding window and softcap (scalars
# of the plain kernel), then one rare feature each.
CASES = [
    (_decode_case(), PLAIN), (_decode_case(num_splits=3), PLAIN),
    (_decode_case(window=(9, 0), softcap=5.0, num_splits=2), PLAIN),
    (_decode_case(sinks=True), FULL), (_decode_case(kv_dtype=torch.float8_e4m3fn), FULL),
    (_decode_case(leftpad=(3, 0, 0)), FULL),
]


@in_subprocess
@pytest.mark.parametrize("case, kernel", CASES,
                         ids=["plain", "plain-splits", "plain-window-softcap", "sinks", "fp8",
                              "leftpad"])
def test_call_binds_the_plain_kernel_unless_it_needs_a_rare_feature(case, kernel, bound):
    args, kwargs = xt.attention_case_inputs(case, "cpu", gen=torch.Generator().manual_seed(4))
    lens, table, cu, out = args[3], args[4], args[5], args[6]
    lse = pa.paged_attention(
        args[0], args[1], args[2], out, lens, cu, page_table=table, cu_seqlens_k=None,
        max_seqlen_q=kwargs["max_seqlen_q"], max_kv_len=table.shape[1] * case.page_size,
        qv=args[7], q_descale=args[8], k_descale=args[9], v_descale=args[10], sinks=args[11],
        softmax_scale=kwargs["softmax_scale"], window_left=kwargs["window_size_left"],
        window_right=kwargs["window_size_right"], softcap=kwargs["softcap"],
        num_splits=pa.requested_splits(kwargs["num_splits"]), k_start=args[12])
    name, positional, keywords = bound[0]
    assert name == kernel
    # runtime arguments (Triton binds each per launch), then constexprs and launch options
    assert (positional, len(keywords)) == ((15, 31) if kernel == PLAIN else (67, 28))
    want, want_lse = oracle.flash_attn_with_kvcache(*args, **kwargs)
    assert_matches_oracle(out, want, out.dtype, lse, want_lse)


@in_subprocess
def test_strided_metadata_or_distinct_kv_strides_take_the_full_kernel(bound):
    """A column slice of a wider page table (row stride kept, column stride 2) and a V cache
    viewed out of a wider buffer (other strides than K): the full kernel honours both."""
    case = _decode_case()
    args, kwargs = xt.attention_case_inputs(case, "cpu", gen=torch.Generator().manual_seed(5))
    q, k, v, lens, table, cu, out = args[:7]
    wide = torch.full((table.shape[0], 2 * table.shape[1]), -3, dtype=table.dtype)
    wide[:, ::2] = table
    v_wide = torch.full((*v.shape[:-1], 2 * v.shape[-1]), float("nan"))
    v_wide[..., :v.shape[-1]] = v
    for t, vv in ((wide[:, ::2], v), (table, v_wide[..., :v.shape[-1]])):
        out.fill_(float("nan"))
        lse = pa.paged_attention(
            q, k, vv, out, lens, cu, page_table=t, cu_seqlens_k=None, max_seqlen_q=1,
            max_kv_len=t.shape[1] * case.page_size, qv=None, q_descale=None, k_descale=None,
            v_descale=None, sinks=None, softmax_scale=kwargs["softmax_scale"], window_left=-1,
            window_right=0, softcap=0.0)
        want, want_lse = oracle.flash_attn_with_kvcache(*args, **kwargs)
        assert_matches_oracle(out, want, out.dtype, lse, want_lse)
    assert [name for name, _, _ in bound] == [FULL, FULL]


@pytest.fixture
def bound_args(monkeypatch):
    """The positional arguments of every launch; launches still run."""
    seen, real = [], pa.launch

    def spy(kernel, grid, device, *args, **kwargs):
        seen.append((kernel.fn.__name__, args, kwargs))
        return real(kernel, grid, device, *args, **kwargs)
    monkeypatch.setattr(pa, "launch", spy)
    return seen


@in_subprocess
@pytest.mark.parametrize("num_splits", [1, 3])
def test_plain_launch_without_lse_binds_none_and_matches_oracle(num_splits, bound_args):
    """``return_lse=False`` (a decode layer's call): at one split the plain kernel gets None for
    its LSE, scratch and counters (nothing to allocate or bind) and still writes the oracle's
    output into a NaN-poisoned ``out``; with splits it merges through a launcher-owned LSE
    and returns None all the same."""
    case = _decode_case(num_splits=num_splits)
    args, kwargs = xt.attention_case_inputs(case, "cpu", gen=torch.Generator().manual_seed(6))
    q, k, v, lens, table, cu, out = args[:7]
    out.fill_(float("nan"))
    got = pa.paged_attention(
        q, k, v, out, lens, cu, page_table=table, cu_seqlens_k=None, max_seqlen_q=1,
        max_kv_len=table.shape[1] * case.page_size, qv=None, q_descale=None, k_descale=None,
        v_descale=None, sinks=None, softmax_scale=kwargs["softmax_scale"], window_left=-1,
        window_right=0, softcap=0.0, num_splits=num_splits, return_lse=False)
    assert got is None
    name, positional, meta = bound_args[0]
    assert name == PLAIN and meta["NUM_SPLITS"] == num_splits
    lse_arg, scratch_arg, counters_arg = positional[4:7]
    if num_splits == 1:
        assert (lse_arg, scratch_arg, counters_arg) == (None, None, None)
    else:
        assert all(isinstance(t, torch.Tensor) for t in (lse_arg, scratch_arg, counters_arg))
    want, _ = oracle.flash_attn_with_kvcache(*args, **kwargs)
    assert_matches_oracle(out, want, out.dtype)


@in_subprocess
def test_plain_split_launches_share_their_threads_workspace_and_leave_counters_zero(
        monkeypatch):
    """Split plain launches one after another (1 to 4 splits, lengths that give each request one,
    some or all working splits, with and without an LSE) take this thread's workspace: partials
    NaN-poisoned between launches, every launch matches the oracle, and the counters are all
    zero after each (the next launch starts from them). A larger launch grows the workspace; a
    launch of another thread gets its own."""
    import threading
    monkeypatch.setattr(pa, "_WORKSPACES", {})
    key = pa._workspace_key(torch.device("cpu"))
    for i, (splits, reqs, want_lse) in enumerate([
            (3, ((1, 40), (1, 3), (1, 0)), False), (2, ((1, 70), (1, 17)), True),
            (4, ((1, 9), (1, 64), (1, 33), (1, 1)), False), (3, ((1, 5),), True)]):
        case = _decode_case(reqs=reqs, num_splits=splits)
        args, kwargs = xt.attention_case_inputs(case, "cpu",
                                                gen=torch.Generator().manual_seed(20 + i))
        q, k, v, lens, table, cu, out = args[:7]
        out.fill_(float("nan"))
        if key in pa._WORKSPACES:
            pa._WORKSPACES[key][0].fill_(float("nan"))
            pa._WORKSPACES[key][1].fill_(float("nan"))
        lse = pa.paged_attention(
            q, k, v, out, lens, cu, page_table=table, cu_seqlens_k=None,
            max_seqlen_q=kwargs["max_seqlen_q"],
            max_kv_len=table.shape[1] * case.page_size, qv=None, q_descale=None,
            k_descale=None, v_descale=None, sinks=None, softmax_scale=kwargs["softmax_scale"],
            window_left=-1, window_right=0, softcap=0.0, num_splits=splits,
            return_lse=want_lse)
        want, want_lse_ref = oracle.flash_attn_with_kvcache(*args, **kwargs)
        assert_matches_oracle(out, want, out.dtype, lse if want_lse else None,
                              want_lse_ref if want_lse else None)
        assert (lse is None) == (not want_lse)
        part, _, counters = pa._WORKSPACES[key]
        assert not counters.any(), (i, counters)
        assert part.numel() >= splits * q.shape[0] * q.shape[1] * (32 + 1)  # Dv_pad 32, + LSE
    assert list(pa._WORKSPACES) == [key]
    other = []
    thread = threading.Thread(target=lambda: other.append(pa._workspace_key(torch.device("cpu"))))
    thread.start()
    thread.join()
    assert other[0] != key


# ---- small-grid decode tiles (SMALL_GRID_DECODE_TILES) --------------------------------------

@pytest.mark.parametrize("kv_programs, d, page, elem, wide", [
    (8, 64, 16, 2, True), (64, 64, 16, 2, True), (8, 64, 1, 2, True), (8, 32, 8, 2, True),
    (264, 64, 16, 2, False),    # 2 programs per multiprocessor: a full grid, no splits
    (8, 128, 16, 2, False),     # head dim 128: not measured
    (8, 64, 64, 2, False),      # pages of 32 keys and more: one-page tiles (page_tiles)
    (8, 64, 16, 4, False),      # fp32
    (None, 64, 16, 2, False)])  # request count unknown
def test_small_grid_decode_takes_wide_key_tiles(h200, kv_programs, d, page, elem, wide):
    """A decode grid small enough to be split, with head dims <= 64, 16-bit q/K/V and pages of
    under 32 keys, takes 128-key tiles, 4 warps, 3 stages; every other decode launch keeps its
    tiles."""
    cfg = pa._pick_config(CUDA, 4, d, d, elem, page_size=page, kv_programs=kv_programs)
    got = (cfg.block_n, cfg.num_warps, cfg.num_stages)
    assert (got == pa.SMALL_GRID_DECODE_TILES) == wide, got
    assert cfg.block_m == 16


SMALL_GRID_CASES = [
    # (new, total keys) per request, page size, Hq, Hkv, D; lengths over several 128-key tiles
    # and splits, the last tile partial, one empty request and one of a single key
    xt.AttentionCase(((1, 700),), page_size=16, hq=8, hkv=2, d=64, causal=True),
    xt.AttentionCase(((1, 333), (1, 0), (1, 1), (1, 515)), page_size=1, hq=4, hkv=1, d=32,
                     causal=True),
    xt.AttentionCase(((1, 600), (1, 129)), page_size=64, hq=8, hkv=2, d=64, causal=True,
                     window=(200, 0)),
    # target-verify-like: 4 new tokens per request (16 packed rows), causal over the drafts
    xt.AttentionCase(((4, 400), (4, 4)), page_size=16, hq=8, hkv=2, d=64, causal=True),
]


@in_subprocess
@pytest.mark.parametrize("case", SMALL_GRID_CASES,
                         ids=["ps16", "ps1-batch4", "ps64-window", "ps16-verify4"])
def test_small_grid_decode_tiles_match_oracle(case, monkeypatch):
    """The small-grid decode tiles (128-key tiles, planned splits of >= 256 keys) against the
    float64 oracle under the interpreter: NaN-poisoned output, NaN slots and garbage page ids
    past each request."""
    monkeypatch.setattr(pa, "num_sms", lambda device: 8)
    args, kwargs = xt.attention_case_inputs(case, "cpu", gen=torch.Generator().manual_seed(7))
    q, k, v, lens, table, cu, out = args[:7]
    out.fill_(float("nan"))
    block_n, warps, stages = pa.SMALL_GRID_DECODE_TILES
    config = pa.with_paths(pa._Config(16, block_n, warps, stages), frozenset({"page_tiles"}))
    capacity = table.shape[1] * k.shape[1]
    with xt.recorded_triton_launches() as launches:
        lse = pa.paged_attention(
            q, k, v, out, lens, cu, page_table=table, cu_seqlens_k=None,
            max_seqlen_q=kwargs["max_seqlen_q"],
            max_kv_len=capacity, qv=None, q_descale=None, k_descale=None, v_descale=None,
            sinks=None, softmax_scale=kwargs["softmax_scale"],
            window_left=kwargs["window_size_left"], window_right=kwargs["window_size_right"],
            softcap=0.0, config=config)
    assert launches[0]["BLOCK_N"] == block_n and launches[0]["NUM_SPLITS"] > 1
    want, want_lse = oracle.flash_attn_with_kvcache(*args, **kwargs)
    assert_matches_oracle(out, want, out.dtype, lse, want_lse)
