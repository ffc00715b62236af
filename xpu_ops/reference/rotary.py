"""Reference ``apply_rotary_emb``: gather the angle rows, rotate the pairs in float32."""

from __future__ import annotations

import torch

from .. import provider_table


@provider_table.register("apply_rotary_emb", "reference")
def apply_rotary_emb(x, cos, sin, positions, *, interleaved):
    """Reference ``apply_rotary_emb`` (contract: ``xpu_ops/ops/rotary.py``).

    ``cos[positions]`` / ``sin[positions]`` (positions clamped into the tables) broadcast over
    heads; the first ``rotary_dim`` features are split into pairs (halves for NeoX, even/odd for
    interleaved), rotated in float32 and written back in x's dtype.
    """
    half = cos.shape[1]
    out = x.contiguous().clone()
    if x.shape[0] == 0 or half == 0 or cos.shape[0] == 0:
        return out
    rows = positions.long().clamp(0, cos.shape[0] - 1)
    c, s = cos[rows].float()[:, None, :], sin[rows].float()[:, None, :]     # [N, 1, half]
    rot = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    out[..., :2 * half] = rotated.to(x.dtype)
    return out
