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

from .triton_mode import INTERPRETED, rerun_in_subprocess, tl, triton  # noqa: F401  (first)

import torch  # noqa: E402

import xpu_ops.testing as xt  # noqa: E402
from xpu_ops.triton import _common  # noqa: E402
from xpu_ops.triton import paged_attention as pa  # noqa: E402

from . import oracle  # noqa: E402
from .utils import assert_matches_oracle  # noqa: E402

in_subprocess = pytest.mark.skipif(not INTERPRETED, reason="Triton was imported in compile mode "
                                   "before this module; test_rerun_in_subprocess covers it")
test_rerun_in_subprocess = rerun_in_subprocess(__file__)

# Pages larger than the interpreter's 16-key tile (a tile inside one page), odd D and Dv != D.
LARGE_PAGE_CASES = (
    xt.AttentionCase(((1, 70), (3, 40), (1, 0)), page_size=32, hq=4, hkv=2, d=20, causal=True,
                     num_splits=3),
    xt.AttentionCase(((5, 100),), page_size=64, hq=3, hkv=1, d=16, dv=32, causal=True,
                     window=(20, 0), sinks=True, num_splits=2),
)
CASES = xt.ATTENTION_CASES + LARGE_PAGE_CASES


@pytest.fixture(autouse=True, scope="module")
def _interpret():
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    yield
    mp.undo()


@pytest.fixture
def launches(monkeypatch):
    """The constexpr keywords of every kernel launch made through ``paged_attention``."""
    seen = []

    def spy(kernel, grid, device, *args, **kwargs):
        seen.append(kwargs)
        return _common.launch(kernel, grid, device, *args, **kwargs)
    monkeypatch.setattr(pa, "launch", spy)
    return seen


def _launch_with(config_paths, args, kwargs):
    """The provider's ``paged_attention`` call for op ``args``/``kwargs`` with the default tile
    config and ``config_paths`` forced; returns the LSE (``out`` = ``args[6]`` is written)."""
    (q, k, v, lens, table, cu, out, qv, q_descale, k_descale, v_descale, sinks, leftpad,
     block_ids) = args
    config = dataclasses.replace(pa.default_config(q, v, kwargs["max_seqlen_q"], k.shape[2]),
                                 **config_paths)
    return pa.paged_attention(
        q, k, v, out, lens, cu, page_table=table, cu_seqlens_k=None,
        max_seqlen_q=kwargs["max_seqlen_q"], max_kv_len=table.shape[1] * k.shape[1], qv=qv,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, sinks=sinks,
        softmax_scale=kwargs["softmax_scale"], window_left=kwargs["window_size_left"],
        window_right=kwargs["window_size_right"], softcap=kwargs["softcap"],
        num_splits=pa.requested_splits(kwargs["num_splits"]), config=config, k_start=leftpad,
        block_ids=block_ids)


@in_subprocess
@pytest.mark.parametrize("case", CASES, ids=[f"{i}-ps{c.page_size}-d{c.d}"
                                             for i, c in enumerate(CASES)])
def test_page_tiles_match_oracle(case, launches):
    """``page_tiles``: key tiles addressed per page, unmasked columns where D and Dv are powers
    of two; every case against the float64 oracle, the path's constexprs checked."""
    args, kwargs = xt.attention_case_inputs(case, "cpu", gen=torch.Generator().manual_seed(3))
    lse = _launch_with({"page_tiles": True}, args, kwargs)
    want, want_lse = oracle.flash_attn_with_kvcache(*args, **kwargs)
    if args[6].shape[0]:
        assert launches and launches[0]["PAGE_TILES"]
        even = case.d == pa.next_pow2(case.d) and case.head_dim_v == pa.next_pow2(case.head_dim_v)
        assert launches[0]["EVEN_D"] == (even and min(case.d, case.head_dim_v) >= 16)
    assert_matches_oracle(args[6], want, args[6].dtype, lse, want_lse)


def test_parse_paths_names_the_variable_and_the_bad_name():
    assert _common.parse_paths("") == frozenset()
    assert _common.parse_paths(" page_tiles ,") == {"page_tiles"}
    assert _common.parse_paths("all") == frozenset(_common.OPTIONAL_PATHS)
    with pytest.raises(ValueError, match=r"^XPU_OPS_TRITON_PATHS: tma_typo is not an optional "
                                         r"kernel path; expected a comma list of \["):
        _common.parse_paths("page_tiles,tma_typo")
