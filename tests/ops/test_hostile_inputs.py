"""Edge values, unclear errors, silent acceptances and gradients.

Each test reproduces one report and states the behaviour API.md now promises; both
providers run (Triton through its interpreter on tiny shapes).
"""

from __future__ import annotations

import math
import re

import pytest

from .triton_mode import provider_params, rerun_in_subprocess, running  # first

import torch  # noqa: E402

import xpu_ops  # noqa: E402
from xpu_ops.testing import REGISTERED_OPS, op_name, sample_inputs  # noqa: E402

from . import oracle  # noqa: E402
from .utils import OUT_TOL, assert_matches_oracle, error_message, skip_if_unimplemented  # noqa: E402

I32 = torch.int32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PROVIDERS = provider_params()
test_rerun_in_subprocess = rerun_in_subprocess(__file__)


def _paged_call(seed=0, d=16, **overrides):
    """Keyword arguments of a small ``flash_attn_with_kvcache`` call (2 requests, page 4)."""
    gen = torch.Generator().manual_seed(seed)
    kwargs = dict(q=torch.randn(3, 4, d, generator=gen),
                  k_cache=torch.randn(4, 4, 2, d, generator=gen),
                  v_cache=torch.randn(4, 4, 2, d, generator=gen),
                  cache_seqlens=torch.tensor([5, 3], dtype=I32),
                  page_table=torch.tensor([[2, 0], [3, 1]], dtype=I32),
                  cu_seqlens_q=torch.tensor([0, 2, 3], dtype=I32), causal=True)
    kwargs.update(overrides)
    return kwargs


def _varlen_call(seed=0, d=16, **overrides):
    gen = torch.Generator().manual_seed(seed)
    kwargs = dict(q=torch.randn(3, 2, d, generator=gen), k=torch.randn(7, 1, d, generator=gen),
                  v=torch.randn(7, 1, d, generator=gen),
                  cu_seqlens_q=torch.tensor([0, 1, 3], dtype=I32),
                  cu_seqlens_k=torch.tensor([0, 4, 7], dtype=I32))
    kwargs.update(overrides)
    return kwargs


def _paged_oracle(call, softcap=0.0, sinks=None):
    q = call["q"]
    return oracle.flash_attn_with_kvcache(
        q, call["k_cache"], call["v_cache"], call["cache_seqlens"], call["page_table"],
        call["cu_seqlens_q"], None, None, None, None, None, sinks, max_seqlen_q=q.shape[0],
        softmax_scale=call.get("softmax_scale", q.shape[-1] ** -0.5), causal=call.get("causal", False),
        window_size_left=-1, window_size_right=-1, softcap=softcap)


# ---- unclear errors and silent acceptances -------------------------------------------

