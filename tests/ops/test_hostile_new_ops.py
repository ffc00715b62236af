"""Hostile inputs to the newer op families (stores, causal conv1d, gated delta rule, DSA
index cache and top-k, FlashMLA surface), each on every CPU provider (Triton through its
interpreter on tiny shapes).

A source that is a view of the cache or state the op writes is read as it was before the call
(API.md "Writes"), so the result equals the call on a clone of the source, bit for bit.
"""

from __future__ import annotations

import pytest

from .triton_mode import provider_params, rerun_in_subprocess, running  # first

import torch  # noqa: E402

import xpu_ops  # noqa: E402
from xpu_ops.testing import sample_inputs  # noqa: E402

PROVIDERS = provider_params()
test_rerun_in_subprocess = rerun_in_subprocess(__file__)


def _assert_alias_reads_before(provider, make, call):
    """``make()`` gives ``(args, aliased)``: the call's arguments, one or more of them views
    of a mutated argument, and the names of those. The call must equal the same call on clones
    of those views (every mutated tensor and the result, bitwise)."""
    args, aliased = make()
    twin, _ = make()
    for name in aliased:
        twin[name] = twin[name].clone()
    with running(provider):
        got, want = call(**args), call(**twin)
    for name, value in args.items():
        if isinstance(value, torch.Tensor) and name not in aliased:
            assert torch.equal(value, twin[name]), f"{name} differs from the unaliased call"
    if got is not None:
        assert torch.equal(got, want), "the result differs from the unaliased call"


def _store_cache_call(order):
    gen = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(8, 4, generator=gen), torch.randn(8, 6, generator=gen)
    return dict(k=kc[1:5], v=vc[1:5], k_cache=kc, v_cache=vc,
                indices=torch.tensor(order)), ("k", "v")


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 2, 1, 0], [2, 3, 4, 5]])
def test_store_cache_xpu_reads_aliased_rows_before_the_store(provider, order):
    """Rows ``k = k_cache[1:5]`` stored at overlapping rows: was a raw RuntimeError (reference,
    ``index_copy_`` of overlapping memory) and rows read after they were overwritten (Triton)."""
    _assert_alias_reads_before(provider, lambda: _store_cache_call(order), xpu_ops.store_cache_xpu)


def _conv_update_call():
    gen = torch.Generator().manual_seed(2)
    state = torch.randn(3, 4, 3, generator=gen)
    return dict(x=state[:, :, 0], conv_state=state, weight=torch.randn(4, 4, generator=gen),
                bias=None, activation=None), ("x",)


def _conv_fn_call():
    gen = torch.Generator().manual_seed(3)
    states = torch.randn(4, 6, 3, generator=gen)
    x = states[:, :, 0]                              # [tokens 4, dim 6], a view of the states
    return dict(x=x, weight=torch.randn(6, 4, generator=gen), bias=None, conv_states=states,
                query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
                cache_indices=torch.tensor([2, 0], dtype=torch.int32),
                has_initial_state=torch.tensor([True, True]), activation="silu"), ("x",)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_causal_conv1d_update_reads_aliased_x_before_the_state_write(provider):
    """``x`` a view of the conv state: Triton wrote the state before it read ``x``."""
    _assert_alias_reads_before(provider, _conv_update_call, xpu_ops.causal_conv1d_update)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_causal_conv1d_fn_reads_aliased_x_before_the_state_write(provider):
    _assert_alias_reads_before(provider, _conv_fn_call, xpu_ops.causal_conv1d_fn)


def _recurrent_call():
    gen = torch.Generator().manual_seed(4)
    states = torch.randn(5, 4, 8, 8, generator=gen)
    v = states[0, :, 0:3, :].permute(1, 0, 2)      # [T 3, H 4, V 8], a view of slot 0
    return dict(q=torch.randn(3, 2, 8, generator=gen), k=torch.randn(3, 2, 8, generator=gen),
                v=v, g=-torch.rand(3, 4, generator=gen), beta=torch.rand(3, 4, generator=gen),
                scale=8 ** -0.5, ssm_states=states,
                cache_indices=torch.tensor([0, 1, 3], dtype=torch.int32),
                cu_seqlens=torch.tensor([0, 2, 2, 3], dtype=torch.int32)), ("v",)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_fused_recurrent_gated_delta_rule_reads_aliased_v_before_the_state_write(provider):
    _assert_alias_reads_before(provider, _recurrent_call,
                               xpu_ops.fused_recurrent_gated_delta_rule)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("merge, base", [(xpu_ops.merge_state, 2.0),
                                         (xpu_ops.merge_state_v2, torch.e)])
