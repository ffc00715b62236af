"""Argument errors under ``torch.compile``: every bad call of ``flash_attn_with_kvcache`` (the
cases of ``test_paged_attention_checks``) and ``store_kv_cache`` raises, compiled with
``fullgraph=True``, an error whose text contains the eager message, whether the wrapper's traced
Python or the op's fake rejects it. A change that skips wrapper checks while tracing (to trace
less per attention layer) must keep this.
"""

from __future__ import annotations

import pytest
import torch

import xpu_ops

from .test_paged_attention_checks import _BAD_PARAMS, _bad, _wrapper_inputs

USER_ERRORS = (ValueError, TypeError, NotImplementedError)


def _compiled_call(fn, kwargs):
    """``fn(**kwargs)`` compiled with ``fullgraph=True`` (Dynamo only), from a fresh state."""
    torch._dynamo.reset()
    return torch.compile(lambda kw: fn(**kw), backend="eager", fullgraph=True)(kwargs)


def _attention_kwargs():
    """``XPUAttentionBackend``'s call form: packed q with out, max_seqlen_q, softmax_scale."""
    t, _, kw = _wrapper_inputs()
    q, vc = t["q"], t["v_cache"]
    out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"))
    return dict(t, out=out, max_seqlen_q=kw["max_seqlen_q"], softmax_scale=kw["softmax_scale"],
                causal=True, window_size=(-1, 0), softcap=0.0)


@pytest.mark.parametrize("name", _BAD_PARAMS)
def test_attention_compiled_errors_carry_the_eager_message(name):
    t, args, _ = _wrapper_inputs()
    change = _bad(t, args)[name][0]
    _assert_same_error(xpu_ops.flash_attn_with_kvcache, {**_attention_kwargs(), **change})


def _assert_same_error(fn, kwargs):
    """``fn(**kwargs)`` fails eagerly with a user error whose text the compiled call carries."""
    with pytest.raises(USER_ERRORS) as eager:
        fn(**kwargs)
    with pytest.raises(Exception) as compiled:
        _compiled_call(fn, kwargs)
    assert str(eager.value) in str(compiled.value)


def _store_kwargs():
    gen = torch.Generator().manual_seed(0)
    cache = lambda: torch.zeros(12, 2, 8)  # noqa: E731
    return dict(k_cache=cache(), v_cache=cache(), loc=torch.tensor([7, 2, 9]),
                k=torch.randn(3, 2, 8, generator=gen), v=torch.randn(3, 2, 8, generator=gen))


@pytest.mark.parametrize("change", [
    dict(k=torch.zeros(3, 2, 8, dtype=torch.float64)), dict(k=torch.zeros(3, 16)),
    dict(v=torch.zeros(2, 2, 8)), dict(loc=torch.tensor([7, 2, 9], dtype=torch.int16)),
    dict(k_cache=torch.zeros(12, 3, 8)), dict(v_cache=torch.zeros(11, 2, 8)),
    dict(loc=[7, 2, 9]), dict(k_scale=torch.ones(1))],
    ids=["k float64", "k 2-D", "v tokens", "loc int16", "k_cache heads", "v_cache slots",
         "loc list", "scale without fp8"])
def test_store_compiled_errors_carry_the_eager_message(change):
    _assert_same_error(xpu_ops.store_kv_cache, {**_store_kwargs(), **change})
