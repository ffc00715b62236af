"""The ``triton`` provider equals the ``reference`` provider, on CPU through Triton's interpreter.

Triton must be imported in interpreter mode for that (``tests/ops/triton_mode.py`` explains why
and does it); if something imported Triton earlier in compile mode, this module reruns itself in
a fresh interpreter-mode subprocess. ``xpu_ops.triton`` runs an interpreted copy of its kernels
for CPU tensors. Shapes are tiny: the interpreter executes every tile op through NumPy.
The split-KV tests force split counts and check the in-kernel merge against the float64 oracle;
the interpreter runs programs one after another (the last split of a tile merges), so the
ordering between concurrent programs is left to the gpu suite (``test_triton_gpu.py``).
"""

from __future__ import annotations

import copy

import pytest

from .triton_mode import (INTERPRETED, interpret_while_module_runs,  # noqa: F401  (first)
                          rerun_in_subprocess, tl, triton)

import torch  # noqa: E402

in_subprocess = pytest.mark.skipif(not INTERPRETED, reason="Triton was imported in compile mode "
                                   "before this module; test_rerun_in_subprocess covers it")


test_rerun_in_subprocess = rerun_in_subprocess(__file__)

import xpu_ops  # noqa: E402
import xpu_ops.testing as xt  # noqa: E402

from . import oracle  # noqa: E402
from .utils import assert_matches_oracle  # noqa: E402

OPS = ["flash_attn_with_kvcache", "flash_attn_varlen_func", "merge_state_v2", "flash_mla_decode",
       "flash_mla_prefill", "store_kv_cache", "store_mla_kv_cache", "prepare_swa_spec_page_table",
       "apply_rotary_emb", "merge_state", "store_cache"]


def _run(op, provider, args, kwargs):
    args, kwargs = copy.deepcopy(args), copy.deepcopy(kwargs)
    with xpu_ops.use_provider(provider):
        result = getattr(torch.ops.xpu_ops, op)(*args, **kwargs)
    return result, args


