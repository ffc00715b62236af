"""The shim's ``sgl_kernel.gdn_attention`` (sgl-kernel-xpu's signature, layouts and in-place
writes) against a float64 oracle of one gated-delta-net layer written here from the math
(Gated Delta Networks, arXiv 2412.06464; transformers' ``Qwen3NextGatedDeltaNet``): the causal
conv over the request's window, silu, L2-normed q and k, ``g = -exp(A_log) softplus(a +
dt_bias)``, ``beta = sigmoid(b)``, and per token ``S = exp(g) S``, ``S += k (beta (v - S^T k))^T``,
``o = S^T q / sqrt(K)``."""

from __future__ import annotations

import pytest
import torch

from .test_compat_shim import shim  # noqa: F401  (the fixture: the shim, or a skip)

HK, HV, K, V, WIDTH, CACHE = 1, 2, 4, 4, 4, 5
DIM = 2 * HK * K + HV * V


def _oracle(q, k, v, a, b, p, conv_pool, ssm_pool, lens, slots, initial):
    """float64 ``(o [T, Hv, V], conv_pool, ssm_pool)`` after the step (pools in xpu-ops'
    ``[.., dim, width - 1]`` and the native ``[.., Hv, V, K]`` layouts, updated copies)."""
    d = torch.float64
    conv_pool, ssm_pool = conv_pool.to(d).clone(), ssm_pool.to(d).clone()
    x_all = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1).to(d)
    out, start = [], 0
    for n, slot, init in zip(lens, slots, initial):
        use = slot >= 0 and init
        window = conv_pool[slot] if use else torch.zeros(DIM, WIDTH - 1, dtype=d)
        seq = torch.cat([window, x_all[start:start + n].T], 1)             # [dim, W - 1 + n]
        y = torch.stack([(seq[:, t:t + WIDTH] * p["w"].to(d)).sum(1) for t in range(n)])
        y = torch.nn.functional.silu(y + p["bias"].to(d))
        state = ssm_pool[slot].transpose(-1, -2) if use else torch.zeros(HV, K, V, dtype=d)
        o = torch.empty(n, HV, V, dtype=d)
        for t in range(n):
            row = start + t
            g = -p["A_log"].to(d).exp() * torch.nn.functional.softplus(
                a[row].to(d) + p["dt_bias"].to(d))
            beta = torch.sigmoid(b[row].to(d))
            for h in range(HV):
                kh = h // (HV // HK)
                qv = y[t, kh * K:(kh + 1) * K]
                kv = y[t, HK * K + kh * K:HK * K + (kh + 1) * K]
                vv = y[t, 2 * HK * K + h * V:2 * HK * K + (h + 1) * V]
                qv, kv = qv / qv.norm(), kv / kv.norm()
                s = state[h] * g[h].exp()
                s = s + torch.outer(kv, beta[h] * (vv - s.T @ kv))
                state[h] = s
                o[t, h] = s.T @ qv * K ** -0.5
        if slot >= 0:
            conv_pool[slot] = seq[:, -(WIDTH - 1):]
            ssm_pool[slot] = state.transpose(-1, -2)
        out.append(o)
        start += n
    return torch.cat(out), conv_pool, ssm_pool


def _pack(q, k, v, z, a, b, reorder):
    """sgl-kernel-xpu's projections: by part, or per key-head group ``[q_h k_h v_g z_g]``."""
    t, g = q.shape[0], HV // HK
    if reorder:
        return (torch.cat([q.flatten(1), k.flatten(1), v.flatten(1), z.flatten(1)], 1),
                torch.cat([b, a], 1))
    vg, zg = v.view(t, HK, g * V), z.view(t, HK, g * V)
    qkvz = torch.cat([q, k, vg, zg], 2).flatten(1)
    ba = torch.cat([b.view(t, HK, g), a.view(t, HK, g)], 2).flatten(1)
    return qkvz, ba


def _case(lens, rows, reorder, seed):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)
    t = sum(lens)
    q, k, v, z = rnd(rows, HK, K), rnd(rows, HK, K), rnd(rows, HV, V), rnd(rows, HV, V)
    a, b = rnd(rows, HV), rnd(rows, HV)
    qkvz, ba = _pack(q, k, v, z, a, b, reorder)
    p = dict(w=rnd(DIM, WIDTH) * 0.5, bias=rnd(DIM) * 0.1, A_log=rnd(HV) * 0.5,
             dt_bias=rnd(HV) * 0.5)
    conv_pool = rnd(CACHE, DIM, WIDTH - 1)            # sglang's pool layout
    ssm_pool = rnd(CACHE, HV, V, K) * 0.3             # the native layout
    return t, (q, k, v, z, a, b), qkvz, ba, p, conv_pool, ssm_pool


