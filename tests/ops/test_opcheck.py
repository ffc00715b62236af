"""``torch.library.opcheck`` on every sample of every op, plus what opcheck cannot see.

opcheck's schema test compares tensors with ``allclose``, which has no fp8 kernel on CPU; for
fp8 samples it is replaced by ``test_inputs_unchanged_except_mutated`` (a bytewise comparison).
"""

from __future__ import annotations

import pytest
import torch

import xpu_ops
from xpu_ops._registration import DEFINED
from xpu_ops.testing import ATTENTION_CASES, REGISTERED_OPS, op_name, sample_inputs

from .utils import (OPCHECK_UTILS, all_sample_params, arg_names, bitwise_equal, clone, has_fp8,
                    mutated_arg_names, sample)

SAMPLES = all_sample_params()


def test_registered_ops_is_complete_and_sampled():
    ours = {name.split("::")[1] for name, d in DEFINED.items()
            if name.startswith("xpu_ops::") and d.fn.__module__.startswith("xpu_ops.")}
    assert ours == {op_name(op) for op in xpu_ops.REGISTERED_OPS}
    for op in REGISTERED_OPS:
        n = len(list(sample_inputs(op.default, "cpu")))   # the overload works as well
        assert 4 <= n <= 30, (op, n)


def test_attention_samples_cover_every_feature():
    cases = ATTENTION_CASES
    assert {c.page_size for c in cases} >= {1, 4, 16}
    assert {c.hq // c.hkv for c in cases} >= {1, 3, 4}
    assert {(c.d, c.head_dim_v) for c in cases} >= {(64, 64), (80, 80), (128, 128), (192, 128),
                                                    (256, 256)}
    assert {c.causal for c in cases} == {True, False}
    assert {c.window for c in cases} >= {(-1, -1), (2, 0), (-1, 1), (2, 3)}
    assert any(c.softcap > 0 for c in cases) and any(c.sinks for c in cases)
    assert {c.kv_dtype for c in cases} >= {torch.float8_e4m3fn, torch.float8_e5m2}
    assert any(c.q_fp8 for c in cases) and any(c.qv for c in cases)
    assert {c.dtype for c in cases} >= {torch.float32, torch.bfloat16, torch.float16}
    assert any(lq == 0 for c in cases for lq, _ in c.reqs)             # request without new tokens
    assert any(lk == 0 for c in cases for _, lk in c.reqs)             # cache length 0
    assert any(all(lq == 0 for lq, _ in c.reqs) for c in cases)        # idle batch


def test_sample_inputs_dtype_and_seed():
    op = torch.ops.xpu_ops.flash_attn_with_kvcache
    for args, _ in sample_inputs(op, "cpu", torch.float16):
        assert args[0].dtype == torch.float16 and args[6].dtype == torch.float16
    first = lambda seed: next(sample_inputs(op, "cpu", seed=seed))[0][0]  # noqa: E731
    assert torch.equal(first(0), first(0)) and not torch.equal(first(0), first(1))
    with pytest.raises(KeyError, match="has no sampler"):
        next(sample_inputs("no_such_op", "cpu"))


@pytest.mark.parametrize("op,index", SAMPLES)
def test_opcheck(op, index):
    args, kwargs = sample(op, index)
    utils = tuple(u for u in OPCHECK_UTILS if not (has_fp8(args) and u == "test_schema"))
    torch.library.opcheck(op.default, args, kwargs, test_utils=utils)


@pytest.mark.parametrize("op,index", SAMPLES)
def test_inputs_unchanged_except_mutated(op, index):
    args, kwargs = sample(op, index)
    before = clone(args)
    mutated = mutated_arg_names(op)
    result = op(*args, **kwargs)
    for name, a, b in zip(arg_names(op), args, before):
        if isinstance(a, torch.Tensor) and name not in mutated:
            assert bitwise_equal(a, b), f"{op_name(op)} modified its input {name}"
        if isinstance(a, torch.Tensor) and name in mutated and a.dtype.is_floating_point \
                and b.isnan().all():
            assert not a.isnan().any(), f"{op_name(op)} left part of {name} unwritten"
    for r in result if isinstance(result, (tuple, list)) else [result]:
        if isinstance(r, torch.Tensor):
            assert not any(r.data_ptr() == a.data_ptr() and r.numel() for a in args
                           if isinstance(a, torch.Tensor)), "an output aliases an input"