@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("call, kwargs, expected", [
    (xpu_ops.flash_attn_with_kvcache, _paged_call(window_size=(2.5, 0)),
     r"TypeError: flash_attn_with_kvcache: window_size has a side that is not an integer; "
     r"expected \(left, right\) of ints, -1 or None for unbounded, got \(2\.5, 0\)\. Pass"),
    (xpu_ops.flash_attn_varlen_func, _varlen_call(window_size=(3, "4")),
     r"TypeError: flash_attn_varlen_func: window_size has a side that is not an integer; .* "
     r"got \(3, '4'\)"),
    (xpu_ops.flash_attn_with_kvcache, _paged_call(max_seqlen_q=2.0),
     r"TypeError: flash_attn_with_kvcache: max_seqlen_q is not an integer; expected an int "
     r"number of tokens \(or None\), got 2\.0 \(float\)\. Pass int\(max_seqlen_q\)\."),
    (xpu_ops.flash_attn_varlen_func, _varlen_call(max_seqlen_q=2.5),
     r"TypeError: flash_attn_varlen_func: max_seqlen_q is not an integer; .* got 2\.5 \(float\)"),
    (xpu_ops.flash_attn_varlen_func, _varlen_call(max_seqlen_k=4.0),
     r"TypeError: flash_attn_varlen_func: max_seqlen_k is not an integer; .* got 4\.0 \(float\)"),
    (xpu_ops.flash_attn_with_kvcache,
     _paged_call(q=torch.randn(3, 4, 0), k_cache=torch.randn(4, 4, 2, 0)),
     r"ValueError: flash_attn_with_kvcache: q has head dimension 0; expected D >= 1 \(the last "
     r"dimension\), got shape \(3, 4, 0\)\."),
    (xpu_ops.flash_attn_with_kvcache,
     _paged_call(q=torch.randn(3, 4, 0), k_cache=torch.randn(4, 4, 2, 0), softmax_scale=1.0),
     r"ValueError: flash_attn_with_kvcache: q has head dimension 0"),
    (xpu_ops.flash_attn_varlen_func,
     _varlen_call(q=torch.randn(3, 2, 0), k=torch.randn(7, 1, 0)),
     r"ValueError: flash_attn_varlen_func: q has head dimension 0"),
    (xpu_ops.flash_attn_with_kvcache, _paged_call(softcap="30"),
     r"TypeError: flash_attn_with_kvcache: softcap is not a real number; expected a float, got "
     r"'30' \(str\)"),
    (xpu_ops.store_kv_cache, dict(k_cache=torch.zeros(8, 2, 4, dtype=E4M3),
                                  v_cache=torch.zeros(8, 2, 4, dtype=E4M3), loc=torch.tensor([1]),
                                  k=torch.ones(1, 2, 4), v=torch.ones(1, 2, 4), k_scale="1.0"),
     r"TypeError: store_kv_cache: k_scale is not a real number; expected a float, got '1\.0' "
     r"\(str\)"),
    (xpu_ops.store_kv_cache, dict(k_cache=torch.zeros(8, 2, 4, dtype=E4M3),
                                  v_cache=torch.zeros(8, 2, 4, dtype=E4M3), loc=torch.tensor([1]),
                                  k=torch.ones(1, 2, 4), v=torch.ones(1, 2, 4), v_scale=0.0),
     r"ValueError: store_kv_cache: v_scale is not a positive finite number; expected 0 < scale "
     r"< inf \(the fp8 cache stores rows / scale\), got 0\.0\."),
], ids=["window-None", "varlen-window-None", "max_seqlen_q-float", "varlen-max_seqlen_q-float",
        "varlen-max_seqlen_k-float", "head-dim-0", "head-dim-0-scaled", "varlen-head-dim-0",
        "softcap-str", "k_scale-str", "v_scale-zero"])
def test_bad_argument_names_itself(call, kwargs, expected, fake):
    message = error_message(call, kwargs, fake)
    assert re.match(expected, message), message


def _mla_decode_call(scale):
    ws = torch.empty(xpu_ops.flash_mla_get_workspace_size(4, 1, 2), dtype=torch.uint8)
    return dict(q_nope=torch.randn(1, 2, 8), q_rope=torch.randn(1, 2, 4),
                kv_cache=torch.randn(1, 4, 12), cache_seqlens=torch.tensor([3], dtype=I32),
                page_table=torch.tensor([[0]], dtype=I32), workspace=ws, softmax_scale=scale)


