"""Value checks behind ``XPU_OPS_DEBUG_CHECKS=1`` (``xpu_ops/_value_checks.py``): each raises
with the switch on and is silent with it off; store ops skip out-of-range ``loc`` slots on every
provider (Triton through its interpreter, in a subprocess)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import xpu_ops
from xpu_ops import _value_checks

I32 = dict(dtype=torch.int32)
SLOTS, GUARD = 10, 2


@pytest.fixture
def debug(xpu_env):
    xpu_env("XPU_OPS_DEBUG_CHECKS", "1")


@pytest.fixture
def no_debug(xpu_env):
    xpu_env("XPU_OPS_DEBUG_CHECKS", None)


def test_switch_reads_env_once_until_refresh_and_context_manager(xpu_env, monkeypatch):
    xpu_env("XPU_OPS_DEBUG_CHECKS", None)
    assert not _value_checks.debug_checks_enabled()
    monkeypatch.setenv("XPU_OPS_DEBUG_CHECKS", "1")
    assert not _value_checks.debug_checks_enabled()   # read once, not per call
    xpu_ops.refresh()
    assert _value_checks.debug_checks_enabled()
    with xpu_ops.debug_checks(False):
        assert not _value_checks.debug_checks_enabled()
    xpu_env("XPU_OPS_DEBUG_CHECKS", "0")
    with xpu_ops.debug_checks():
        assert _value_checks.debug_checks_enabled()
    assert not _value_checks.debug_checks_enabled()


# ---- store ops: raise with the switch on, skip out-of-range slots with it off ----------------

def _guarded_cache(shape_tail, dtype=torch.float32):
    """A cache of SLOTS rows inside a NaN-free buffer with GUARD rows on each side, so a write
    through a negative or too-large slot lands in the guard rows."""
    buf = torch.full((SLOTS + 2 * GUARD, *shape_tail), 0.5).to(dtype)
    return buf, buf[GUARD:GUARD + SLOTS]


LOCS = [([1, -1, 7], "loc[1] = -1"), ([3, 10], "loc[1] = 10"), ([-5, 12], "loc[0] = -5")]


@pytest.mark.parametrize("loc_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("loc_values,first_bad", LOCS)
def test_store_kv_cache_loc(loc_values, first_bad, loc_dtype, xpu_env):
    loc = torch.tensor(loc_values, dtype=loc_dtype)
    k, v = torch.randn(len(loc_values), 2, 4), torch.randn(len(loc_values), 2, 3)
    (kbuf, kc), (vbuf, vc) = _guarded_cache((2, 4)), _guarded_cache((2, 3))
    xpu_env("XPU_OPS_DEBUG_CHECKS", "1")
    pattern = (r"^store_kv_cache: loc has a token slot out of range; expected 0 <= loc < 10 "
               rf"\(token slots of the cache\), got {re.escape(first_bad)}\. ")
    with pytest.raises(ValueError, match=pattern):
        xpu_ops.store_kv_cache(kc, vc, loc, k, v)
    assert (kbuf == 0.5).all() and (vbuf == 0.5).all()          # raised before any write
    xpu_env("XPU_OPS_DEBUG_CHECKS", "0")
    with xpu_ops.use_provider("reference"):
        xpu_ops.store_kv_cache(kc, vc, loc, k, v)
    want_k, want_v = torch.full_like(kbuf, 0.5), torch.full_like(vbuf, 0.5)
    for i, slot in enumerate(loc_values):
        if 0 <= slot < SLOTS:
            want_k[GUARD + slot], want_v[GUARD + slot] = k[i], v[i]
    assert torch.equal(kbuf, want_k) and torch.equal(vbuf, want_v)


def test_store_kv_cache_paged_fp8_all_out_of_range(no_debug):
    """Every slot out of range: nothing changes (the fp8 byte path, a paged 4-D cache)."""
    kc = torch.randn(3, 4, 1, 2).to(torch.float8_e4m3fn)
    vc = torch.randn(3, 4, 1, 2).to(torch.float8_e4m3fn)
    before = kc.view(torch.uint8).clone(), vc.view(torch.uint8).clone()
    xpu_ops.store_kv_cache(kc, vc, torch.tensor([12, -1]), torch.randn(2, 1, 2),
                           torch.randn(2, 1, 2), k_scale=2.0, v_scale=2.0)
    assert torch.equal(kc.view(torch.uint8), before[0])
    assert torch.equal(vc.view(torch.uint8), before[1])
    with xpu_ops.debug_checks(), pytest.raises(ValueError, match=r"0 <= loc < 12 .* got loc"
                                                                 r"\[0\] = 12\."):
        xpu_ops.store_kv_cache(kc, vc, torch.tensor([12, -1]), torch.randn(2, 1, 2),
                               torch.randn(2, 1, 2), k_scale=2.0, v_scale=2.0)


@pytest.mark.parametrize("loc_values,first_bad", LOCS)
def test_store_mla_kv_cache_loc(loc_values, first_bad, xpu_env):
    loc = torch.tensor(loc_values)
    n = len(loc_values)
    k_nope, k_rope = torch.randn(n, 1, 4), torch.randn(n, 1, 2)
    buf, cache = _guarded_cache((1, 6))
    xpu_env("XPU_OPS_DEBUG_CHECKS", "1")
    with pytest.raises(ValueError, match=r"^store_mla_kv_cache: loc has a token slot out of "
                                         rf"range; expected 0 <= loc < 10 .*got "
                                         rf"{re.escape(first_bad)}\."):
        xpu_ops.store_mla_kv_cache(cache, loc, k_nope, k_rope)
    assert (buf == 0.5).all()
    xpu_env("XPU_OPS_DEBUG_CHECKS", None)
    xpu_ops.store_mla_kv_cache(cache, loc, k_nope, k_rope)
    want = torch.full_like(buf, 0.5)
    for i, slot in enumerate(loc_values):
        if 0 <= slot < SLOTS:
            want[GUARD + slot] = torch.cat([k_nope[i], k_rope[i]], dim=-1)
    assert torch.equal(buf, want)


def test_in_range_loc_is_silent_with_the_switch_on(debug):
    kc, vc = torch.zeros(4, 1, 2), torch.zeros(4, 1, 2)
    xpu_ops.store_kv_cache(kc, vc, torch.tensor([3, 0]), torch.ones(2, 1, 2), torch.ones(2, 1, 2))
    assert kc[3].sum() == 2 and kc[0].sum() == 2 and kc[1:3].sum() == 0


TRITON_SCRIPT = textwrap.dedent("""
    import torch, xpu_ops
    buf = torch.full((14, 2, 4), 0.5); cache = buf[2:12]
    mla_buf = torch.full((14, 1, 6), 0.5); mla = mla_buf[2:12]
    k = torch.randn(4, 2, 4)
    loc = torch.tensor([1, -1, 7, 10])
    with xpu_ops.use_provider("triton"):
        xpu_ops.store_kv_cache(cache, cache, loc, k, k)
        xpu_ops.store_mla_kv_cache(mla, loc, torch.ones(4, 1, 4), torch.ones(4, 1, 2))
    want = torch.full_like(buf, 0.5); want[3], want[9] = k[0], k[2]
    assert torch.equal(buf, want), (buf - want).abs().sum(dim=(1, 2))
    want = torch.full_like(mla_buf, 0.5); want[3] = want[9] = 1.0
    assert torch.equal(mla_buf, want), (mla_buf - want).abs().sum(dim=(1, 2))
    print("ok")
