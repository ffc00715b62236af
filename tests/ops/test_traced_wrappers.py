"""Public wrappers while ``torch.compile`` traces them: the plain call goes straight to the op.

``flash_attn_with_kvcache`` and ``store_kv_cache`` skip their Python argument checks while Dynamo
traces a call those checks cannot reject (the op's fake repeats every shape check), so a model
does not trace them once per attention layer. What must not change: eager calls, results, and
the message of every error, eager or compiled.
"""

from __future__ import annotations

import pytest
import torch

import xpu_ops
from xpu_ops.ops import kv_cache, paged_attention

from .test_paged_attention_checks import _BAD_PARAMS, _bad, _wrapper_inputs

USER_ERRORS = (ValueError, TypeError, NotImplementedError)


def _compiled_call(fn, kwargs):
    """``fn(**kwargs)`` compiled with ``fullgraph=True`` (Dynamo only), from a fresh state."""
    torch._dynamo.reset()
    return torch.compile(lambda kw: fn(**kw), backend="eager", fullgraph=True)(kwargs)


def _traced_checks_raise(monkeypatch, module):
    """Make the wrapper's first check raise, so a test sees whether the wrapper ran it."""
    def traced(*args, **kwargs):
        raise AssertionError("wrapper checks ran")
    monkeypatch.setattr(module, "tensors_or_none", traced)


def _attention_kwargs():
    """``XPUAttentionBackend``'s call form: packed q with out, max_seqlen_q, softmax_scale."""
    t, _, kw = _wrapper_inputs()
    q, vc = t["q"], t["v_cache"]
    out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"))
    return dict(t, out=out, max_seqlen_q=kw["max_seqlen_q"], softmax_scale=kw["softmax_scale"],
                causal=True, window_size=(-1, 0), softcap=0.0)


def test_attention_skips_wrapper_checks_only_while_compiling(monkeypatch):
    kwargs = _attention_kwargs()
    ref = xpu_ops.flash_attn_with_kvcache(**kwargs).clone()
    _traced_checks_raise(monkeypatch, paged_attention)
    with pytest.raises(AssertionError, match="wrapper checks ran"):
        xpu_ops.flash_attn_with_kvcache(**kwargs)  # eager: every check, as before
    kwargs["out"] = torch.full_like(ref, float("nan"))
    out = _compiled_call(xpu_ops.flash_attn_with_kvcache, kwargs)
    assert out is kwargs["out"]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("change", [dict(out=None), dict(max_seqlen_q=None),
                                    dict(softmax_scale=None), dict(sinks=[1.0])],
                         ids=["no out", "no max_seqlen_q", "no softmax_scale", "sinks list"])
def test_attention_other_calls_trace_every_check(monkeypatch, change):
    _traced_checks_raise(monkeypatch, paged_attention)
    with pytest.raises(Exception, match="wrapper checks ran"):
        _compiled_call(xpu_ops.flash_attn_with_kvcache, {**_attention_kwargs(), **change})


@pytest.mark.parametrize("name", _BAD_PARAMS)
def test_attention_compiled_errors_carry_the_eager_message(name):
    t, args, _ = _wrapper_inputs()
    change = _bad(t, args)[name][0]
    kwargs = {**_attention_kwargs(), **change}
    with pytest.raises(USER_ERRORS) as eager:
        xpu_ops.flash_attn_with_kvcache(**kwargs)
    with pytest.raises(Exception) as compiled:
        _compiled_call(xpu_ops.flash_attn_with_kvcache, kwargs)
    assert str(eager.value) in str(compiled.value)


def _store_kwargs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    cache = lambda: torch.zeros(12, 2, 8, dtype=dtype)  # noqa: E731
    return dict(k_cache=cache(), v_cache=cache(), loc=torch.tensor([7, 2, 9]),
                k=torch.randn(3, 2, 8, generator=gen), v=torch.randn(3, 2, 8, generator=gen))


def test_store_skips_wrapper_checks_only_while_compiling(monkeypatch):
    ref = _store_kwargs()
    xpu_ops.store_kv_cache(**ref)
    _traced_checks_raise(monkeypatch, kv_cache)
    with pytest.raises(AssertionError, match="wrapper checks ran"):
        xpu_ops.store_kv_cache(**_store_kwargs())
    kwargs = _store_kwargs()
    _compiled_call(xpu_ops.store_kv_cache, kwargs)
    assert torch.equal(kwargs["k_cache"], ref["k_cache"])
    assert torch.equal(kwargs["v_cache"], ref["v_cache"])


@pytest.mark.parametrize("change", [dict(k_scale=1.0), dict(loc=[7, 2, 9])],
                         ids=["scale", "loc list"])
def test_store_other_calls_trace_every_check(monkeypatch, change):
    _traced_checks_raise(monkeypatch, kv_cache)
    kwargs = {**_store_kwargs(torch.float8_e4m3fn), **change}
    with pytest.raises(Exception, match="wrapper checks ran"):
        _compiled_call(xpu_ops.store_kv_cache, kwargs)


@pytest.mark.parametrize("change", [
    dict(k=torch.zeros(3, 2, 8, dtype=torch.float64)), dict(k=torch.zeros(3, 16)),
    dict(v=torch.zeros(2, 2, 8)), dict(loc=torch.tensor([7, 2, 9], dtype=torch.int16)),
    dict(k_cache=torch.zeros(12, 3, 8)), dict(v_cache=torch.zeros(11, 2, 8)),
    dict(loc=[7, 2, 9]), dict(k_scale=torch.ones(1))],
    ids=["k float64", "k 2-D", "v tokens", "loc int16", "k_cache heads", "v_cache slots",
         "loc list", "scale without fp8"])
def test_store_compiled_errors_carry_the_eager_message(change):
    kwargs = {**_store_kwargs(), **change}
    with pytest.raises(USER_ERRORS) as eager:
        xpu_ops.store_kv_cache(**kwargs)
    with pytest.raises(Exception) as compiled:
        _compiled_call(xpu_ops.store_kv_cache, kwargs)
    assert str(eager.value) in str(compiled.value)