def _tolerance(t: torch.Tensor) -> float:
    return {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(t.dtype, 2e-2)


def _compare(got, want, where: str) -> None:
    if isinstance(got, (tuple, list)):
        for i, (g, w) in enumerate(zip(got, want)):
            _compare(g, w, f"{where}[{i}]")
        return
    if not isinstance(got, torch.Tensor):
        return
    if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # Triton's interpreter rounds fp32 -> fp8 wrongly where rounding carries into the exponent
        # (0.248 -> 0.5 instead of 0.25), a defect of the interpreter, not of the kernel: accept
        # a factor 2 here; the gpu suite (test_triton_gpu.py) requires bit-exact fp8 stores.
        g, w = got.float(), want.float()
        rel = 1.0
        same_nan = torch.isnan(g) & torch.isnan(w)
        close = ((g - w).abs() <= rel * w.abs() + 1e-6) | same_nan
        assert close.all(), f"{where}: fp8 values differ at {int((~close).sum())} elements"
        return
    if not got.is_floating_point():
        assert torch.equal(got, want), where
        return
    both_inf = torch.isinf(got) & torch.isinf(want) & (torch.sign(got) == torch.sign(want))
    assert not torch.isnan(got).any() or torch.isnan(want).any(), f"{where}: NaN in triton output"
    g = torch.where(both_inf, 0.0, got.float()).nan_to_num(nan=12345.0)
    w = torch.where(both_inf, 0.0, want.float()).nan_to_num(nan=12345.0)
    tol = _tolerance(got)
    scale = max(w.abs().max().item(), 1.0) if w.numel() else 1.0
    err = (g - w).abs().max().item() if w.numel() else 0.0
    assert err <= tol * scale, f"{where}: max abs error {err:.3g} > {tol * scale:.3g}"


@in_subprocess
@pytest.mark.parametrize("op", OPS)
def test_triton_matches_reference_on_samples(op):
    """Every sample of ``xpu_ops.testing.sample_inputs``: results and mutated args agree."""
    count = 0
    for args, kwargs in xt.sample_inputs(op, "cpu"):
        want, want_args = _run(op, "reference", args, kwargs)
        got, got_args = _run(op, "triton", args, kwargs)
        _compare(got, want, f"{op} sample {count} result")
        for i, (g, w) in enumerate(zip(got_args, want_args)):
            if op == "flash_mla_decode" and i == 5:
                continue  # the workspace is scratch: its contents are unspecified
            _compare(g, w, f"{op} sample {count} arg {i}")
        count += 1
    assert count > 0


# (q_lens, k_lens, page_size, Hq, Hkv, Dv): decode, GQA 4 (BLOCK_M 16 > 4 rows), an empty cache;
# extend with a request shorter than its queries (first rows see no key) and one with no queries;
# MQA group 6 over 7 rows (two m-blocks of 32; the other request's second block returns early),
# Dv 80 (the merge's 64-column chunks, the second one partly masked).
SPLIT_CASES = [([1, 1, 1], [37, 0, 50], 3, 8, 2, 8),
               ([1, 5, 0, 2, 3], [40, 3, 9, 0, 50], 3, 4, 2, 8), ([7, 2], [45, 20], 4, 6, 1, 80)]
# (window, softcap, sinks): causal, sliding window (whole splits outside it), bidirectional.
SPLIT_MASKS = [((-1, 0), 0.0, False), ((2, 0), 0.0, True), ((5, 2), 2.0, True),
               ((0, -1), 0.0, False)]


def _split_inputs(case, mask, seed):
    """Op arguments and keywords (``oracle.flash_attn_with_kvcache`` order) of a split case."""
    q_lens, k_lens, page, hq, hkv, dv = case
    window, softcap, sinks = mask
    gen = torch.Generator().manual_seed(seed)
    (k, v), table, lens = xt.paged_kv_cache(gen, k_lens, page, [(hkv, 16), (hkv, dv)],
                                            dtype=torch.float32, device="cpu")
    q = torch.randn(sum(q_lens), hq, 16, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    sink = torch.randn(hq, generator=gen) if sinks else None
    out = torch.full((q.shape[0], hq, dv), float("nan"))
    kwargs = dict(max_seqlen_q=max(q_lens), softmax_scale=0.25, causal=False,
                  window_size_left=window[0], window_size_right=window[1], softcap=softcap,
                  num_splits=0, return_softmax_lse=True)
    return [q, k, v, lens, table, cu, out, None, None, None, None, sink, None, None], kwargs


def _split_attention(args, kwargs, num_splits, **buffers):
    """``paged_attention`` with a forced split count into NaN-poisoned ``out`` and LSE."""
    from xpu_ops.triton.paged_attention import paged_attention
    q, k, v, lens, table, cu, out = args[:7]
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"))
    paged_attention(q, k, v, out, lens, cu, page_table=table, cu_seqlens_k=None,
                    max_seqlen_q=kwargs["max_seqlen_q"], max_kv_len=table.shape[1] * k.shape[1],
                    qv=None, q_descale=None, k_descale=None, v_descale=None, sinks=args[11],
                    softmax_scale=kwargs["softmax_scale"], window_left=kwargs["window_size_left"],
                    window_right=kwargs["window_size_right"], softcap=kwargs["softcap"],
                    num_splits=num_splits, lse=lse, **buffers)
    return out, lse


@in_subprocess
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
@pytest.mark.parametrize("mask", SPLIT_MASKS, ids=["causal", "window-sinks", "softcap-sinks",
                                                   "bidirectional"])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=["decode-gqa4", "extend-empty", "mqa6"])
def test_split_kv_merge_matches_oracle(case, mask, num_splits):
    """Forced split counts (the last split program merges in the same launch) against the float64
    oracle: sinks counted once, empty splits weight 0, rows without a visible key 0 / -inf."""
    args, kwargs = _split_inputs(case, mask, seed=num_splits)
    out, lse = _split_attention(args, kwargs, num_splits)
    want, want_lse = oracle.flash_attn_with_kvcache(*args, **kwargs)
    assert_matches_oracle(out, want, torch.float32, lse, want_lse)


@in_subprocess
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv_given_counters_left_zero_for_the_next_launch(num_splits):
    """A caller's counters (the documented size bound) and NaN-poisoned scratch, reused by two
    launches in a row: both match the oracle and leave every counter 0 (as a replay needs)."""
    q_lens, _, _, hq, hkv, _ = case = SPLIT_CASES[1]
    total_q = sum(q_lens)
    tiles = len(q_lens) * hkv * -(-max(q_lens) * (hq // hkv) // 16)
    counters = torch.zeros(tiles, dtype=torch.int32)
    scratch = (torch.full((num_splits, total_q, hq, 16), float("nan")),
               torch.full((num_splits, total_q, hq), float("nan")))
    for seed in (0, 1):
        args, kwargs = _split_inputs(case, SPLIT_MASKS[1], seed)
        out, lse = _split_attention(args, kwargs, num_splits, scratch=scratch, counters=counters)
        want, want_lse = oracle.flash_attn_with_kvcache(*args, **kwargs)
        assert_matches_oracle(out, want, torch.float32, lse, want_lse)
        assert counters.eq(0).all(), counters


@in_subprocess
@pytest.mark.parametrize("counters, problem", [
    (torch.zeros(64, dtype=torch.int64), "torch.int64, contiguous, with 64 entries"),
    (torch.zeros(3, dtype=torch.int32), "torch.int32, contiguous, with 3 entries"),
    (torch.zeros(128, dtype=torch.int32)[::2], "torch.int32, non-contiguous, with 64 entries")])
def test_split_kv_rejects_unusable_counters(counters, problem):
    args, kwargs = _split_inputs(SPLIT_CASES[1], SPLIT_MASKS[0], seed=0)
    with pytest.raises(ValueError, match=f"^paged_attention: counters is {problem}; expected "
                                         f"contiguous torch.int32 with at least 10 "):
        _split_attention(args, kwargs, 2, counters=counters)


# FlashAttention-3 masks through the kernel: (q_lens, k_lens, leftpad, block spans per request as
# (first, last) query rows, window). Block spans cross the BLOCK_N = 16 key tiles and a cached
# prefix; leftpad skips whole tiles and part of one.
FA3_CASES = [((20, 5), (20, 9), (3, 0), ((1, 17), ()), (-1, -1)),
             ((6, 1, 4), (30, 5, 4), (18, 5, 0), ((0, 3), (), (1, 2)), (9, 0))]


@in_subprocess
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("case", FA3_CASES, ids=["prefill-blocks", "prefix-window-leftpad"])
def test_fa3_masks_match_oracle(case, num_splits):
    """cache_leftpad and bidirectional_block_ids (with NaN in the padded slots) under every split
    mode, through the op (provider ``triton``), against the float64 oracle."""
    q_lens, k_lens, leftpad, spans, window = case
    args, kwargs = _split_inputs((list(q_lens), list(k_lens), 4, 4, 2, 16),
                                 ((window[0], 0), 0.0, False), seed=7 + num_splits)
    ids = torch.full((sum(q_lens),), -1, dtype=torch.int32)
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    for block, (r, span) in enumerate((r, s) for r, s in enumerate(spans) if s):
        ids[starts[r] + span[0]:starts[r] + span[1] + 1] = block
    args[12], args[13] = torch.tensor(leftpad, dtype=torch.int32), ids
    xt._poison_slots(args[1], args[2], args[4], leftpad)
    kwargs.update(causal=True, num_splits=num_splits)
    with xpu_ops.use_provider("triton"):
        lse = torch.ops.xpu_ops.flash_attn_with_kvcache(*args, **kwargs)
    want, want_lse = oracle.flash_attn_with_kvcache(*args, **kwargs)
    assert_matches_oracle(args[6], want, torch.float32, lse, want_lse)


@in_subprocess
def test_one_split_results_do_not_depend_on_the_batch():
    """num_splits=1: a request's output is bit-identical alone and inside a larger batch (the
    automatic split count, planned from the batch shape, would split a lone long request)."""
    gen = torch.Generator().manual_seed(11)
    (k, v), table, lens = xt.paged_kv_cache(gen, [200, 3, 90], 8, [(2, 16), (2, 16)],
                                            dtype=torch.float32, device="cpu")
    q = torch.randn(3, 4, 16, generator=gen)

    def run(rows):
        idx = torch.tensor(rows)
        cu = torch.arange(len(rows) + 1, dtype=torch.int32)
        with xpu_ops.use_provider("triton"):
            return xpu_ops.flash_attn_with_kvcache(
                q[idx], k, v, cache_seqlens=lens[idx], page_table=table[idx], cu_seqlens_q=cu,
                max_seqlen_q=1, causal=True, num_splits=1)
    batch = run([0, 1, 2])
    alone = run([0])
    assert torch.equal(batch[:1], alone)
    assert torch.equal(batch[2:], run([2, 1])[:1])


@in_subprocess
@pytest.mark.parametrize("interleaved", [False, True])
def test_append_with_rotary_matches_reference(interleaved):
    """The public wrapper's append path (rotary op, store op, attention op) under the triton
    provider: the same cache writes and output as the reference provider."""
    gen = torch.Generator().manual_seed(21)
    (k_cache, v_cache), table, _ = xt.paged_kv_cache(gen, [9, 12], 4, [(2, 32), (2, 32)],
                                                     dtype=torch.float32, device="cpu")
    lens = torch.tensor([6, 9], dtype=torch.int32)
    q, k, v = (torch.randn(2, 3, h, 32, generator=gen) for h in (4, 2, 2))
    angle = torch.rand(16, 8, generator=gen) * 6.283
    results = []
    for provider in ("reference", "triton"):
        caches = (k_cache.clone(), v_cache.clone())
        with xpu_ops.use_provider(provider):
            out = xpu_ops.flash_attn_with_kvcache(
                q, *caches, k, v, rotary_cos=angle.cos(), rotary_sin=angle.sin(),
                cache_seqlens=lens, page_table=table, causal=True,
                rotary_interleaved=interleaved)
        results.append((out, *caches))
    for got, want in zip(results[1], results[0]):
        _compare(got.nan_to_num(7.0), want.nan_to_num(7.0), "append + rotary")


@in_subprocess
@pytest.mark.parametrize("layout, kernel", [
    ("flat", "_store_kv_plain_kernel"), ("paged", "_store_kv_plain_kernel"),
    ("spaced pages", "_store_kv_kernel"), ("different v rows", "_store_kv_kernel")])
def test_store_takes_the_plain_entry_for_the_plain_form_only(layout, kernel, monkeypatch):
    """``store_kv_cache`` under the triton provider: a flat cache or a paged one of adjacent
    slots, with K and V rows sliced from one fused projection (strided), launches the
    10-argument plain kernel; pages spaced in a larger buffer, or V rows of another layout, the
    full kernel. Either way only in-range slots of ``loc`` change (oracle slot by slot)."""
    from xpu_ops.triton import kv_cache as tkv
    gen = torch.Generator().manual_seed(31)
    slots, hkv, d = 24, 2, 16
    buf = torch.randn(2, slots * 2, hkv, d, generator=gen)
    k_cache, v_cache = buf[0, :slots], buf[1, :slots]                      # [24, 2, 16]
    if layout == "paged":
        k_cache, v_cache = k_cache.view(6, 4, hkv, d), v_cache.view(6, 4, hkv, d)
    elif layout == "spaced pages":                       # every other page of a larger buffer
        k_cache = buf[0].view(12, 4, hkv, d)[::2]
        v_cache = buf[1].view(12, 4, hkv, d)[::2]
    qkv = torch.randn(5, 4 * hkv * d, generator=gen)                       # [T, (Hq + 2 Hkv) D]
    k = qkv[:, 2 * hkv * d:3 * hkv * d].view(5, hkv, d)
    v = qkv[:, 3 * hkv * d:].view(5, hkv, d)
    if layout == "different v rows":
        v = v.contiguous()
    loc = torch.tensor([7, -1, 23, 24, 0])
    want_k = oracle.store_kv(k_cache, loc[[0, 2, 4]], k[[0, 2, 4]])
    want_v = oracle.store_kv(v_cache, loc[[0, 2, 4]], v[[0, 2, 4]])
    launched = []
    real = tkv.launch
    monkeypatch.setattr(tkv, "launch", lambda kern, *a, **kw: launched.append(kern.fn.__name__)
                        or real(kern, *a, **kw))
    with xpu_ops.use_provider("triton"):
        xpu_ops.store_kv_cache(k_cache, v_cache, loc, k, v)
    assert launched == [kernel]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