""")


def test_triton_store_skips_out_of_range_slots():
    """The Triton kernel masks the store: guard rows around the cache stay untouched. Runs in a
    fresh interpreter with TRITON_INTERPRET=1 set before Triton is imported (Triton reads it at
    decoration time; see tests/ops/test_triton_ops.py)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", XPU_OPS_DEBUG_CHECKS="0")
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]


# ---- attention ops --------------------------------------------------------------------------

def _paged_inputs():
    """b = 2 requests: 1 and 2 new tokens, 3 and 4 keys, page_size 2, 4 pages."""
    return dict(q=torch.randn(3, 2, 8), k_cache=torch.randn(4, 2, 1, 8),
                v_cache=torch.randn(4, 2, 1, 8), cache_seqlens=torch.tensor([3, 4], **I32),
                page_table=torch.tensor([[2, 0], [1, 3]], **I32),
                cu_seqlens_q=torch.tensor([0, 1, 3], **I32), max_seqlen_q=2)


PAGED_CASES = [
    ("cu_seqlens_q", [-1, 1, 3], r"cu_seqlens_q does not start at 0; expected prefix sums with "
     r"cu_seqlens_q\[0\] = 0, got cu_seqlens_q\[0\] = -1\."),
    ("cu_seqlens_q", [0, 2, 1], r"cu_seqlens_q decreases; expected non-decreasing prefix sums, "
     r"got cu_seqlens_q\[2\] = 1\."),
    ("cu_seqlens_q", [0, 1, 2], r"cu_seqlens_q does not end at the number of tokens; expected "
     r"cu_seqlens_q\[-1\] = q.shape\[0\] \(total_q\) = 3, got cu_seqlens_q\[2\] = 2\."),
    ("max_seqlen_q", 1, r"max_seqlen_q is smaller than a request's length; expected "
     r"max_seqlen_q >= cu_seqlens_q\[r \+ 1\] - cu_seqlens_q\[r\] for every request r, got "
     r"1 < 2 \(request 1\)\."),
    ("cache_seqlens", [3, -1], r"cache_seqlens is out of range; expected 0 <= cache_seqlens <= "
     r"page_table.shape\[1\] \* page_size = 2 \* 2 = 4 tokens, got cache_seqlens\[1\] = -1\."),
    ("cache_seqlens", [5, 4],
     r"cache_seqlens is out of range; .*got cache_seqlens\[0\] = 5\."),
    ("page_table", [[2, 0], [-1, 3]], r"page_table has a page id out of range in an entry that "
     r"is read; expected 0 <= page id < 4 \(num_pages\) .*, got page_table\[1, 0\] = -1\."),
    ("page_table", [[2, 4], [1, 3]],
     r"page_table has a page id out of range .*got page_table\[0, 1\] = 4\."),
]