def _mla_prefill_call(scale):
    return dict(q_nope=torch.randn(2, 3, 8), q_pe=torch.randn(2, 3, 4),
                kv_c_and_k_pe_cache=torch.randn(2, 4, 12),
                cu_seqlens_q=torch.tensor([0, 2], dtype=I32),
                seq_lens_k=torch.tensor([6], dtype=I32), max_seqlen_q=2,
                page_table=torch.tensor([[1, 0]], dtype=I32),
                workspace=torch.empty(0, dtype=torch.uint8), sm_scale=scale)


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("call, kwargs, arg, got", [
    (xpu_ops.flash_attn_with_kvcache, _paged_call(softmax_scale=math.nan), "softmax_scale", "nan"),
    (xpu_ops.flash_attn_with_kvcache, _paged_call(softmax_scale=math.inf, window_size=(2, 0)),
     "softmax_scale", "inf"),
    (xpu_ops.flash_attn_varlen_func, _varlen_call(softmax_scale=-math.inf), "softmax_scale",
     "-inf"),
    (xpu_ops.flash_mla_decode, _mla_decode_call(math.nan), "softmax_scale", "nan"),
    (xpu_ops.flash_mla_prefill, _mla_prefill_call(math.inf), "sm_scale", "inf"),
], ids=["paged-plain-nan", "paged-window-inf", "varlen-minus-inf", "mla-decode-nan",
        "mla-prefill-inf"])
def test_a_non_finite_softmax_scale_names_itself(call, kwargs, arg, got, fake):
    """NaN/inf scales made every output NaN silently (as softcap=NaN does not): now a
    ValueError naming the argument, on the plain decode path and the general ones."""
    message = error_message(call, kwargs, fake)
    assert message == (f"ValueError: {call.__name__}: {arg} is not finite; expected a finite "
                       f"float (it multiplies every score), got {got}."), message


def _paged_op_call(**scalars):
    """Keyword arguments of the raw ``torch.ops.xpu_ops.flash_attn_with_kvcache`` for
    ``_paged_call``'s tensors (all schema arguments explicit), with ``scalars`` changed."""
    call = _paged_call()
    args = dict(q=call["q"], k_cache=call["k_cache"], v_cache=call["v_cache"],
                cache_seqlens=call["cache_seqlens"], page_table=call["page_table"],
                cu_seqlens_q=call["cu_seqlens_q"], out=torch.empty(3, 4, 16), qv=None,
                q_descale=None, k_descale=None, v_descale=None, sinks=None, cache_leftpad=None,
                bidirectional_block_ids=None, max_seqlen_q=2, softmax_scale=0.25, causal=True,
                window_size_left=-1, window_size_right=0, softcap=0.0, num_splits=0,
                return_softmax_lse=False)
    return {**args, **scalars}


def _varlen_op_call(**scalars):
    """The raw ``torch.ops.xpu_ops.flash_attn_varlen_func``'s arguments for ``_varlen_call``."""
    call = _varlen_call()
    args = dict(call, out=torch.empty(3, 2, 16), seqused_k=None, qv=None, q_descale=None,
                k_descale=None, v_descale=None, sinks=None, seqused_q=None, max_seqlen_q=2,
                max_seqlen_k=4, softmax_scale=0.25, causal=False, window_size_left=-1,
                window_size_right=-1, softcap=0.0, num_splits=1)
    return {**args, **scalars}


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("op, kwargs, message", [
    ("flash_attn_with_kvcache", _paged_op_call(softmax_scale=math.nan),
     "softmax_scale is not finite; expected a finite float (it multiplies every score), got nan."),
    ("flash_attn_with_kvcache", _paged_op_call(window_size_left=-5),
     "window_size_left is below -1; expected an int >= -1 (-1: unbounded), got -5."),
    ("flash_attn_varlen_func", _varlen_op_call(softmax_scale=math.inf),
     "softmax_scale is not finite; expected a finite float (it multiplies every score), got inf."),
    ("flash_attn_varlen_func", _varlen_op_call(window_size_right=-2),
     "window_size_right is below -1; expected an int >= -1 (-1: unbounded), got -2."),
], ids=["paged-nan-scale", "paged-left-5", "varlen-inf-scale", "varlen-right-2"])
def test_the_raw_op_checks_its_scalars_as_the_wrapper_does(op, kwargs, message, fake):
    """A direct ``torch.ops`` call with a NaN scale or a window side below -1 ran and wrote NaN
    or zeros; the op (and its fake) now refuse it, naming the argument."""
    got = error_message(getattr(torch.ops.xpu_ops, op).default, kwargs, fake)
    assert got == f"ValueError: {op}: {message}", got


