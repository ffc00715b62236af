"""GPU suite of the linear-attention ops at Qwen3-Next's shapes: the ``triton`` provider against
the ``reference`` provider on the device (float32 accumulation both), NaN in every state slot
not read, slot -1, several requests of different lengths, verify with intermediate states, and
a captured decode step (conv update + gating + recurrence) replayed.

Marked ``gpu`` (CI deselects it); run on the GPU machine with
``pytest -m gpu tests/ops/test_linear_attention_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

import xpu_ops

from ..markers import GPU_DEVICE, requires_gpu

DEVICE = GPU_DEVICE
pytestmark = requires_gpu
HK, HV, K, V, WIDTH = 16, 32, 128, 128, 4        # Qwen3-Next-80B-A3B's GDN layer
DIM = 2 * HK * K + HV * V                         # conv channels: q, k and v together


def _rel(got, want):
    assert not got.isnan().any(), "NaN in the triton output"
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _pool(num_slots, shape, read_slots, gen):
    """A state pool: random in the slots that are read, NaN elsewhere."""
    pool = torch.full((num_slots, *shape), float("nan"), device=DEVICE)
    for s in read_slots:
        pool[s] = torch.randn(*shape, generator=gen).to(DEVICE)
    return pool


def _gdn_inputs(lens, gen, dtype=torch.bfloat16):
    total = sum(lens)
    rand = lambda *s: torch.randn(*s, generator=gen).to(dtype).to(DEVICE)  # noqa: E731
    g = torch.nn.functional.logsigmoid(torch.randn(total, HV, generator=gen) + 3).to(DEVICE)
    beta = torch.rand(total, HV, generator=gen).to(DEVICE)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEVICE)
    return rand(total, HK, K), rand(total, HK, K), rand(total, HV, V), g, beta, cu


def _both(call, pools, *args):
    """``call`` under triton and under reference on copies of ``pools``: (outs, pools after)."""
    results = {}
    for provider in ("triton", "reference"):
        copies = [p.clone() for p in pools]
        with xpu_ops.use_provider(provider):
            results[provider] = (call(copies, *args), copies)
    return results["triton"], results["reference"]


@pytest.mark.parametrize("lens,chunk_size", [((1000, 37, 300), 64), ((513,), 16), ((5, 0, 64), 32)])
def test_chunk_prefill_matches_reference(lens, chunk_size):
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta, cu = _gdn_inputs(lens, gen)
    slots = torch.tensor([3, -1, 0][:len(lens)], dtype=torch.int32, device=DEVICE)
    init = torch.tensor([True, True, False][:len(lens)], device=DEVICE)
    pool = _pool(6, (HV, K, V), [3], gen) * 0.1

    def call(pools, *_):
        return xpu_ops.chunk_gated_delta_rule(q, k, v, g, beta, None, pools[0], slots, init, cu,
                                              chunk_size=chunk_size)
    (out_t, (pool_t,)), (out_r, (pool_r,)) = _both(call, [pool])
    assert _rel(out_t, out_r) < 2e-2
    for s in (0, 3) if len(lens) > 2 else (3,):
        assert _rel(pool_t[s], pool_r[s]) < 1e-3, s
    untouched = [s for s in range(6) if s not in (0, 3)]
    assert pool_t[untouched].isnan().all()


@pytest.mark.parametrize("batch,steps", [(64, 1), (8, 4)])
def test_recurrent_decode_and_verify_match_reference(batch, steps):
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta, cu = _gdn_inputs([steps] * batch, gen)
    slots = torch.randperm(batch + 4, generator=gen)[:batch].to(torch.int32).to(DEVICE)
    slots[1] = -1
    pool = _pool(batch + 4, (HV, K, V), slots[slots >= 0].tolist(), gen) * 0.1
    inter = torch.full((batch + 1, steps, HV, K, V), float("nan"), device=DEVICE)

    def call(pools, *_):
        return xpu_ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta, None, pools[0], slots,
                                                        cu, intermediate_states=pools[1])
    (out_t, (pool_t, inter_t)), (out_r, (pool_r, inter_r)) = _both(call, [pool, inter])
    assert _rel(out_t, out_r) < 2e-2
    used = slots[slots >= 0].long()
    assert _rel(pool_t[used], pool_r[used]) < 1e-4
    assert _rel(inter_t[:batch], inter_r[:batch]) < 1e-4 and inter_t[batch].isnan().all()


@pytest.mark.parametrize("lens", [(1000, 37, 300), (3, 1)])
def test_conv_prefill_and_update_match_reference(lens):
    gen = torch.Generator().manual_seed(3)
    total = sum(lens)
    x = torch.randn(total, DIM, generator=gen).to(torch.bfloat16).to(DEVICE)
    weight = torch.randn(DIM, WIDTH, generator=gen).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(DIM, generator=gen).to(torch.bfloat16).to(DEVICE)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEVICE)
    slots = torch.tensor([2, -1, 0][:len(lens)], dtype=torch.int32, device=DEVICE)
    init = torch.tensor([True, False, False][:len(lens)], device=DEVICE)
    pool = _pool(4, (DIM, WIDTH - 1), [2], gen).to(torch.bfloat16)

    def prefill(pools, *_):
        return xpu_ops.causal_conv1d_fn(x, weight, bias, pools[0], cu, slots, init)
    (out_t, (pool_t,)), (out_r, (pool_r,)) = _both(prefill, [pool])
    assert _rel(out_t, out_r) < 1e-2
    torch.testing.assert_close(pool_t, pool_r, atol=0, rtol=0, equal_nan=True)   # copies

    step = torch.randn(len(lens), 3, DIM, generator=gen).to(torch.bfloat16).to(DEVICE)

    def update(pools, *_):
        return xpu_ops.causal_conv1d_update(step, pools[0], weight, bias,
                                            conv_state_indices=slots)
    (out_t, (after_t,)), (out_r, (after_r,)) = _both(update, [pool_r])
    assert _rel(out_t, out_r) < 1e-2
    torch.testing.assert_close(after_t, after_r, atol=0, rtol=0, equal_nan=True)


def test_captured_decode_step_replays():
    """conv update + gating + recurrence captured in one CUDA graph: a replay with new inputs
    equals eager calls on them (the ops launch only kernels, no host sync)."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs")
    gen = torch.Generator().manual_seed(4)
    batch = 8
    x = torch.randn(batch, DIM, generator=gen).to(torch.bfloat16).to(DEVICE)
    weight = torch.randn(DIM, WIDTH, generator=gen).to(torch.bfloat16).to(DEVICE) * 0.3
    conv = torch.randn(batch, DIM, WIDTH - 1, generator=gen).to(torch.bfloat16).to(DEVICE)
    ssm = torch.randn(batch, HV, K, V, generator=gen).to(DEVICE) * 0.1
    a = torch.randn(batch, HV, generator=gen).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(batch, HV, generator=gen).to(torch.bfloat16).to(DEVICE)
    A_log, dt_bias = torch.rand(HV, device=DEVICE), torch.randn(HV, device=DEVICE)
    slots = torch.arange(batch, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)

    def step():
        mixed = xpu_ops.causal_conv1d_update(x, conv, weight, None, conv_state_indices=slots)
        qh, kh, vh = mixed.split([HK * K, HK * K, HV * V], dim=-1)
        g, beta = xpu_ops.fused_gdn_gating(A_log, a, dt_bias, b)
        return xpu_ops.fused_recurrent_gated_delta_rule(
            qh.reshape(batch, HK, K), kh.reshape(batch, HK, K), vh.reshape(batch, HV, V), g,
            beta, None, ssm, slots, cu)

    with xpu_ops.use_provider("triton"):
        step()                                          # compile the kernels
        conv0, ssm0 = conv.clone(), ssm.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        conv.copy_(conv0), ssm.copy_(ssm0)
        x.copy_(torch.randn(batch, DIM, generator=gen).to(torch.bfloat16).to(DEVICE))
        graph.replay()
        replayed, conv_r, ssm_r = out.clone(), conv.clone(), ssm.clone()
        conv.copy_(conv0), ssm.copy_(ssm0)
        eager = step()
    assert torch.equal(replayed, eager) and torch.equal(conv_r, conv) and torch.equal(ssm_r, ssm)