def _varlen_inputs():
    return dict(q=torch.randn(4, 2, 8), k=torch.randn(6, 1, 8), v=torch.randn(6, 1, 8),
                cu_seqlens_q=torch.tensor([0, 1, 4], **I32),
                cu_seqlens_k=torch.tensor([0, 2, 6], **I32), max_seqlen_q=3, max_seqlen_k=4)


VARLEN_CASES = [
    ("cu_seqlens_k", [0, 2, 5], r"cu_seqlens_k does not end at the number of tokens; expected "
     r"cu_seqlens_k\[-1\] = k.shape\[0\] \(total_k\) = 6, got cu_seqlens_k\[2\] = 5\."),
    ("cu_seqlens_q", [1, 1, 4], r"cu_seqlens_q does not start at 0"),
    ("max_seqlen_q", 2, r"max_seqlen_q is smaller than a request's length; .* got 2 < 3 "
     r"\(request 1\)\."),
    ("max_seqlen_k", 3, r"max_seqlen_k is smaller than a request's length; .* got 3 < 4 "
     r"\(request 1\)\. Pass max_seqlen_k="),
    ("seqused_k", [3, 1], r"seqused_k is out of range; expected 0 <= seqused_k\[r\] <= "
     r"cu_seqlens_k\[r \+ 1\] - cu_seqlens_k\[r\], got seqused_k\[0\] = 3\."),
]


def _with(inputs, name, value):
    inputs = dict(inputs)
    inputs[name] = value if isinstance(value, int) else torch.tensor(value, **I32)
    return inputs