@pytest.mark.parametrize("call, kwargs", [
    (xpu_ops.flash_attn_with_kvcache, _paged_call(causal="False")),
    (xpu_ops.flash_attn_with_kvcache, _paged_call(return_softmax_lse=None)),
    (xpu_ops.flash_attn_varlen_func, _varlen_call(causal="False")),
    (xpu_ops.flash_attn_varlen_func, _varlen_call(return_softmax_lse=2)),
], ids=["paged-causal-str", "paged-lse-None", "varlen-causal-str", "varlen-lse-2"])
def test_a_flag_that_is_not_a_bool_names_itself(call, kwargs):
    """``causal="False"`` ran causal attention (read by truthiness); a flag must be a bool (or
    an int 0/1), else a TypeError naming it and what it got."""
    arg = "causal" if isinstance(kwargs.get("causal"), str) else "return_softmax_lse"
    value = kwargs[arg]
    message = error_message(call, kwargs, fake=False)
    assert message == (f"TypeError: {call.__name__}: {arg} is not a bool; expected True or "
                       f"False, got {value!r} ({type(value).__name__})."), message


def test_an_int_flag_reads_as_its_bool():
    """``causal=1`` (an int 0/1, as C-style callers pass it) is ``causal=True``."""
    assert torch.equal(xpu_ops.flash_attn_with_kvcache(**_paged_call(causal=1)),
                       xpu_ops.flash_attn_with_kvcache(**_paged_call(causal=True)))


@pytest.mark.parametrize("scale", [-0.5, 0.0])
def test_a_negative_or_zero_softmax_scale_is_legal(scale):
    """Any finite scale multiplies the scores (API.md): -0.5 and 0 match the float64 oracle."""
    call = _paged_call(seed=3, softmax_scale=scale)
    want, _ = _paged_oracle(call)
    got = xpu_ops.flash_attn_with_kvcache(**call)
    assert_matches_oracle(got, want, torch.float32)


@pytest.mark.parametrize("value, kind", [("2", "'2' (str)"), (1.5, "1.5 (float)"),
                                         (None, "None (NoneType)")])
