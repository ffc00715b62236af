"""Sample inputs of the linear-attention ops (causal conv1d, gated delta rule), registered into
``xpu_ops.testing.sample_inputs``.

Adversarial as the attention samples are: every state slot that no request addresses (and
every addressed slot a request does not read: ``has_initial_state`` False) holds NaN, slot -1
appears, requests of length 0 and idle batches appear, outputs are returned (fresh), and
the intermediate-state scratch starts as NaN except for a spare row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .testing import _cu_seqlens, _randn, _sampler


def _slots(num_slots: int, slots, reads, shape, dtype, device, gen) -> torch.Tensor:
    """A pool ``[num_slots, *shape]``: random where a request reads its slot, NaN elsewhere."""
    pool = torch.full((num_slots, *shape), float("nan"))
    for slot, read in zip(slots, reads):
        if slot >= 0 and read:
            pool[slot] = torch.randn(*shape, generator=gen)
    if not any(s >= 0 and r for s, r in zip(slots, reads)):
        pool[-1] = torch.randn(*shape, generator=gen)      # never all NaN
    return pool.to(dtype).to(device)


def _index(values, device, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(list(values), dtype=dtype, device=device)


@_sampler("causal_conv1d_fn")
def _causal_conv1d_fn_samples(device, dtype, gen):
    # (lens, dim, width, num_slots, slots, has_initial_state, bias, activation, x dtype,
    #  state dtype)
    for lens, dim, width, num_slots, slots, init, bias, act, dt, sdt in (
            ((3, 5, 1), 8, 4, 6, (2, 0, 4), (True, False, True), True, "silu",
             torch.float32, None),
            ((1, 2), 16, 4, 3, (1, 0), (True, True), False, None, torch.bfloat16, None),
            ((4, 0, 3), 8, 2, 4, (3, -1, 1), (True, True, False), True, "silu",
             torch.float16, None),
            ((7,), 12, 3, 2, (1,), (True,), True, "silu", torch.bfloat16, torch.float32),
            ((2, 6), 4, 1, 3, (0, 2), (True, True), True, None, torch.float32, None),
            ((), 8, 4, 2, (), (), True, "silu", torch.float32, None)):
        dt = dtype or dt
        x = _randn(gen, sum(lens), dim, dtype=dt, device=device)
        weight = _randn(gen, dim, width, dtype=dt, device=device, scale=0.5)
        b = _randn(gen, dim, dtype=dt, device=device) if bias else None
        states = _slots(num_slots, slots, init, (dim, width - 1), sdt or dt, device, gen)
        yield ((x, weight, b, states, _cu_seqlens(lens, device), _index(slots, device),
                _index(init, device, torch.bool), act), {})


@_sampler("causal_conv1d_update")
def _causal_conv1d_update_samples(device, dtype, gen):
    # (b, s (None: 2-D x), dim, width, num_slots, slots (None: request r uses slot r), bias,
    #  activation, dtype)
    for batch, s, dim, width, num_slots, slots, bias, act, dt in (
            (3, None, 8, 4, 5, (1, -1, 3), True, "silu", torch.float32),
            (2, 3, 16, 4, 4, (2, 0), False, None, torch.bfloat16),
            (2, None, 8, 3, 4, None, True, "silu", torch.float16),
            (2, 5, 4, 4, 3, (0, 2), True, "silu", torch.float32),
            (0, None, 8, 4, 2, (), True, "silu", torch.float32)):
        dt = dtype or dt
        shape = (batch, dim) if s is None else (batch, s, dim)
        x = _randn(gen, *shape, dtype=dt, device=device)
        used = tuple(range(batch)) if slots is None else slots
        state = _slots(num_slots, used, (True,) * batch, (dim, width - 1), dt, device, gen)
        weight = _randn(gen, dim, width, dtype=dt, device=device, scale=0.5)
        b = _randn(gen, dim, dtype=dt, device=device) if bias else None
        indices = None if slots is None else _index(slots, device)
        yield ((x, state, weight, b, act, indices), {})


@_sampler("fused_gdn_gating")
def _fused_gdn_gating_samples(device, dtype, gen):
    # (T, Hv, projection dtype, parameter dtype, scale of a: 30 crosses softplus' threshold)
    for tokens, heads, dt, pdt, spread in ((5, 4, torch.float32, torch.float32, 1.0),
                                           (3, 8, torch.bfloat16, torch.bfloat16, 3.0),
                                           (4, 6, torch.float16, torch.float32, 30.0),
                                           (1, 32, torch.bfloat16, torch.float32, 1.0),
                                           (0, 4, torch.float32, torch.float32, 1.0)):
        dt = dtype or dt
        a = _randn(gen, tokens, heads, dtype=dt, device=device, scale=spread)
        b = _randn(gen, tokens, heads, dtype=dt, device=device, scale=3.0)
        A_log = (torch.rand(heads, generator=gen) * 16 + 0.01).log().to(pdt).to(device)
        dt_bias = _randn(gen, heads, dtype=pdt, device=device)
        yield ((A_log, a, dt_bias, b), {})


def gdn_inputs(gen, lens, hk, hv, k_dim, v_dim, dtype, device, l2norm: bool):
    """``q, k [T, Hk, K]``, ``v [T, Hv, V]`` in ``dtype``, ``g [T, Hv]`` float32 (<= 0) and
    ``beta [T, Hv]`` in ``dtype``; without ``l2norm`` the keys are scaled to about unit norm."""
    total = sum(lens)
    q = _randn(gen, total, hk, k_dim, dtype=dtype, device=device)
    k = _randn(gen, total, hk, k_dim, dtype=dtype, device=device,
               scale=1.0 if l2norm else k_dim ** -0.5)
    v = _randn(gen, total, hv, v_dim, dtype=dtype, device=device)
    g = F.logsigmoid(torch.randn(total, hv, generator=gen) + 2.0).to(device)
    beta = torch.rand(total, hv, generator=gen).to(dtype).to(device)
    return q, k, v, g, beta


@_sampler("chunk_gated_delta_rule")
def _chunk_gated_delta_rule_samples(device, dtype, gen):
    # (lens, Hk, Hv, K, V, chunk_size, dtype, l2norm, num_slots, slots, has_initial_state)
    for lens, hk, hv, k_dim, v_dim, chunk, dt, l2, num_slots, slots, init in (
            ((5, 3), 1, 2, 8, 4, 4, torch.float32, True, 5, (1, 3), (True, False)),
            ((37,), 2, 2, 16, 8, 16, torch.bfloat16, True, 2, (-1,), (True,)),
            ((2, 0, 70), 1, 3, 8, 8, 64, torch.float16, False, 6, (0, 2, 4), (True, True, True)),
            ((4, 4), 2, 4, 4, 4, 3, torch.float32, False, 3, (2, 0), (False, True)),
            ((), 1, 2, 8, 4, 64, torch.float32, True, 2, (), ())):
        dt = dtype or dt
        q, k, v, g, beta = gdn_inputs(gen, lens, hk, hv, k_dim, v_dim, dt, device, l2)
        states = _slots(num_slots, slots, init, (hv, k_dim, v_dim), torch.float32, device, gen)
        yield ((q, k, v, g, beta, k_dim ** -0.5, states, _index(slots, device),
                _index(init, device, torch.bool), _cu_seqlens(lens, device), l2, chunk), {})


@_sampler("fused_recurrent_gated_delta_rule")
def _fused_recurrent_gated_delta_rule_samples(device, dtype, gen):
    # (lens, Hk, Hv, K, V, dtype, l2norm, num_slots, slots, intermediate steps (0: none),
    #  disable_state_update)
    for lens, hk, hv, k_dim, v_dim, dt, l2, num_slots, slots, steps, disable in (
            ((1, 1, 1), 2, 4, 8, 8, torch.float32, True, 5, (3, -1, 0), 0, False),
            ((3, 3), 1, 2, 8, 4, torch.bfloat16, True, 4, (1, 2), 4, False),
            ((2, 4), 1, 2, 4, 8, torch.float16, False, 3, (0, 2), 3, True),
            ((1, 2), 2, 2, 8, 4, torch.float32, True, 3, (2, 1), 2, False),
            ((), 1, 2, 8, 4, torch.float32, True, 2, (), 2, False)):
        dt = dtype or dt
        q, k, v, g, beta = gdn_inputs(gen, lens, hk, hv, k_dim, v_dim, dt, device, l2)
        states = _slots(num_slots, slots, (True,) * len(slots), (hv, k_dim, v_dim),
                        torch.float32, device, gen)
        inter = None
        if steps:
            inter = torch.full((len(lens) + 1, steps, hv, k_dim, v_dim), float("nan"))
            inter[-1] = torch.randn(steps, hv, k_dim, v_dim, generator=gen)   # a spare row
            inter = inter.to(device)
        yield ((q, k, v, g, beta, k_dim ** -0.5, states, _index(slots, device),
                _cu_seqlens(lens, device), l2, inter, disable), {})


@_sampler("gdn_attention")
def _gdn_attention_samples(device, dtype, gen):
    # (lens, Hk, Hv, K, V, width, num_slots, slots, has_initial_state, bias, dtype, decode);
    # K = 32 cases are ones the sgl_kernel glue serves (fp16/bf16)
    for lens, hk, hv, k_dim, v_dim, width, num_slots, slots, init, bias, dt, decode in (
            ((5, 3), 1, 2, 8, 4, 4, 5, (1, 3), (True, False), True, torch.float32, False),
            ((1, 1, 1), 2, 4, 32, 4, 4, 5, (3, -1, 0), (True, True, True), False,
             torch.bfloat16, True),
            ((70, 0, 2), 1, 2, 32, 8, 4, 4, (2, 0, -1), (False, True, True), True,
             torch.float16, False),
            ((1, 1), 2, 2, 4, 4, 2, 3, (1, 2), (True, True), True, torch.float32, True),
            ((), 1, 2, 8, 4, 4, 2, (), (), True, torch.float32, False)):
        dt = dtype or dt
        dim, total = 2 * hk * k_dim + hv * v_dim, sum(lens)
        mixed = _randn(gen, total, dim, dtype=dt, device=device)
        a = _randn(gen, total, hv, dtype=dt, device=device)
        b = _randn(gen, total, hv, dtype=dt, device=device, scale=2.0)
        weight = _randn(gen, dim, width, dtype=dt, device=device, scale=0.5)
        conv_bias = _randn(gen, dim, dtype=dt, device=device) if bias else None
        A_log = (torch.rand(hv, generator=gen) * 8 + 0.01).log().to(device)
        dt_bias = _randn(gen, hv, dtype=dt, device=device)
        conv = _slots(num_slots, slots, init, (dim, width - 1), dt, device, gen)
        ssm = _slots(num_slots, slots, init, (hv, k_dim, v_dim), torch.float32, device, gen)
        yield ((mixed, a, b, weight, conv_bias, A_log, dt_bias, conv, ssm,
                _cu_seqlens(lens, device), _index(slots, device),
                _index(init, device, torch.bool), hk, k_dim, "silu", decode), {})