def _call(gdn, out, zout, qkvz, ba, p, conv_pool, ssm_pool, lens, slots, initial, prefills,
          decodes, tokens, tp_size=1, reorder=True, **over):
    args = dict(core_attn_out=out, z=zout, projected_states_qkvz=qkvz, projected_states_ba=ba,
                num_k_heads=HK * tp_size, num_v_heads=HV * tp_size, head_k_dim=K, head_v_dim=V,
                conv_state=conv_pool.transpose(1, 2), ssm_state=ssm_pool, conv_weights=p["w"],
                conv_bias=p["bias"], activation="silu", A_log=p["A_log"],
                dt_bias=p["dt_bias"], num_prefills=prefills, num_decodes=decodes,
                num_spec_decodes=0, has_initial_state=initial,
                non_spec_query_start_loc=torch.tensor([0] + list(
                    torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32),
                non_spec_token_indx=None,
                non_spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32),
                spec_query_start_loc=None, spec_token_indx=None, spec_state_indices_tensor=None,
                num_accepted_tokens=None, num_actual_tokens=tokens, tp_size=tp_size,
                reorder_input=reorder)
    args.update(over)
    return gdn(**args)


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_gdn_attention_matches_float64_oracle(shim, mode):
    from sgl_kernel import gdn_attention
    if mode == "decode":   # one token a request, slot -1 in the middle, has_initial_state None
        lens, slots, initial, rows, reorder, tp = [1, 1, 1], [2, -1, 0], None, 4, True, 1
        prefills, decodes = 0, 3
    else:                  # extend: a fresh request, a -1 slot, grouped layout, tp_size 2
        lens, slots, rows, reorder, tp = [3, 4, 2], [1, -1, 3], 11, False, 2
        initial, prefills, decodes = torch.tensor([True, True, False]), 3, 0
    t, parts, qkvz, ba, p, conv_pool, ssm_pool = _case(lens, rows, reorder, 7 + len(mode))
    out = torch.full((rows, HV, V), torch.nan)         # rows past t: a padded capture's
    zout = torch.full((rows, HV, V), torch.nan)
    want = _oracle(*parts[:3], parts[4], parts[5], p, conv_pool, ssm_pool, lens, slots,
                   [True] * 3 if initial is None else initial.tolist())
    result = _call(gdn_attention, out, zout, qkvz, ba, p, conv_pool, ssm_pool, lens, slots,
                   initial, prefills, decodes, t, tp, reorder)
    assert result is None
    torch.testing.assert_close(out[:t].double(), want[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(zout[:t], parts[3][:t])
    assert out[t:].isnan().all() and zout[t:].isnan().all()       # nothing past the tokens
    torch.testing.assert_close(conv_pool.double(), want[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(ssm_pool.double(), want[2], atol=2e-5, rtol=2e-5)


def _bad_calls():
    spec = dict(num_spec_decodes=1)
    return [
        ("num_spec_decodes", spec),
        ("non_spec_token_indx", dict(non_spec_token_indx=torch.arange(2, dtype=torch.int32))),
        ("projected_states_qkvz", dict(projected_states_qkvz=torch.randn(2, DIM))),
        ("core_attn_out", dict(core_attn_out=torch.zeros(2, HV, V, dtype=torch.float64))),
        ("projected_states_qkvz has fewer rows", dict(num_actual_tokens=5)),
        ("tp_size", dict(tp_size=2, num_k_heads=HK, num_v_heads=HV)),
        ("ssm_state", dict(ssm_state=torch.zeros(CACHE, HV, K + 1, K))),
        ("non_spec_state_indices_tensor",
         dict(non_spec_state_indices_tensor=torch.zeros(2, dtype=torch.int64))),
        ("num_decodes", dict(num_decodes=1, non_spec_state_indices_tensor=torch.zeros(
            1, dtype=torch.int32), non_spec_query_start_loc=torch.tensor([0, 2]).int())),
        ("conv_weights", dict(conv_weights=torch.randn(DIM + 1, WIDTH))),   # xpu_ops' own check
        # this call's names (not xpu_ops.gdn_attention's conv_states, ssm_states, cache_indices)
        ("ssm_state has dtype torch.float64",      # fp32|fp16|bf16 are the native types
         dict(ssm_state=torch.zeros(CACHE, HV, V, K, dtype=torch.float64))),
        ("conv_state has dtype torch.int32",
         dict(conv_state=torch.zeros(CACHE, WIDTH - 1, DIM, dtype=torch.int32))),
        ("conv_state has the wrong size in dimension 1",
         dict(conv_state=torch.zeros(CACHE, WIDTH, DIM))),
        ("has_initial_state has the wrong size in dimension 0; expected num_prefills",
         dict(has_initial_state=torch.tensor([True]))),
    ]


@pytest.mark.parametrize("arg,over", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_gdn_attention_rejects_before_any_write(shim, arg, over):
    from sgl_kernel import gdn_attention
    t, _, qkvz, ba, p, conv_pool, ssm_pool = _case([1, 1], 2, True, 3)
    out, zout = torch.full((2, HV, V), torch.nan), torch.full((2, HV, V), torch.nan)
    pools = conv_pool.clone(), ssm_pool.clone()
    with pytest.raises(ValueError, match=f"gdn_attention: {arg}") as info:
        _call(gdn_attention, out, zout, qkvz, ba, p, conv_pool, ssm_pool, [1, 1], [0, 1], None,
              0, 2, t, **over)
    assert isinstance(info.value, RuntimeError)
    assert out.isnan().all() and zout.isnan().all()
    assert torch.equal(conv_pool, pools[0]) and torch.equal(ssm_pool, pools[1])


def test_gdn_attention_raw_op_and_fake(shim):
    """``torch.ops.sgl_kernel.gdn_attention`` (what sglang's backend probes): the schema marks
    the written arguments; opcheck (schema, fake, dispatch) on a decode call."""
    op = torch.ops.sgl_kernel.gdn_attention.default
    written = [a.name for a in op._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["core_attn_out", "z", "conv_state", "ssm_state", "workspace"]
    t, _, qkvz, ba, p, conv_pool, ssm_pool = _case([1, 1], 2, True, 5)
    args = _call(lambda **kw: tuple(kw.values()), torch.empty(2, HV, V), torch.empty(2, HV, V),
                 qkvz, ba, p, conv_pool.transpose(1, 2).contiguous().transpose(1, 2), ssm_pool,
                 [1, 1], [3, 0], None, 0, 2, t)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("reorder", [True, False], ids=["by-part", "grouped"])
def test_gdn_attention_requests_without_tokens(shim, reorder):
    """Two prefills of no token (``num_actual_tokens = 0``): nothing to compute; the continuing
    request keeps its states and the fresh one's slot is zeroed, in either projection layout
    (the grouped layout's 0-row view failed to infer its width)."""
    from sgl_kernel import gdn_attention
    _, _, qkvz, ba, p, conv_pool, ssm_pool = _case([0, 0], 2, reorder, 9)
    out, zout = torch.full((2, HV, V), torch.nan), torch.full((2, HV, V), torch.nan)
    before = conv_pool.clone(), ssm_pool.clone()
    _call(gdn_attention, out, zout, qkvz, ba, p, conv_pool, ssm_pool, [0, 0], [1, 3],
          torch.tensor([True, False]), 2, 0, 0, reorder=reorder)
    assert out.isnan().all() and zout.isnan().all()
    assert torch.equal(conv_pool[1], before[0][1]) and torch.equal(ssm_pool[1], before[1][1])
    assert (conv_pool[3] == 0).all() and (ssm_pool[3] == 0).all()
    for slot in (0, 2, 4):
        assert torch.equal(conv_pool[slot], before[0][slot])


def test_gdn_attention_compiles_fullgraph(shim):
    """sglang's call shape (keywords, the transposed conv-pool view) traces in one graph and
    writes the same results as eager."""
    from sgl_kernel import gdn_attention
    lens, slots = [1, 1], [3, -1]
    t, _, qkvz, ba, p, conv_pool, ssm_pool = _case(lens, 2, True, 11)
    pools = [(conv_pool.clone(), ssm_pool.clone()) for _ in range(2)]
    outs = [(torch.full((2, HV, V), torch.nan), torch.full((2, HV, V), torch.nan))
            for _ in range(2)]

    def step(out, zout, conv, ssm):
        _call(gdn_attention, out, zout, qkvz, ba, p, conv, ssm, lens, slots, None, 0, 2, t)

    step(*outs[0], *pools[0])
    torch._dynamo.reset()
    torch.compile(step, backend="aot_eager", fullgraph=True)(*outs[1], *pools[1])
    for want, got in zip(outs[0] + pools[0], outs[1] + pools[1]):
        torch.testing.assert_close(got, want)
