"""Every op that writes a tensor runs all its checks before its first write (API.md "Writes").

For each registered op with a mutated argument, its first CPU sample is called with one other
argument spoiled at a time (a tensor in another dtype or with a dimension fewer, a float scalar
NaN): whether the op accepts or refuses that, a refusal must leave every mutated argument with
the bytes it had before the call. (``test_reject_before_write.py`` covers the public append of
``flash_attn_with_kvcache``, whose store runs before its attention.)
"""

from __future__ import annotations

import math

import pytest
import torch

from xpu_ops.testing import REGISTERED_OPS, op_name

from .utils import bitwise_equal, mutated_arg_names, sample

MUTATING = [op for op in REGISTERED_OPS if mutated_arg_names(op)]


def _spoiled(value):
    """Spoiled variants of one argument (none for arguments no check could refuse)."""
    if isinstance(value, torch.Tensor):
        other = torch.float64 if value.dtype != torch.float64 else torch.float32
        variants = [value.to(other)]
        if value.dim() >= 1:
            variants.append(value[..., 0] if value.shape[-1] else value.sum(-1))
        return variants
    if isinstance(value, float):
        return [math.nan]
    return []


def _calls(op):
    args, kwargs = sample(op, 0)
    names = [a.name for a in op.default._schema.arguments]
    written = mutated_arg_names(op)
    positional = dict(zip(names, args))
    for name, value in {**positional, **kwargs}.items():
        if name in written:
            continue
        for bad in _spoiled(value):
            a, kw = sample(op, 0)
            if name in kwargs:
                kw[name] = bad
            else:
                a = list(a)
                a[names.index(name)] = bad
            yield name, tuple(a), kw


@pytest.mark.parametrize("op", MUTATING, ids=[op_name(op) for op in MUTATING])
def test_a_refused_call_writes_nothing(op):
    names = [a.name for a in op.default._schema.arguments]
    written = mutated_arg_names(op)
    refused = 0
    for spoiled, args, kwargs in _calls(op):
        targets = {n: args[names.index(n)] for n in written
                   if n in names[:len(args)] and isinstance(args[names.index(n)], torch.Tensor)}
        before = {n: t.clone() for n, t in targets.items()}
        try:
            op(*args, **kwargs)
        except (ValueError, TypeError, NotImplementedError, RuntimeError):
            refused += 1
            for n, t in targets.items():
                assert bitwise_equal(t, before[n]), \
                    f"{op_name(op)}: {n} written by a call refused for its {spoiled}"
    assert refused > 0, "no spoiled call was refused: the test spoiled nothing"
