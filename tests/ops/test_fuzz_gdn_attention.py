"""Hypothesis fuzz of ``gdn_attention`` (bounded for a 2-core CI, derandomized;
``XPU_OPS_HYPOTHESIS_EXAMPLES=500`` explores more, randomly): request lengths 0 to 9, state
slots in the pool, -1 or past it, fresh and continuing requests, decode calls, fp16/bf16,
sliced ``mixed_qkv``; the reference provider and the ``sgl_kernel`` glue (through the
stand-in of sgl-kernel-xpu's fused op) against the float64 oracle, with NaN in every slot that
no request reads and unchanged in every slot that no request owns."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import xpu_ops

from .test_gdn_attention import _check, expected, native  # noqa: F401  (fixture)
from .utils import clone

OP = torch.ops.xpu_ops.gdn_attention
_EXAMPLES = int(os.environ.get("XPU_OPS_HYPOTHESIS_EXAMPLES", "0"))
I32 = torch.int32


def _inputs(gen, lens, kinds, inits, dtype, decode, sliced):
    """Arguments of one call: Hk 1, Hv 2, K 32 (the glue serves it), V 4, width 4, 5 slots."""
    hk, hv, k_dim, v_dim, width, num_slots = 1, 2, 32, 4, 4, 5
    dim, total = 2 * hk * k_dim + hv * v_dim, sum(lens)
    order = torch.randperm(num_slots, generator=gen).tolist()
    slots = [{"slot": order[r], "none": -1, "outside": num_slots + 2}[kind]
             for r, kind in enumerate(kinds)]
    mixed = torch.randn(total, dim + 3 * sliced, generator=gen).to(dtype)[:, :dim]

    def pool(shape, pool_dtype):
        p = torch.full((num_slots, *shape), float("nan"))
        for s, init in zip(slots, inits):
            if 0 <= s < num_slots and init:
                p[s] = torch.randn(*shape, generator=gen)
        return p.to(pool_dtype)
    return [mixed, torch.randn(total, hv, generator=gen).to(dtype),
            torch.randn(total, hv, generator=gen).to(dtype),
            (0.5 * torch.randn(dim, width, generator=gen)).to(dtype),
            torch.randn(dim, generator=gen).to(dtype),
            (torch.rand(hv, generator=gen) * 8 + 0.01).log(),
            torch.randn(hv, generator=gen).to(dtype),
            pool((dim, width - 1), dtype), pool((hv, k_dim, v_dim), torch.float32),
            torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=I32),
            torch.tensor(slots, dtype=I32), torch.tensor(inits), hk, k_dim, "silu", decode]


@settings(max_examples=_EXAMPLES or 12, deadline=None, derandomize=not _EXAMPLES,
          database=None, suppress_health_check=[HealthCheck.too_slow,
                                                HealthCheck.function_scoped_fixture])
@given(data=st.data(), batch=st.integers(1, 3), decode=st.booleans(),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]), sliced=st.booleans(),
       seed=st.integers(0, 2**16))
def test_gdn_attention_fuzz(native, data, batch, decode, dtype, sliced, seed):
    lens = [1] * batch if decode else data.draw(st.lists(st.integers(0, 9), min_size=batch,
                                                         max_size=batch))
    kinds = data.draw(st.lists(st.sampled_from(["slot", "none", "outside"]), min_size=batch,
                               max_size=batch))
    inits = [True] * batch if decode else data.draw(st.lists(st.booleans(), min_size=batch,
                                                             max_size=batch))
    args = _inputs(torch.Generator().manual_seed(seed), lens, kinds, inits, dtype, decode,
                   sliced)
    want = expected(clone(args))
    owned = {int(s) for s in args[10] if 0 <= s < args[8].shape[0]}
    for provider in ("reference", "sgl_kernel"):
        call = clone(args)
        with xpu_ops.use_provider(provider):
            out = OP(*call)
        _check(out, call, want)
        for slot in set(range(args[8].shape[0])) - owned:      # nobody's slot: untouched
            for pool in (7, 8):
                assert torch.equal(call[pool][slot].nan_to_num(7.0),
                                   args[pool][slot].nan_to_num(7.0)), (provider, slot)
