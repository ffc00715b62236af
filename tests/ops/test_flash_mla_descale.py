"""``flash_mla_with_kvcache`` with fp8 queries and a plain fp8 cache and their float32 descales
(sgl-kernel's FlashMLA fp8 path, ``xpu_ops/ops/flash_mla_descale.py``): against the float64
oracle on the dequantized values (per tensor and per request), the argument rules, a fullgraph
trace."""

from __future__ import annotations

import pytest
import torch

import xpu_ops

from . import oracle_flash_mla as oracle
from .utils import assert_matches_oracle

E4M3, I32 = torch.float8_e4m3fn, torch.int32


def _inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    b, s_q, h, d, dv, pages, page_size = 2, 2, 4, 48, 32, 5, 4
    q = (torch.randn(b, s_q, h, d, generator=gen) * 2).to(E4M3)
    k = (torch.randn(pages, page_size, 1, d, generator=gen) * 2).to(E4M3)
    table = torch.tensor([[3, 0, 4], [1, 2, 0]], dtype=I32)
    seqlens = torch.tensor([11, 6], dtype=I32)
    return q, k, table, seqlens, dv


@pytest.mark.parametrize("per_request", [False, True])
def test_fp8_query_and_cache_match_the_dequantized_oracle(per_request):
    q, k, table, seqlens, dv = _inputs(1)
    dq = torch.tensor([0.5, 1.25]) if per_request else torch.tensor([0.75])
    dk = torch.tensor([1.5, 0.25]) if per_request else torch.tensor([2.0])
    out, lse = xpu_ops.flash_mla_with_kvcache(q, k, table, seqlens, dv, None, None, 0.2,
                                              causal=True, descale_q=dq, descale_k=dk)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    for i in range(q.shape[0]):
        qi = q[i:i + 1].double() * dq[i % dq.numel()].item()
        ki = k.double() * dk[i % dk.numel()].item()
        want, want_lse = oracle.flash_mla_with_kvcache(qi, ki, table[i:i + 1], seqlens[i:i + 1],
                                                       dv, 0.2, True, False)
        assert_matches_oracle(out[i:i + 1], want, torch.bfloat16, lse[i:i + 1], want_lse)


def test_fp8_query_with_a_bf16_cache():
    q, k, table, seqlens, dv = _inputs(2)
    k16 = k.to(torch.bfloat16)
    out, lse = xpu_ops.flash_mla_with_kvcache(q, k16, table, seqlens, dv, None, None, 0.2,
                                              descale_q=torch.tensor([0.5]))
    want, want_lse = oracle.flash_mla_with_kvcache(q.double() * 0.5, k16, table, seqlens, dv,
                                                   0.2, False, False)
    assert_matches_oracle(out, want, torch.bfloat16, lse, want_lse)


@pytest.mark.parametrize("change,match", [
    (dict(descale_q=None), r"descale_q does not match the dtype of q"),
    (dict(descale_k=None), r"descale_k does not match the dtype of k_cache"),
    (dict(descale_q=torch.ones(3)), r"descale_q has the wrong number of elements"),
    (dict(descale_k=torch.ones(1, dtype=torch.float64)), r"descale_k has dtype"),
    (dict(is_fp8_kvcache=True), r"descale_k is given with is_fp8_kvcache"),
])
def test_descale_rules(change, match):
    q, k, table, seqlens, dv = _inputs(3)
    kwargs = dict(descale_q=torch.ones(1), descale_k=torch.ones(2))
    kwargs.update(change)
    with pytest.raises(ValueError, match="^flash_mla_with_kvcache: " + match):
        xpu_ops.flash_mla_with_kvcache(q, k, table, seqlens, dv, None, None, 0.2, **kwargs)


def test_fullgraph_trace_matches_eager():
    q, k, table, seqlens, dv = _inputs(4)
    dq, dk = torch.tensor([0.5]), torch.tensor([1.5, 0.5])

    def step(q, k, table, seqlens, dq, dk):
        return xpu_ops.flash_mla_with_kvcache(q, k, table, seqlens, dv, None, None, 0.2,
                                              causal=True, descale_q=dq, descale_k=dk)

    eager = step(q, k, table, seqlens, dq, dk)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, table, seqlens,
                                                                        dq, dk)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
