"""Reference ``merge_state_v2`` (natural-log LSE) and ``merge_state`` (base-2 LSE) in float32."""

from __future__ import annotations

import math

import torch

from .. import provider_table


@provider_table.register("merge_state_v2", "reference")
def merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged):
    """Reference ``merge_state_v2`` (contract: ``xpu_ops/ops/merge_state.py``).

    LSE-weighted sum of two partial outputs in float32, written into ``v_merged [N, H, D]`` and
    ``s_merged [N, H]``; an empty side (LSE ``-inf`` or ``+inf``) adds nothing, even if its values
    are NaN. A NaN LSE (either side) gives NaN ``v`` and ``s`` for that token and head.
    """
    _merge(v_a, s_a, v_b, s_b, v_merged, s_merged, torch.exp, torch.log)


@provider_table.register("merge_state", "reference")
def merge_state(v_a, s_a, v_b, s_b, v_merged, s_merged):
    """Reference ``merge_state`` (contract: ``xpu_ops/ops/merge_state.py``): as
    ``merge_state_v2`` with base-2 LSEs (``exp2``/``log2``)."""
    _merge(v_a, s_a, v_b, s_b, v_merged, s_merged, torch.exp2, torch.log2)


def _merge(v_a, s_a, v_b, s_b, v_merged, s_merged, exp, log):
    s_a = torch.where(s_a == math.inf, -math.inf, s_a)     # +inf (FlashAttention's empty row)
    s_b = torch.where(s_b == math.inf, -math.inf, s_b)     # is an empty state, like -inf
    s_max = torch.maximum(s_a, s_b)
    s_max = torch.where(torch.isfinite(s_max), s_max, 0.0)   # both sides empty: no NaN
    w_a = exp(s_a - s_max)
    w_b = exp(s_b - s_max)
    total = w_a + w_b
    # where(), not multiplication, so an empty side's values (possibly NaN) never leak in.
    part_a = torch.where(w_a[..., None] > 0, w_a[..., None] * v_a.float(), 0.0)
    part_b = torch.where(w_b[..., None] > 0, w_b[..., None] * v_b.float(), 0.0)
    merged = (part_a + part_b) / torch.where(total > 0, total, 1.0)[..., None]
    # a NaN LSE on either side makes the token-head NaN, as the kernels' arithmetic does
    nan = torch.isnan(s_a) | torch.isnan(s_b)
    v_merged.copy_(torch.where(nan[..., None], math.nan, merged).to(v_merged.dtype))
    s_merged.copy_(torch.where(nan, math.nan, s_max + log(total)))