def test_num_kv_splits_must_be_an_int(value, kind):
    with pytest.raises(TypeError, match=r"^flash_mla_get_workspace_size: num_kv_splits is not an "
                       rf"integer; expected an int, got {re.escape(kind.split(' (')[0])}\."):
        xpu_ops.flash_mla_get_workspace_size(64, 2, 4, num_kv_splits=value)
    qn, qr, kv = torch.randn(1, 2, 8), torch.randn(1, 2, 4), torch.randn(1, 4, 12)
    ws = torch.empty(xpu_ops.flash_mla_get_workspace_size(4, 1, 2), dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"^flash_mla_decode: num_kv_splits is not an integer"):
        xpu_ops.flash_mla_decode(qn, qr, kv, torch.tensor([3], dtype=I32),
                                 torch.tensor([[0]], dtype=I32), ws, 0.5, num_kv_splits=value)


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
def test_strided_mla_workspace_names_itself(fake):
    """The workspace is reinterpreted as float32 partials: a strided one is a ValueError naming
    it, not a RuntimeError from ``.view()``."""
    size = xpu_ops.flash_mla_get_workspace_size(4, 1, 2)
    kwargs = dict(q_nope=torch.randn(1, 2, 8), q_rope=torch.randn(1, 2, 4),
                  kv_cache=torch.randn(1, 4, 12), cache_seqlens=torch.tensor([3], dtype=I32),
                  page_table=torch.tensor([[0]], dtype=I32),
                  workspace=torch.zeros(2 * size, dtype=torch.uint8)[::2], softmax_scale=0.5)
    message = error_message(xpu_ops.flash_mla_decode, kwargs, fake)
    assert message.startswith("ValueError: flash_mla_decode: workspace has a non-unit stride "
                              "in its last dimension; expected stride 1, got strides (2,)."), message


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, E4M3], ids=["fp32", "e4m3"])
def test_store_into_pages_that_are_not_adjacent(provider, cache_dtype):
    """A paged cache viewed out of a wider buffer (page stride > page_size * slot stride) is
    written at exactly the addressed slots; the rest of the buffer keeps its bytes."""
    gen = torch.Generator().manual_seed(3)
    buffer = torch.randn(4, 7, 2, 8, generator=gen).to(cache_dtype)
    k_cache = buffer[:, 1:5]                                      # 4 pages of 4 slots, gapped
    v_cache = torch.randn(4, 4, 2, 8, generator=gen).to(cache_dtype)
    loc = torch.tensor([13, 2, 7])
    # Values exact in the cache dtype: Triton's interpreter rounds some fp32 -> fp8 wrongly.
    k, v = (torch.randn(3, 2, 8, generator=gen).to(cache_dtype).float() for _ in range(2))
    want_k, want_v = oracle.store_kv(k_cache, loc, k), oracle.store_kv(v_cache, loc, v)
    outside = torch.cat([buffer[:, :1], buffer[:, 5:]], 1).clone()
    with running(provider):
        xpu_ops.store_kv_cache(k_cache, v_cache, loc, k, v)
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))
    assert torch.equal(torch.cat([buffer[:, :1], buffer[:, 5:]], 1).view(torch.uint8),
                       outside.view(torch.uint8))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_store_mla_into_a_strided_cache(provider):
    buffer = torch.randn(6, 3, 1, 24)
    kv_cache = buffer[:, 1:]                                      # [6 pages, 2 slots, 1, 24]
    loc = torch.tensor([11, 0, 5])
    k_nope, k_rope = torch.randn(3, 1, 16), torch.randn(3, 1, 8)
    want = oracle.store_kv(kv_cache, loc, torch.cat([k_nope, k_rope], -1))
    first = buffer[:, :1].clone()
    with running(provider):
        xpu_ops.store_mla_kv_cache(kv_cache, loc, k_nope, k_rope)
    assert torch.equal(kv_cache, want) and torch.equal(buffer[:, :1], first)


@pytest.mark.parametrize("store", ["store_kv_cache", "store_mla_kv_cache"])
def test_duplicate_loc_entries_raise_under_debug_checks(store):
    cache = torch.zeros(8, 1, 6)
    loc = torch.tensor([4, 1, 6, 1, 4])
    if store == "store_kv_cache":
        call = lambda: xpu_ops.store_kv_cache(cache, cache.clone(), loc, torch.ones(5, 1, 6),  # noqa: E731
                                              torch.ones(5, 1, 6))
    else:
        call = lambda: xpu_ops.store_mla_kv_cache(cache, loc, torch.ones(5, 1, 4),  # noqa: E731
                                                  torch.ones(5, 1, 2))
    with xpu_ops.debug_checks(), pytest.raises(
            ValueError, match=rf"^{store}: loc has a repeated token slot; expected distinct "
                              r"slots \(one row per slot\), got loc\[3\] = 1 = loc\[1\]\. Give "):
        call()
    call()  # checks off: accepted (which row lands is unspecified), no error


def test_zero_tensor_scale_raises_under_debug_checks():
    cache = torch.zeros(8, 2, 4, dtype=E4M3)
    call = lambda scale: xpu_ops.store_kv_cache(cache, cache.clone(), torch.tensor([1]),  # noqa: E731
                                                torch.ones(1, 2, 4), torch.ones(1, 2, 4),
                                                k_scale=torch.ones(1), v_scale=scale)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with xpu_ops.debug_checks(), pytest.raises(
                ValueError, match=r"^store_kv_cache: v_scale is not a positive finite number; "
                                  rf"expected 0 < scale < inf .*, got {bad}\. "):
            call(torch.tensor([bad]))
    with xpu_ops.debug_checks():
        call(torch.tensor([2.0]))
        assert cache.float()[1].eq(1.0).all()


