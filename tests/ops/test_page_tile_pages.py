"""``page_tiles`` over tiles of more than two pages (``PAGE_TILE_MAX_PAGES`` raised, as the
benchmark's A/B column does): 64-key tiles over four 16-key pages and eight 8-key pages, one
and three splits, against the float64 oracle under Triton's interpreter, with a page table
wider than the requests (garbage ids past them), NaN slots past each length and a NaN-poisoned
output."""

from __future__ import annotations

import pytest

from .triton_mode import (INTERPRETED, interpret_while_module_runs,  # noqa: F401  (first)
                          rerun_in_subprocess)

import torch  # noqa: E402

import xpu_ops.testing as xt  # noqa: E402
from xpu_ops.triton import paged_attention as pa  # noqa: E402

from . import oracle  # noqa: E402
from .utils import assert_matches_oracle  # noqa: E402

in_subprocess = pytest.mark.skipif(not INTERPRETED, reason="Triton was imported in compile mode "
                                   "before this module; test_rerun_in_subprocess covers it")
test_rerun_in_subprocess = rerun_in_subprocess(__file__)


@in_subprocess
@pytest.mark.parametrize("page, splits", [(16, 1), (16, 3), (8, 3)])
def test_page_tiles_of_four_and_eight_pages_match_oracle(page, splits, monkeypatch):
    monkeypatch.setattr(pa, "PAGE_TILE_MAX_PAGES", 64 // page)
    pa._launch_params.cache_clear()
    gen = torch.Generator().manual_seed(page + splits)
    lens = [150, 64, 5]
    (k, v), table, seqlens = xt.paged_kv_cache(gen, lens, page, [(2, 32), (2, 32)],
                                               dtype=torch.float32, device="cpu",
                                               extra_columns=3)
    q = torch.randn(len(lens), 8, 32, generator=gen)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    config = pa.with_paths(pa._Config(16, 64, 1, 1), frozenset({"page_tiles"}))
    with xt.recorded_triton_launches() as launches:
        lse = pa.paged_attention(q, k, v, out, seqlens, cu, page_table=table, cu_seqlens_k=None,
                                 max_seqlen_q=1, max_kv_len=table.shape[1] * page, qv=None,
                                 q_descale=None, k_descale=None, v_descale=None, sinks=None,
                                 softmax_scale=0.2, window_left=-1, window_right=-1,
                                 softcap=0.0, num_splits=splits, config=config)
    pa._launch_params.cache_clear()
    assert launches[0]["PAGE_TILES"] and launches[0]["BLOCK_N"] == 64
    args = [q, k, v, seqlens, table, cu, out, *[None] * 7]
    want, want_lse = oracle.flash_attn_with_kvcache(
        *args, max_seqlen_q=1, softmax_scale=0.2, causal=False, window_size_left=-1,
        window_size_right=-1, softcap=0.0, num_splits=0)
    assert_matches_oracle(out, want, torch.float32, lse, want_lse)
