"""The shared checks (``xpu_ops/_checks.py``, ``xpu_ops/ops/common.py``) branch by branch, and
the contract that every public wrapper answers a non-tensor with a ``TypeError`` naming it.

The per-op checks are exercised through the wrappers in each op's test module (eager and fake).
"""

from __future__ import annotations

import pytest
import torch

import xpu_ops
from xpu_ops import _checks
from xpu_ops.ops import common
from xpu_ops.testing import ATTENTION_CASES, attention_case_inputs, sample_inputs, \
    varlen_case_inputs

FN = "some_op"


def test_check_tensor_branches():
    t = torch.zeros(2, 3)
    assert _checks.check_tensor(FN, "x", t, ndim=(2, 3), dtypes=(torch.float32,),
                                device=torch.device("cpu")) is t
    with pytest.raises(TypeError, match=r"^some_op: x is not a tensor; expected a torch.Tensor, "
                                        r"got int\.$"):
        _checks.check_tensor(FN, "x", 3)
    with pytest.raises(ValueError, match=r"x has the wrong number of dimensions; expected 3-D or "
                                         r"4-D, got 2-D with shape \(2, 3\)"):
        _checks.check_tensor(FN, "x", t, ndim=(3, 4))
    with pytest.raises(ValueError, match=r"x has dtype torch.float32; expected torch.int32, got "
                                         r"torch.float32\. Build it with dtype=torch.int32\.$"):
        _checks.check_tensor(FN, "x", t, dtypes=(torch.int32,))
    with pytest.raises(ValueError, match=r"expected torch.float16 or torch.bfloat16, got "
                                         r"torch.float32\.$"):
        _checks.check_tensor(FN, "x", t, dtypes=(torch.float16, torch.bfloat16))
    with pytest.raises(ValueError, match=r"x is on the wrong device; expected meta \(the device "
                                         r"of q\), got cpu\. Move it with \.to\(q\.device\)\."):
        _checks.check_tensor(FN, "x", t, device=torch.device("meta"))
    assert _checks.check_optional(FN, "x", None, ndim=5) is None
    with pytest.raises(ValueError, match="x has the wrong number of dimensions"):
        _checks.check_optional(FN, "x", t, ndim=5)
    # ``fix`` is dtype advice: a rank error does not carry it.
    with pytest.raises(ValueError, match=r"x has the wrong number of dimensions; expected 3-D, "
                                         r"got 2-D with shape \(2, 3\)\.$"):
        _checks.check_tensor(FN, "x", t, ndim=3, dtypes=(torch.float32,), fix="Cast it.")


def test_check_same_size_names_the_odd_one_out():
    a, b, c = torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2)
    _checks.check_same_size(FN, "N", ("a", a, 0), ("c", c, 0))
    with pytest.raises(ValueError, match=r"^some_op: b has the wrong size in dimension 0 \(N\); "
                                         r"expected N = 2 as in a.shape\[0\], c.shape\[0\], got "
                                         r"shape \(3, 4\)\.$"):
        _checks.check_same_size(FN, "N", ("a", a, 0), ("b", b, 0), ("c", c, 0))
    with pytest.raises(ValueError, match=r"^some_op: a has the wrong size .* expected N = 3 as in "
                                         r"b.shape\[0\], c.shape\[0\]"):  # majority: b and c
        _checks.check_same_size(FN, "N", ("a", a, 0), ("b", b, 0), ("c", torch.zeros(3), 0))
    with pytest.raises(ValueError, match=r"^some_op: b has .* expected N = 2 as in a.shape\[0\], "
                                         r"got"):  # a tie: the first entry is the reference
        _checks.check_same_size(FN, "N", ("a", a, 0), ("b", b, 0))