@pytest.mark.parametrize("lens,decode", [((300, 37, 5), False), ((1, 1, 1, 1), True)])
def test_fused_layer_op_matches_reference(lens, decode):
    """``gdn_attention`` (conv, gating and rule in one op) on the device: triton's composed
    kernels (decode: conv update and token recurrence) against the reference."""
    gen = torch.Generator().manual_seed(5)
    total, b = sum(lens), len(lens)
    rand = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(  # noqa: E731
        torch.bfloat16).to(DEVICE)
    mixed, a, bb = rand(total, DIM), rand(total, HV), rand(total, HV, scale=2.0)
    weight, bias = rand(DIM, WIDTH, scale=0.3), rand(DIM)
    A_log, dt_bias = torch.rand(HV, generator=gen).to(DEVICE), rand(HV)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEVICE)
    slots = torch.tensor([3, -1, 0, 5][:b], dtype=torch.int32, device=DEVICE)
    init = torch.tensor([True, True, decode, True][:b], device=DEVICE)
    conv = _pool(6, (DIM, WIDTH - 1), [3, 0, 5][:b], gen).to(torch.bfloat16)
    ssm = _pool(6, (HV, K, V), [3, 0, 5][:b], gen) * 0.1

    def layer(pools, *_):
        return xpu_ops.gdn_attention(mixed, a, bb, weight, bias, A_log, dt_bias, pools[0],
                                     pools[1], cu, slots, init, HK, K, decode=decode)
    (out_t, (conv_t, ssm_t)), (out_r, (conv_r, ssm_r)) = _both(layer, [conv, ssm])
    assert _rel(out_t, out_r) < 2e-2
    torch.testing.assert_close(conv_t, conv_r, atol=0, rtol=0, equal_nan=True)   # copies
    assert _rel(torch.nan_to_num(ssm_t), torch.nan_to_num(ssm_r)) < 2e-2
    assert torch.equal(ssm_t.isnan(), ssm_r.isnan())