# ---- edge values ------------------------------------------------------------------

@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("cache_dtype, big", [(E4M3, 448.0), (E5M2, 57344.0)],
                         ids=["e4m3", "e5m2"])
def test_fp8_store_saturates_out_of_range_values(provider, cache_dtype, big):
    """Both providers clamp to the fp8 type's largest finite value (with its sign); NaN stays
    NaN. Before, Triton stored NaN where the reference saturated."""
    k = torch.tensor([[[1e6, -1e6, math.inf, -math.inf, 3.0 * big, math.nan, 1.0, -2.0]]])
    k_cache = torch.zeros(4, 1, 8, dtype=cache_dtype)
    with running(provider):
        xpu_ops.store_kv_cache(k_cache, k_cache.clone(), torch.tensor([2]), k, k.clone())
        xpu_ops.store_kv_cache(k_cache, k_cache.clone(), torch.tensor([3]), k, k.clone(),
                               k_scale=0.5, v_scale=0.5)
    got = k_cache.float()
    # Triton's CPU interpreter converts NaN to fp8 as a finite value (its own rounding code, not
    # the kernel: the kernel passes NaN through); test_fp8_store_saturates_on_gpu checks NaN.
    cols = [0, 1, 2, 3, 4, 6, 7] if provider == "triton" else list(range(8))
    want = torch.tensor([big, -big, big, -big, big, math.nan, 1.0, -2.0])
    torch.testing.assert_close(got[2, 0, cols], want[cols], equal_nan=True, atol=0, rtol=0)
    want = torch.tensor([big, -big, big, -big, big, math.nan, 2.0, -4.0])
    torch.testing.assert_close(got[3, 0, cols], want[cols], equal_nan=True, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_store_saturates_on_gpu(cache_dtype):
    """On a GPU the Triton store equals the reference byte for byte, NaN and overflow included."""
    k = torch.tensor([[[1e6, -1e6, math.inf, -math.inf, 1e5, math.nan, 1.0, -2.0]]],
                     device="cuda")
    caches = {}
    for provider in ("reference", "triton"):
        cache = torch.zeros(4, 1, 8, dtype=cache_dtype, device="cuda")
        with xpu_ops.use_provider(provider):
            xpu_ops.store_kv_cache(cache, cache.clone(), torch.tensor([2], device="cuda"), k,
                                   k.clone())
        caches[provider] = cache.view(torch.uint8)
    assert torch.equal(caches["reference"], caches["triton"])
    assert torch.isnan(caches["triton"].view(cache_dtype)[2, 0, 5].float())


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("softcap, oracle_softcap", [
    (math.inf, 0.0), (1e30, 0.0), (1e6, 0.0), (50.0, 50.0), (4.0, 4.0), (0.5, 0.5)],
    ids=["inf", "1e30", "1e6", "50", "4", "0.5"])
def test_softcap_is_exact_and_a_huge_cap_is_no_cap(provider, softcap, oracle_softcap):
    """``softcap = inf`` is the limit of the cap (no cap), never NaN; large finite caps tend to
    it within float32 accuracy (Triton's tanh was 2e-4 off at 1e6 and uniform at 1e30), and
    moderate caps are exact across tanh's range (series for small |s / softcap|)."""
    call = _paged_call(seed=2, q=torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(9))
                       * 6, softmax_scale=0.5)
    want, want_lse = _paged_oracle(call, softcap=oracle_softcap)
    with running(provider):
        out, lse = xpu_ops.flash_attn_with_kvcache(**call, softcap=softcap,
                                                   return_softmax_lse=True)
    assert_matches_oracle(out, want, torch.float32, lse, want_lse)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_empty_rows_with_minus_inf_sinks_are_zero(provider):
    """A row with no visible key and a sink of ``-inf`` has nothing in its softmax: output 0 and
    LSE ``-inf`` (Triton gave NaN), while rows with keys are unaffected by the sink."""
    call = _paged_call(seed=4, cache_seqlens=torch.tensor([5, 0], dtype=I32),
                       q=torch.randn(3, 4, 16))
    sinks = torch.tensor([-math.inf, -math.inf, 0.5, -math.inf])
    want, want_lse = _paged_oracle(call, sinks=sinks)
    out = torch.full((3, 4, 16), math.nan)
    with running(provider):
        _, lse = xpu_ops.flash_attn_with_kvcache(**call, sinks=sinks, out=out,
                                                 return_softmax_lse=True)
    assert torch.equal(out[2, [0, 1, 3]], torch.zeros(3, 16))
    assert torch.isneginf(lse[[0, 1, 3], 2]).all()
    assert_matches_oracle(out, want, torch.float32, lse, want_lse)