@pytest.mark.parametrize("side", ["a", "b"])
def test_merge_state_nan_lse_gives_nan_on_every_provider(provider, merge, base, side):
    """A NaN LSE: the reference returned a finite unnormalised mix (the NaN weight dropped),
    Triton NaN; now NaN ``v`` and ``s`` for that token-head everywhere, the others exact."""
    gen = torch.Generator().manual_seed(5)
    va, vb = torch.randn(3, 2, 4, generator=gen), torch.randn(3, 2, 4, generator=gen)
    sa, sb = torch.randn(3, 2, generator=gen), torch.randn(3, 2, generator=gen)
    (sa if side == "a" else sb)[1, 0] = float("nan")
    with running(provider):
        v, s = merge(va, sa, vb, sb)
    assert v[1, 0].isnan().all() and s[1, 0].isnan()
    keep = torch.ones(3, 2, dtype=torch.bool)
    keep[1, 0] = False
    wa, wb = base ** sa.double(), base ** sb.double()          # float64 oracle, finite rows
    want_v = (wa[..., None] * va.double() + wb[..., None] * vb.double()) / (wa + wb)[..., None]
    want_s = torch.log(wa + wb) / torch.log(torch.tensor(base, dtype=torch.float64))
    torch.testing.assert_close(v[keep].double(), want_v[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s[keep].double(), want_s[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_topk_ragged_offset_never_wraps_int32(provider):
    """An offset near INT32_MAX (or negative) wrapped to large negative slots; now -1."""
    score = torch.tensor([[0.5, 3.0, 1.0, 2.0], [1.0, 0.0, 9.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    lengths = torch.tensor([4, 4, 4], dtype=torch.int32)
    offset = torch.tensor([2**31 - 2, -2**31, -2], dtype=torch.int32)
    with running(provider):
        got = xpu_ops.fast_topk_transform_ragged_fused(score, lengths, offset, 3)
    assert got.dtype == torch.int32
    assert got.tolist() == [[2**31 - 1, -1, -1], [-1, -1, -1], [-1, 0, 1]]


def _sparse_fwd_call(sink):
    gen = torch.Generator().manual_seed(6)
    idx = torch.tensor([[[0, 1, -1, 3]], [[-1, -1, -1, -1]], [[2, 5, 6, 7]]], dtype=torch.int32)
    return (torch.randn(3, 2, 64, generator=gen), torch.randn(8, 1, 64, generator=gen), idx,
            0.125, 32, sink, None)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_flash_mla_nan_attn_sink(provider):
    """A NaN ``attn_sink``: the reference gave NaN on rows with keys and 0 on the empty row,
    Triton NaN everywhere, no debug check caught it. Now a house ValueError under the debug
    checks (wrapper and raw op); off, the other heads are exact."""
    nan_sink, zero_sink = torch.tensor([float("nan"), 0.5]), torch.tensor([0.0, 0.5])
    raw = torch.ops.xpu_ops.flash_mla_sparse_fwd
    with running(provider):
        for call in (xpu_ops.flash_mla_sparse_fwd, raw):
            with xpu_ops.debug_checks(), pytest.raises(ValueError, match=r"attn_sink\[0\] = nan"):
                call(*_sparse_fwd_call(nan_sink))
        got, want = raw(*_sparse_fwd_call(nan_sink)), raw(*_sparse_fwd_call(zero_sink))
    for g, w in zip(got, want):
        assert torch.equal(g[:, 1], w[:, 1])


def test_flash_mla_with_kvcache_nan_attn_sink_refused_under_debug_checks():
    op = torch.ops.xpu_ops.flash_mla_with_kvcache
    at = [a.name for a in op.default._schema.arguments].index("attn_sink")
    args, kwargs = next((a, k) for a, k in sample_inputs(op, "cpu", torch.float32)
                        if a[at] is not None)
    args = list(args)
    args[at] = torch.full_like(args[at], float("nan"))
    with xpu_ops.debug_checks(), pytest.raises(ValueError, match=r"attn_sink\[0\] = nan"):
        op(*args, **kwargs)


def test_rotary_per_token_flag_follows_the_house_flag_rule():
    """``is_neox_style=1`` was a TypeError; flags read an int 0 or 1 as its bool (API.md)."""
    from xpu_ops.ops.rotary import apply_rotary_emb_per_token
    gen = torch.Generator().manual_seed(7)
    x, angle = torch.randn(3, 2, 8, generator=gen), torch.rand(3, 4, generator=gen)
    for as_int, as_bool in ((1, True), (0, False)):
        assert torch.equal(apply_rotary_emb_per_token(x, angle.cos(), angle.sin(), as_int),
                           apply_rotary_emb_per_token(x, angle.cos(), angle.sin(), as_bool))
    with pytest.raises(TypeError, match="is_neox_style is not a bool"):
        apply_rotary_emb_per_token(x, angle.cos(), angle.sin(), "False")


def _paged_sink_call(sinks, seed=8):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(4, 4, 1, 16, generator=gen)
    return dict(q=torch.randn(3, 2, 16, generator=gen), k_cache=cache, v_cache=cache.clone(),
                cache_seqlens=torch.tensor([5, 0], dtype=torch.int32),
                page_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 2, 3], dtype=torch.int32), max_seqlen_q=2,
                sinks=sinks, return_softmax_lse=True)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_attention_nan_sinks(provider):
    """A NaN ``sinks`` logit: LSE NaN on the reference, -inf on Triton, unchecked. Now a house
    ValueError under the debug checks (paged and varlen); off, the other heads are exact."""
    nan_sink, zero_sink = torch.tensor([float("nan"), 0.5]), torch.tensor([0.0, 0.5])
    with running(provider):
        with xpu_ops.debug_checks(), pytest.raises(ValueError, match=r"sinks\[0\] = nan"):
            xpu_ops.flash_attn_with_kvcache(**_paged_sink_call(nan_sink))
        gen = torch.Generator().manual_seed(9)
        q, k = torch.randn(3, 2, 16, generator=gen), torch.randn(5, 1, 16, generator=gen)
        cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 2, 3], [0, 4, 5]))
        with xpu_ops.debug_checks(), pytest.raises(ValueError, match=r"sinks\[0\] = nan"):
            xpu_ops.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 2, 4, sinks=nan_sink)
        (out, lse), (out0, lse0) = (xpu_ops.flash_attn_with_kvcache(**_paged_sink_call(s))
                                    for s in (nan_sink, zero_sink))
    assert torch.equal(out[:, 1], out0[:, 1]) and torch.equal(lse[1], lse0[1])


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_store_index_k_cache_nan_key_bytes_agree(provider, scale_fmt):
    """A key with a NaN: Triton's max dropped the NaN (scale = the floor, other values
    saturated to 448), the reference stored a NaN scale and NaN bytes; now the reference's
    bytes on every provider. Rows with inf, huge and zero keys were already identical."""
    k = torch.tensor([[float("nan")] + [1.0] * 15, [float("inf")] + [1.0] * 15,
                      [1e38] * 16, [0.0] * 16, [0.5, -2.0] * 8])
    loc = torch.tensor([0, 1, 2, 3, 5])
    with running("reference"):
        want = torch.zeros(2, 4, 1, 20, dtype=torch.uint8)
        xpu_ops.store_index_k_cache(want, loc, k, scale_fmt=scale_fmt)
    with running(provider):
        got = torch.zeros(2, 4, 1, 20, dtype=torch.uint8)
        xpu_ops.store_index_k_cache(got, loc, k, scale_fmt=scale_fmt)
    assert torch.equal(got, want)
    nan_scale = got[0].reshape(-1)[64:68].view(torch.float32)      # slot 0's scale bytes
    assert nan_scale.isnan().all()