# op -> (its inputs, the arguments of _value_checks.check_<op> in order)
ATTENTION_OPS = {
    "flash_attn_with_kvcache": (_paged_inputs, ("q", "k_cache", "cache_seqlens", "page_table",
                                                "cu_seqlens_q", "max_seqlen_q")),
    "flash_attn_varlen_func": (_varlen_inputs, ("q", "k", "cu_seqlens_q", "cu_seqlens_k",
                                                "seqused_k", "max_seqlen_q", "max_seqlen_k")),
}
ATTENTION_CASES = ([("flash_attn_with_kvcache", *case) for case in PAGED_CASES]
                   + [("flash_attn_varlen_func", *case) for case in VARLEN_CASES])


@pytest.mark.parametrize("op,name,value,pattern", ATTENTION_CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(ATTENTION_CASES)])
def test_attention_value_check(op, name, value, pattern, xpu_env):
    """Switch on: the op raises ``<op>: <pattern>``; switch off: ``check_<op>`` is silent."""
    make_inputs, check_args = ATTENTION_OPS[op]
    inputs = _with(make_inputs(), name, value)
    xpu_env("XPU_OPS_DEBUG_CHECKS", "1")
    with pytest.raises(ValueError, match=rf"^{op}: " + pattern):
        getattr(xpu_ops, op)(**inputs)
    xpu_env("XPU_OPS_DEBUG_CHECKS", "0")
    check = getattr(_value_checks, f"check_{op}")
    assert check(*[inputs.get(arg) for arg in check_args]) is None


def test_flash_attn_with_kvcache_valid_and_unread_entries(debug):
    """Valid values pass; a garbage page id past a request's last page is never read (API.md)."""
    inputs = _with(_paged_inputs(), "page_table", [[2, 0], [1, 3]])
    inputs["cache_seqlens"] = torch.tensor([2, 4], **I32)
    inputs["page_table"] = torch.tensor([[2, -7], [1, 3]], **I32)
    out = xpu_ops.flash_attn_with_kvcache(**inputs)
    assert out.shape == (3, 2, 8) and torch.isfinite(out).all()
    xpu_ops.flash_attn_with_kvcache(inputs["q"].view(1, 3, 2, 8), inputs["k_cache"],
                                    inputs["v_cache"], cache_seqlens=inputs["cache_seqlens"][:1],
                                    page_table=inputs["page_table"][:1])


def test_max_seqlen_q_too_small_leaves_the_extra_rows_without_the_switch(no_debug):
    """What the switch turns into a named ValueError: without it, rows past a request's first
    max_seqlen_q are not described, so they keep out's contents (the reference raised a bare
    IndexError). tests/ops/test_inconsistent_metadata.py checks every provider."""
    inputs = _with(_paged_inputs(), "max_seqlen_q", 1)
    out = torch.full((3, 2, 8), float("nan"))
    with xpu_ops.use_provider("reference"):
        xpu_ops.flash_attn_with_kvcache(**inputs, out=out)
    assert torch.isfinite(out[:2]).all() and torch.isnan(out[2]).all()


def test_flash_attn_varlen_func_valid(debug):
    out = xpu_ops.flash_attn_varlen_func(**_varlen_inputs(), seqused_k=torch.tensor([2, 3], **I32))
    assert out.shape == (4, 2, 8)
    xpu_ops.flash_attn_varlen_func(**{**_varlen_inputs(), "max_seqlen_q": None,
                                      "max_seqlen_k": None})