# ---- gradients --------------------------------------------------------------------

def _written(op) -> set[int]:
    """Positions of the arguments ``op`` mutates."""
    return {i for i, arg in enumerate(op.default._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write}


def _outputs(result, args, op):
    """The op's results plus its mutated arguments (what it writes)."""
    mutated = [a for i, a in enumerate(args) if i in _written(op) and a is not None]
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    return [t for t in results + mutated if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("op", [op for op in REGISTERED_OPS  # their inputs are all integer/bool
                                if op_name(op) not in ("prepare_swa_spec_page_table",
                                                       "convert_vertical_slash_indexes")],
                         ids=op_name)
def test_ops_are_not_differentiable_on_every_provider(provider, op):
    """Under grad mode, with an input that requires grad, every op runs (sgl-kernel's tests call
    them so) and no output requires grad, on every provider (the reference used to record a
    graph through its PyTorch code, Triton none); the values equal the ``no_grad`` call's."""
    skip_if_unimplemented(provider, op)
    args, kwargs = next(a for a in sample_inputs(op, "cpu")
                        if any(isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
                               for t in a[0]))
    i = next(i for i, a in enumerate(args) if i not in _written(op)  # an input, not a buffer
             and isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel())
    grad_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    grad_args[i] = grad_args[i].requires_grad_()
    plain_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with running(provider):
        got = _outputs(op(*grad_args, **kwargs), grad_args, op)
        with torch.no_grad():
            want = _outputs(op(*plain_args, **kwargs), plain_args, op)
    assert got and not any(t.requires_grad for t in got)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True, rtol=0, atol=0)


def test_backward_through_an_op_is_autograd_error():
    call = _paged_call(q=torch.randn(3, 4, 16, requires_grad=True))
    out = xpu_ops.flash_attn_with_kvcache(**call)
    assert not out.requires_grad and out.grad_fn is None
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()
    want, _ = _paged_oracle(call)
    torch.testing.assert_close(out.double(), want, **OUT_TOL[torch.float32])


def test_traced_call_under_grad_mode_has_no_graph_either():
    call = _paged_call(q=torch.randn(3, 4, 16, requires_grad=True))
    compiled = torch.compile(xpu_ops.flash_attn_with_kvcache, backend="aot_eager", fullgraph=True)
    out = compiled(**call)
    assert not out.requires_grad
    want, _ = _paged_oracle(call)
    torch.testing.assert_close(out.double(), want, **OUT_TOL[torch.float32])


def test_none_window_sides_are_unbounded_as_in_flashattention_4():
    call = _varlen_call(seed=3)
    want = xpu_ops.flash_attn_varlen_func(**call, window_size=(-1, 0))
    got = xpu_ops.flash_attn_varlen_func(**call, window_size=(None, 0))
    assert torch.equal(got, want)
