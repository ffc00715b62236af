"""Which attention kernel a call binds, and how many arguments Triton's binder sees.

The plain form of a call (paged cache, K and V with the same strides, unit-stride metadata,
none of the rare features, the launcher's own scratch) takes ``_paged_attention_plain_kernel``
(27 arguments and 16 constexprs, plus ``num_warps``/``num_stages``); every other call takes
``_paged_attention_kernel`` (67 and 25). Both run the same program (``_attend``), so each case
also checks the result against the float64 oracle under Triton's interpreter.
"""

from __future__ import annotations

import pytest

from .triton_mode import INTERPRETED, rerun_in_subprocess, tl, triton  # noqa: F401  (first)

import torch  # noqa: E402

import xpu_ops.testing as xt  # noqa: E402
from xpu_ops.triton import paged_attention as pa  # noqa: E402

from . import oracle  # noqa: E402
from .utils import assert_matches_oracle  # noqa: E402

in_subprocess = pytest.mark.skipif(not INTERPRETED, reason="Triton was imported in compile mode "
                                   "before this module; test_rerun_in_subprocess covers it")
test_rerun_in_subprocess = rerun_in_subprocess(__file__)

PLAIN, FULL = "_paged_attention_plain_kernel", "_paged_attention_kernel"


@pytest.fixture(autouse=True, scope="module")
def _interpret():  # Triton's lazily imported modules check the interpreter flag at launch time
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    yield
    mp.undo()


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
    assert positional + len(keywords) == (45 if kernel == PLAIN else 94)
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
