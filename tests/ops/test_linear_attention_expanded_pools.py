"""The linear-attention ops that write state pools (``causal_conv1d_fn``/``_update``,
``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule`` and its intermediate states,
``gdn_attention``) refuse an expanded pool (every slot one memory location: each request's
write lands on the others' slots, and the call used to succeed) with a ValueError naming the
argument, eagerly and with fake tensors, before any write."""

from __future__ import annotations

import pytest
import torch

import xpu_ops  # noqa: F401  (registers the ops)
from xpu_ops.testing import sample_inputs

from .utils import error_message

OPS = torch.ops.xpu_ops
# (op, position of the written pool, its name, a sample that writes it)
CASES = [("causal_conv1d_fn", 3, "conv_states", 0),
         ("causal_conv1d_update", 1, "conv_state", 0),
         ("chunk_gated_delta_rule", 6, "ssm_states", 0),
         ("fused_recurrent_gated_delta_rule", 6, "ssm_states", 0),
         ("gdn_attention", 7, "conv_states", 0),
         ("gdn_attention", 8, "ssm_states", 0)]


def _expanded(pool: torch.Tensor) -> torch.Tensor:
    """A pool of the same shape whose slots all share slot 0's memory."""
    return pool[:1].clone().expand(pool.shape)


def _with(name: str, index: int, position: int, value) -> list:
    args = list(list(sample_inputs(getattr(OPS, name), "cpu", seed=5))[index][0])
    args[position] = value(args[position])
    return args


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("name,position,arg,index", CASES,
                         ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_expanded_pool_is_refused_before_any_write(name, position, arg, index, fake):
    args = _with(name, index, position, _expanded)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    message = error_message(lambda **kw: getattr(OPS, name)(*kw.values()),
                            {str(i): a for i, a in enumerate(args)}, fake)
    assert message.startswith(f"ValueError: {name}: {arg} has elements that share memory"), \
        message
    for got, want in zip(args, before):
        if isinstance(got, torch.Tensor):
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
def test_expanded_intermediate_states_are_refused(fake):
    # the verify scratch [rows, max_steps, Hv, K, V]: each request's row its own
    samples = list(sample_inputs(OPS.fused_recurrent_gated_delta_rule, "cpu", seed=5))
    args = next(list(s[0]) for s in samples if s[0][10] is not None)
    args[10] = _expanded(args[10])
    message = error_message(lambda **kw: OPS.fused_recurrent_gated_delta_rule(*kw.values()),
                            {str(i): a for i, a in enumerate(args)}, fake)
    assert message.startswith("ValueError: fused_recurrent_gated_delta_rule: "
                              "intermediate_states has elements that share memory"), message