@pytest.mark.parametrize("page_table,cache_seqlens,pattern", [
    ([[0, 5]], [3], r"page_table has a page id out of range .* got page_table\[0, 1\] = 5\."),
    ([[0, 1]], [5], r"cache_seqlens is out of range; .* = 4 tokens, got cache_seqlens\[0\] = 5\."),
])
def test_flash_mla_decode(page_table, cache_seqlens, pattern, xpu_env):
    qn, qr, kv = torch.randn(1, 2, 8), torch.randn(1, 2, 4), torch.randn(3, 2, 12)
    ws = torch.empty(xpu_ops.flash_mla_get_workspace_size(4, 1, 2), dtype=torch.uint8)
    pt, lens = torch.tensor(page_table, **I32), torch.tensor(cache_seqlens, **I32)
    xpu_env("XPU_OPS_DEBUG_CHECKS", "1")
    with pytest.raises(ValueError, match=r"^flash_mla_decode: " + pattern):
        xpu_ops.flash_mla_decode(qn, qr, kv, lens, pt, ws, 0.5)
    ok = xpu_ops.flash_mla_decode(qn, qr, kv, torch.tensor([3], **I32), pt.clamp(max=2), ws, 0.5)
    assert ok.shape == (1, 2, 8)
    xpu_env("XPU_OPS_DEBUG_CHECKS", "0")
    assert _value_checks.check_flash_mla_decode(kv, lens, pt) is None


def test_prepare_swa_spec_page_table(xpu_env):
    mask = torch.tensor([[[1, 0], [1, 1]]], dtype=torch.bool)
    table, drafts = torch.tensor([[7, 8, 9]], **I32), torch.tensor([[20, 21]], **I32)
    xpu_env("XPU_OPS_DEBUG_CHECKS", "1")
    with pytest.raises(ValueError, match=r"^prepare_swa_spec_page_table: prefix_lens is out of "
                                         r"range; expected 0 <= prefix_lens <= page_table.shape"
                                         r"\[1\] \(P\) = 3 tokens, got prefix_lens\[0\] = 4\."):
        xpu_ops.prepare_swa_spec_page_table(table, torch.tensor([4], **I32), drafts, mask)
    xpu_ops.prepare_swa_spec_page_table(table, torch.tensor([3], **I32), drafts, mask)
    xpu_env("XPU_OPS_DEBUG_CHECKS", "0")
    assert _value_checks.check_prepare_swa_spec_page_table(table, torch.tensor([4], **I32)) is None


# ---- never while tracing --------------------------------------------------------------------

def test_skipped_for_fake_tensors(debug):
    with FakeTensorMode():
        kc, vc = torch.zeros(4, 1, 2), torch.zeros(4, 1, 2)
        xpu_ops.store_kv_cache(kc, vc, torch.tensor([9]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))


def test_skipped_while_compiling(debug):
    """Under torch.compile the checks are skipped (no .item() in the graph, no graph break);
    the compiled store still skips the out-of-range slot."""
    torch._dynamo.reset()

    def step(kc, vc, loc, k, v):
        xpu_ops.store_kv_cache(kc, vc, loc, k, v)
        return kc.sum()

    kc, vc = torch.zeros(4, 1, 2), torch.zeros(4, 1, 2)
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    compiled(kc, vc, torch.tensor([1, 9]), torch.ones(2, 1, 2), torch.ones(2, 1, 2))
    assert kc[1].sum() == 2 and kc.sum() == 2
    with pytest.raises(ValueError, match="loc has a token slot out of range"):
        step(kc, vc, torch.tensor([1, 9]), torch.ones(2, 1, 2), torch.ones(2, 1, 2))


def test_contiguous_cache_length_names_seqlen_k_not_page_table(debug):
    """Without page_table the wrapper builds a one-page table; a too-long cache_seqlens is
    reported against k_cache.shape[1] (seqlen_k), not a page_table the caller never passed."""
    kc = vc = torch.zeros(2, 16, 1, 8)
    with pytest.raises(ValueError, match=r"cache_seqlens is out of range; expected 0 <= "
                                         r"cache_seqlens <= k_cache.shape\[1\] \(seqlen_k of a "
                                         r"contiguous cache without page_table\) = 16 tokens, "
                                         r"got cache_seqlens\[1\] = 20\."):
        xpu_ops.flash_attn_with_kvcache(torch.zeros(2, 1, 1, 8), kc, vc,
                                        cache_seqlens=torch.tensor([16, 20], **I32))