def test_check_store_dtypes_names_the_odd_one_out():
    f32, f16, f8 = torch.zeros(1), torch.zeros(1, dtype=torch.half), \
        torch.zeros(1, dtype=torch.float8_e4m3fn)
    _checks.check_store_dtypes(FN, ("k", f32, "kc", f32), ("v", f32, "vc", f8))
    _checks.check_store_dtypes(FN, ("k", f16, "kc", f8), ("v", f16, "vc", f8))
    with pytest.raises(ValueError, match=r"^some_op: vc has dtype torch.float16; expected k's and "
                                         r"v's dtype torch.float32 or an fp8 dtype, got "
                                         r"torch.float16\. Allocate the cache"):
        _checks.check_store_dtypes(FN, ("k", f32, "kc", f32), ("v", f32, "vc", f16))
    with pytest.raises(ValueError, match=r"^some_op: k has dtype torch.float16; expected kc's "
                                         r"dtype torch.float32 \(the cache is not fp8\), got "
                                         r"torch.float16\. Cast it with k.to\(kc.dtype\)\.$"):
        _checks.check_store_dtypes(FN, ("k", f16, "kc", f32), ("v", f32, "vc", f32))
    with pytest.raises(ValueError, match=r"^some_op: v has dtype torch.float32; expected k's dtype "
                                         r"torch.float16, got torch.float32\. Pass k and v in "
                                         r"the same dtype\.$"):
        _checks.check_store_dtypes(FN, ("k", f16, "kc", f8), ("v", f32, "vc", f8))


def test_check_size_shape_contiguous():
    t = torch.zeros(4, 6)
    _checks.check_size(FN, "x", t, 1, 6, "H")
    with pytest.raises(ValueError, match=r"x has the wrong size in dimension 1; expected H = 5, "
                                         r"got shape \(4, 6\)"):
        _checks.check_size(FN, "x", t, 1, 5, "H")
    with pytest.raises(ValueError, match=r"x has the wrong shape; expected \[b, H\] = \(4, 5\), "
                                         r"got \(4, 6\)"):
        _checks.check_shape(FN, "x", t, (4, 5), "[b, H]")
    _checks.check_contiguous_last(FN, "x", t)
    _checks.check_contiguous_last(FN, "x", t.t()[:, :1])      # size-1 last dim: stride irrelevant
    with pytest.raises(ValueError, match=r"x has a non-unit stride in its last dimension.*"
                                         r"Call \.contiguous\(\) on it"):
        _checks.check_contiguous_last(FN, "x", t.t())


def test_check_gqa_and_window():
    _checks.check_gqa(FN, 8, 2)
    for hq, hkv in ((3, 2), (33, 2)):
        with pytest.raises(ValueError, match=f"q/k_cache head counts are incompatible; expected "
                                             f"Hq to be a multiple of Hkv.*Hq={hq}, Hkv={hkv}"):
            _checks.check_gqa(FN, hq, hkv)
    for hq in (4, 0):  # no KV head: asks for Hkv >= 1 (0 is a multiple of anything)
        with pytest.raises(ValueError, match=fr"head counts are incompatible; expected Hkv >= 1 "
                                             fr"\(at least one KV head\) and Hq a multiple of "
                                             fr"Hkv, got Hq={hq}, Hkv=0\.$"):
            _checks.check_gqa(FN, hq, 0)
    assert _checks.check_window(FN, [3, -1]) == (3, -1)
    assert _checks.check_window(FN, (None, None)) == (-1, -1)    # FlashAttention-4's spelling
    assert _checks.check_window(FN, (None, 0)) == (-1, 0)
    with pytest.raises(TypeError, match="window_size is not a pair"):
        _checks.check_window(FN, None)
    with pytest.raises(ValueError, match=r"window_size has a negative bound.*got \(0, -5\)"):
        _checks.check_window(FN, (0, -5))
    assert common.normalize_window(FN, (4, 7), causal=True) == (4, 0)
    assert common.normalize_window(FN, (4, 7), causal=False) == (4, 7)


def test_check_not_implemented():
    _checks.check_not_implemented(FN, a=None, b=False, c=0)
    for value in (torch.zeros(1), 1, True, "x"):
        with pytest.raises(NotImplementedError, match="keyword a is accepted for compatibility"):
            _checks.check_not_implemented(FN, a=value)
    defaults = {"flag": True, "margin": 0, "pack": None}
    _checks.check_not_implemented(FN, defaults, flag=True, margin=0, pack=None)
    _checks.check_not_implemented(FN, defaults, flag=None, margin=None)
    for name, value, rule, got in (("flag", False, "None or True", "False"),
                                   ("flag", 1, "None or True", "1"),
                                   ("margin", 2, "None or 0", "2"),
                                   ("pack", False, "None", "False"),
                                   ("pack", torch.zeros(2), "None", r"a tensor of shape \(2,\)")):
        with pytest.raises(NotImplementedError, match=rf"^some_op: keyword {name} is accepted .*; "
                                                      rf"expected {rule} \(its default\), got "
                                                      rf"{got}\. See"):
            _checks.check_not_implemented(FN, defaults, **{name: value})


