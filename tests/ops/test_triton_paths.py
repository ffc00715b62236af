"""The optional Triton kernel paths (``xpu_ops.triton._common.OPTIONAL_PATHS``) against the oracle.

Each path is forced through the launcher's ``config`` on every attention case of
``xpu_ops.testing.ATTENTION_CASES`` (page sizes 1, 4 and 16; odd head dims, GQA, windows, softcap,
sinks, fp8 KV and q, leftpad, bidirectional blocks, empty rows; NaN in unused slots and
out-of-range page ids past each request) plus pages larger than a key tile, under Triton's
interpreter; a spy on the launch checks that the path was taken. Full-size shapes of the same
paths are in ``test_triton_gpu.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from .triton_mode import (INTERPRETED, interpret_while_module_runs,  # noqa: F401  (first)
                          rerun_in_subprocess, tl, triton)

import torch  # noqa: E402

import xpu_ops.testing as xt  # noqa: E402
from xpu_ops.triton import _common  # noqa: E402
from xpu_ops.triton import paged_attention as pa  # noqa: E402

from . import oracle  # noqa: E402
from .utils import assert_matches_oracle  # noqa: E402

in_subprocess = pytest.mark.skipif(not INTERPRETED, reason="Triton was imported in compile mode "
                                   "before this module; test_rerun_in_subprocess covers it")
test_rerun_in_subprocess = rerun_in_subprocess(__file__)

# Pages larger than the interpreter's 16-key tile (a tile inside one page), odd D and Dv != D;
# a prefill whose row tiles end inside each request (descriptor boxes clip at q_len); pages of 8.
EXTRA_CASES = (
    xt.AttentionCase(((1, 70), (3, 40), (1, 0)), page_size=32, hq=4, hkv=2, d=20, causal=True,
                     num_splits=3),
    xt.AttentionCase(((5, 100),), page_size=64, hq=8, hkv=2, d=16, dv=32, causal=True,
                     window=(20, 0), sinks=True, num_splits=1),
    xt.AttentionCase(((21, 50), (20, 20)), page_size=16, hq=8, hkv=2, d=32, causal=True,
                     num_splits=1),
    # two pages per 16-key tile (per-page offsets reshaped to keys), GQA 2, a window
    xt.AttentionCase(((3, 45), (1, 17)), page_size=8, hq=4, hkv=2, d=16, causal=True,
                     window=(20, 0), num_splits=2),
)
CASES = xt.ATTENTION_CASES + EXTRA_CASES
CASE_IDS = [f"{i}-ps{c.page_size}-d{c.d}" for i, c in enumerate(CASES)]
# phases alone and warp specialisation (the interpreter runs the loop as written) on a subset:
# GQA extend at page 4, page 1, fp8 KV, leftpad, bidirectional blocks, tiles inside pages, a
# prefill.
SUBSET = [1, 2, 11, 21, 22, 24, 26, 27]


@pytest.fixture
def launches():
    """The constexpr keywords of every kernel launch made through ``paged_attention``."""
    with xt.recorded_triton_launches() as seen:
        yield seen


def _launch_with(paths, args, kwargs):
    """The provider's ``paged_attention`` call for op ``args``/``kwargs`` with the default tile
    config and exactly the optional ``paths`` on; returns the LSE (``out`` = ``args[6]``)."""
    (q, k, v, lens, table, cu, out, qv, q_descale, k_descale, v_descale, sinks, leftpad,
     block_ids) = args
    config = pa.default_config(q, v, kwargs["max_seqlen_q"], k.shape[2], paths, k.shape[1])
    return pa.paged_attention(
        q, k, v, out, lens, cu, page_table=table, cu_seqlens_k=None,
        max_seqlen_q=kwargs["max_seqlen_q"], max_kv_len=table.shape[1] * k.shape[1], qv=qv,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, sinks=sinks,
        softmax_scale=kwargs["softmax_scale"], window_left=kwargs["window_size_left"],
        window_right=kwargs["window_size_right"], softcap=kwargs["softcap"],
        num_splits=pa.requested_splits(kwargs["num_splits"]), config=config, k_start=leftpad,
        block_ids=block_ids)


def _pow2(n: int) -> bool:
    return n == pa.next_pow2(n)


def _expected_paths(case, paths) -> dict:
    """The path constexprs a launch of ``case`` must get (CPU: 16-key tiles, so per-page
    addressing from 8-key pages up; descriptors supported; fp32 / bf16 / fp8 rows of these head
    dims are 16-byte multiples)."""
    asked = bool(paths & {"tma", "tma_ws"})
    tma = asked and _pow2(case.hq // case.hkv) and _pow2(case.page_size) and case.page_size >= 16
    tiles = asked or "page_tiles" in paths
    even = _pow2(case.d) and _pow2(case.head_dim_v) and min(case.d, case.head_dim_v) >= 16
    return dict(PAGE_TILES=tiles and _pow2(case.page_size) and case.page_size >= 8,
                EVEN_D=tiles and even, PHASES=asked or "phases" in paths, TMA=tma)


def _check_paths(case, paths, launches):
    args, kwargs = xt.attention_case_inputs(case, "cpu", gen=torch.Generator().manual_seed(3))
    lse = _launch_with(frozenset(paths), args, kwargs)
    want, want_lse = oracle.flash_attn_with_kvcache(*args, **kwargs)
    if args[6].shape[0]:
        assert launches, "no kernel launch"
        expected = _expected_paths(case, frozenset(paths))
        # the plain kernel has no TMA constexpr: it never takes descriptors
        assert {key: launches[0].get(key, False) for key in expected} == expected
    assert_matches_oracle(args[6], want, args[6].dtype, lse, want_lse)


@in_subprocess
@pytest.mark.parametrize("paths", [("page_tiles",), ("tma",), ("fold_scale",)])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_paths_match_oracle(case, paths, launches):
    """``page_tiles`` (one loop) and ``tma`` (three phases, descriptors where the launch allows,
    else per-page gathers) on every case against the float64 oracle, constexprs checked."""
    _check_paths(case, paths, launches)


@in_subprocess
@pytest.mark.parametrize("paths", [("phases",), ("tma_ws",), ("tma", "fold_scale")])
@pytest.mark.parametrize("case", [CASES[i] for i in SUBSET], ids=[CASE_IDS[i] for i in SUBSET])
def test_phase_paths_match_oracle(case, paths, launches):
    _check_paths(case, paths, launches)


@in_subprocess
@pytest.mark.parametrize("paths", [("phases",), ("tma",)])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_invalid_interior_page_hides_its_keys(paths, num_splits):
    """A page id outside [0, num_pages) inside a run of interior tiles: its keys are hidden
    (the program falls back to masked tiles), the others attend as the oracle says."""
    gen = torch.Generator().manual_seed(5)
    (k, v), table, lens = xt.paged_kv_cache(gen, [64], 16, [(2, 16), (2, 16)],
                                            dtype=torch.float32, device="cpu")
    q = torch.randn(1, 4, 16, generator=gen)
    keys = torch.arange(64)
    shown = (keys < 16) | (keys >= 32)
    want, want_lse = oracle.attend(q, oracle.paged_keys(k, table, 0, 64)[shown],
                                   oracle.paged_keys(v, table, 0, 64)[shown],
                                   torch.ones(1, int(shown.sum()), dtype=torch.bool), scale=0.25)
    table[0, 1] = -5
    out = torch.full((1, 4, 16), float("nan"))
    args = (q, k, v, lens, table, torch.tensor([0, 1], dtype=torch.int32), out, *[None] * 7)
    kwargs = dict(max_seqlen_q=1, softmax_scale=0.25, window_size_left=-1, window_size_right=-1,
                  softcap=0.0, num_splits=num_splits)
    lse = _launch_with(frozenset(paths), args, kwargs)
    assert_matches_oracle(out, want, torch.float32, lse, want_lse)


# Two pages per interior descriptor tile (BLOCK_N = 2 x page_size: one box per page, one
# softmax update for both): long enough requests for interior runs; causal, windows, softcap,
# sinks, splits, bf16, rows past q_len inside a tile, an empty request.
PAIR_CASES = (
    xt.AttentionCase(((40, 150), (1, 97), (0, 0)), page_size=16, hq=4, hkv=2, d=32,
                     causal=True, num_splits=1),
    xt.AttentionCase(((70, 130),), page_size=32, hq=8, hkv=2, d=16, dtype=torch.bfloat16,
                     causal=True, window=(60, 0), sinks=True, num_splits=2),
    xt.AttentionCase(((33, 100), (64, 64)), page_size=16, hq=2, hkv=2, d=64, causal=True,
                     softcap=3.0, num_splits=1),
    xt.AttentionCase(((20, 120),), page_size=16, hq=4, hkv=4, d=32, causal=False,
                     num_splits=3),
)


@in_subprocess
@pytest.mark.parametrize("fold", [False, True], ids=["scaled", "fold_scale"])
@pytest.mark.parametrize("case", PAIR_CASES, ids=[f"pair{i}-ps{c.page_size}"
                                                  for i, c in enumerate(PAIR_CASES)])
def test_tma_two_page_tiles_match_oracle(case, fold, launches):
    """``tma`` with 2 x page_size key tiles: interior tiles load one descriptor box per page,
    edge tiles gather per page; against the float64 oracle into NaN-poisoned outputs."""
    args, kwargs = xt.attention_case_inputs(case, "cpu", gen=torch.Generator().manual_seed(4))
    q, k, v = args[:3]
    paths = frozenset({"tma", "fold_scale"} if fold else {"tma"})
    config = pa.with_paths(pa._Config(32, 2 * case.page_size, 1, 1), paths)
    lse = pa.paged_attention(
        q, k, v, args[6], args[3], args[5], page_table=args[4], cu_seqlens_k=None,
        max_seqlen_q=kwargs["max_seqlen_q"], max_kv_len=args[4].shape[1] * k.shape[1],
        qv=None, q_descale=None, k_descale=None, v_descale=None, sinks=args[11],
        softmax_scale=kwargs["softmax_scale"], window_left=kwargs["window_size_left"],
        window_right=kwargs["window_size_right"], softcap=kwargs["softcap"],
        num_splits=pa.requested_splits(kwargs["num_splits"]), config=config)
    assert (launches[0]["TMA"], launches[0]["BLOCK_N"], launches[0]["FOLD_SCALE"]) == (
        True, 2 * case.page_size, fold)
    want, want_lse = oracle.flash_attn_with_kvcache(*args, **kwargs)
    assert_matches_oracle(args[6], want, args[6].dtype, lse, want_lse)


@in_subprocess
@pytest.mark.parametrize("paths", [("fold_scale",), ("phases", "fold_scale"),
                                   ("tma", "fold_scale")])
@pytest.mark.parametrize("scale", [-0.3, 0.0, 1e-3])
def test_scale_folded_into_the_softmax_keeps_any_sign(scale, paths, launches):
    """``fold_scale``: plain scores stay raw q.k and the softmax multiplies by the scale
    inside exp2: a negative scale (q's sign flipped instead), a zero one (uniform weights) and
    a tiny one match the oracle on every schedule."""
    case = xt.AttentionCase(((30, 70), (1, 40)), page_size=16, hq=4, hkv=2, d=32, causal=True,
                            num_splits=1)
    args, kwargs = xt.attention_case_inputs(case, "cpu", gen=torch.Generator().manual_seed(6))
    kwargs["softmax_scale"] = scale
    lse = _launch_with(frozenset(paths), args, kwargs)
    assert launches[0]["FOLD_SCALE"]
    want, want_lse = oracle.flash_attn_with_kvcache(*args, **kwargs)
    assert_matches_oracle(args[6], want, args[6].dtype, lse, want_lse)


def test_parse_paths_names_the_variable_and_the_bad_name():
    assert _common.parse_paths("") == _common.parse_paths("none") == frozenset()
    assert _common.parse_paths(" page_tiles ,") == {"page_tiles"}
    assert _common.parse_paths("all") == frozenset(_common.OPTIONAL_PATHS)
    with pytest.raises(ValueError, match=r"^XPU_OPS_TRITON_PATHS: tma_typo is not an optional "
                                         r"kernel path; expected a comma list of \["):
        _common.parse_paths("page_tiles,tma_typo")


# MLA decode (qv path: q_rope vs the rope part, q_nope vs the latent part, which is also V):
# (k_lens, page_size, H, R, r, num_splits, BLOCK_M).
MLA_CASES = [([37, 1, 0, 70], 16, 32, 64, 16, 3, 32), ([50, 9], 4, 16, 128, 16, 1, 16)]


@in_subprocess
@pytest.mark.parametrize("case", MLA_CASES, ids=["splits3-bm32", "one-split-bm16"])
def test_mla_split_matches_oracle(case, launches):
    """``mla_split``: two programs per row tile, each accumulating half of the latent columns
    and merging its half of the split-KV partials, against the float64 oracle."""
    k_lens, page, h, latent, rope, splits, block_m = case
    gen = torch.Generator().manual_seed(9)
    (kv,), table, lens = xt.paged_kv_cache(gen, k_lens, page, [(latent + rope,)],
                                           dtype=torch.float32, device="cpu")
    q_nope = torch.randn(len(k_lens), h, latent, generator=gen)
    q_rope = torch.randn(len(k_lens), h, rope, generator=gen)
    out = torch.full_like(q_nope, float("nan"))
    lse = torch.full((h, len(k_lens)), float("nan"))
    config = pa.with_paths(pa._Config(block_m, 16, 1, 1), frozenset({"mla_split"}))
    pa.paged_attention(q_rope, kv[:, :, None, latent:], kv[:, :, None, :latent], out, lens,
                       torch.arange(len(k_lens) + 1, dtype=torch.int32), page_table=table,
                       cu_seqlens_k=None, max_seqlen_q=1, max_kv_len=table.shape[1] * page,
                       qv=q_nope, q_descale=None, k_descale=None, v_descale=None, sinks=None,
                       softmax_scale=0.1, window_left=-1, window_right=-1, softcap=0.0,
                       num_splits=splits, config=config, lse=lse)
    assert launches[0]["DV_SPLIT"] == (2 if block_m >= 32 else 1)
    want = oracle.flash_mla_decode(q_nope, q_rope, kv, lens, table, 0.1)
    assert_matches_oracle(out, want, torch.float32)


@pytest.mark.parametrize("page_size, block_n, stages", [(16, 64, 4), (32, 32, 8), (64, 64, 4),
                                                        (128, 64, 4), (1, 64, 4), (8, 64, 4)])
def test_page_tiles_decode_tiles_hold_one_page(page_size, block_n, stages):
    """Decode tiles with ``page_tiles`` on a GPU: one whole page per tile from 32 keys up (its K/V
    addresses then come from one page id), the pipeline deepened to keep the bytes in flight;
    smaller pages and the portable path keep the default 64-key tile (4 stages, 2 warps)."""
    cuda = torch.device("cuda")  # the tile choice reads only the device type
    tiles = pa._pick_config(cuda, 4, 128, 128, 2, frozenset({"page_tiles"}), page_size)
    assert (tiles.block_n, tiles.num_stages, tiles.page_tiles) == (block_n, stages, True)
    default = pa._pick_config(cuda, 4, 128, 128, 2, frozenset(), page_size)
    assert (default.block_n, default.num_stages, default.page_tiles) == (64, 4, False)


@pytest.mark.skipif(_common.ENABLED_PATHS is not None, reason="XPU_OPS_TRITON_PATHS is set")
@pytest.mark.parametrize("descriptors", [True, False], ids=["hopper", "no-tma"])
def test_decode_takes_page_tiles_and_prefill_descriptors_where_supported(descriptors,
                                                                         monkeypatch):
    """Defaults: decode takes page_tiles; prefill takes tma and phases where the device has
    tensor descriptors, and the portable three-phase kernel (no page_tiles, which tma would
    imply) where it has none (XPU, CUDA before sm_90)."""
    monkeypatch.setattr(pa, "descriptors_supported", lambda *a: descriptors)
    cuda = torch.device("cuda")
    decode = pa._pick_config(cuda, 4, 128, 128, 2, page_size=64)
    assert (decode.page_tiles, decode.phases, decode.tma, decode.block_n) == (True, False,
                                                                              False, 64)
    prefill = pa._pick_config(cuda, 4096 * 4, 128, 128, 2, page_size=64)
    assert (prefill.page_tiles, prefill.phases, prefill.tma) == (descriptors, True, descriptors)
    assert (prefill.block_m, prefill.block_n) == (128, 128)
    assert not (decode.fold_scale or prefill.fold_scale)