def test_check_num_splits():
    for ok in (0, 1, 7, torch.tensor(2).numpy()):
        common.check_num_splits(FN, ok)
    with pytest.raises(ValueError, match=r"^some_op: num_splits is negative; expected 0 "
                                         r"\(automatic\) or a split count >= 1, got -2\.$"):
        common.check_num_splits(FN, -2)
    with pytest.raises(TypeError, match=r"^some_op: num_splits is not an integer; expected an int "
                                        r"\(0: automatic\), got str\.$"):
        common.check_num_splits(FN, "4")


def test_common_helpers():
    q = torch.zeros(2, 4, 8)
    assert common.output_dtype(q) == torch.float32
    assert common.output_dtype(q.to(torch.float8_e5m2)) == torch.bfloat16
    assert common.default_softmax_scale(64) == 0.125
    assert common.default_softmax_scale(64, 192) == 1 / 16
    assert common.float_scalar(FN, "s", torch.tensor(0.5)) == 0.5
    assert common.float_scalar(FN, "s", 2) == 2.0
    with pytest.raises(TypeError, match="s is not a real number; expected a float, got list"):
        common.float_scalar(FN, "s", [1.0])
    with pytest.raises(ValueError, match=r"cu has the wrong size in dimension 0; expected "
                                         r"b \+ 1 = 3"):
        common.check_cu_seqlens(FN, "cu", torch.zeros(2, dtype=torch.int32), 2, q.device)
    with pytest.raises(ValueError, match=r"Build it with dtype=torch.int32 \(e.g. "
                                         r"idx.to\(torch.int32\)\)"):
        common.check_index(FN, "idx", torch.zeros(2, dtype=torch.int64), 1, q.device)


# ----------------------------------------------------------------------------------------------
# A non-tensor where a tensor belongs: TypeError naming the argument (API.md "Bad input")
# ----------------------------------------------------------------------------------------------

def _wrapper_calls():
    a, _ = attention_case_inputs(ATTENTION_CASES[1], "cpu")
    yield "flash_attn_with_kvcache", xpu_ops.flash_attn_with_kvcache, dict(zip(
        ("q", "k_cache", "v_cache", "cache_seqlens", "page_table", "cu_seqlens_q"), a[:6]))
    a, _ = varlen_case_inputs(ATTENTION_CASES[1], "cpu")
    yield "flash_attn_varlen_func", xpu_ops.flash_attn_varlen_func, dict(zip(
        ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"), a[:5]))
    a, _ = next(sample_inputs("merge_state_v2", "cpu"))
    yield "merge_state_v2", xpu_ops.merge_state_v2, dict(zip(("v_a", "s_a", "v_b", "s_b"), a))
    a, _ = next(sample_inputs("flash_mla_decode", "cpu"))
    yield "flash_mla_decode", xpu_ops.flash_mla_decode, dict(zip(
        ("q_nope", "q_rope", "kv_cache", "cache_seqlens", "page_table", "workspace",
         "softmax_scale"), a))
    a, _ = next(sample_inputs("store_kv_cache", "cpu"))
    yield "store_kv_cache", xpu_ops.store_kv_cache, dict(zip(
        ("k_cache", "v_cache", "loc", "k", "v"), a))
    a, _ = next(sample_inputs("store_mla_kv_cache", "cpu"))
    yield "store_mla_kv_cache", xpu_ops.store_mla_kv_cache, dict(zip(
        ("kv_cache", "loc", "k_nope", "k_rope"), a))
    a, _ = next(sample_inputs("prepare_swa_spec_page_table", "cpu"))
    yield "prepare_swa_spec_page_table", xpu_ops.prepare_swa_spec_page_table, dict(zip(
        ("page_table", "prefix_lens", "draft_slots", "custom_mask"), a))


_NON_TENSOR = [pytest.param(name, arg, id=f"{name}-{arg}")
               for name, _, kwargs in _wrapper_calls()
               for arg, v in kwargs.items() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("name,arg", _NON_TENSOR)
def test_wrappers_reject_non_tensors_with_type_error(name, arg):
    _, fn, kwargs = next(c for c in _wrapper_calls() if c[0] == name)
    kwargs[arg] = kwargs[arg].tolist()
    with pytest.raises(TypeError, match=f"^{name}: {arg} is not a tensor"):
        fn(**kwargs)
