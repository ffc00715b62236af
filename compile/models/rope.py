"""Rotary position embedding with Llama-3, linear and YaRN scaling, in two feature layouts.

``RotaryEmbedding`` is the neox / ``rotate_half`` layout (features ``i`` and ``i + D/2`` rotate
together: Llama, Qwen, Gemma); ``InterleavedRotaryEmbedding`` the GPT-J / complex-pair layout
(features ``2i`` and ``2i + 1``: Llama 4, Meta's reference code, DeepSeek).

The cos/sin table is computed once for every position, so the forward pass is one gather by
``positions`` and a few elementwise ops: no Python loop over tokens, no host sync.
Source: RoFormer (arXiv 2104.09864); Llama 3 frequency scaling as in Meta's llama3 reference;
YaRN (arXiv 2309.00071) as DeepSeek-V2/V3 configure it.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor, nn


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict[str, Any]]) -> Tensor:
    """Inverse frequencies [head_dim // 2] float32 of RoPE, after the configured scaling.

    Args:
        head_dim: D (rotated features; must be even).
        theta: RoPE base.
        scaling: None, ``{"rope_type": "linear", "factor": f}``, ``{"rope_type": "llama3",
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``
            or ``{"rope_type": "yarn", "factor", "original_max_position_embeddings"}`` with
            optional ``beta_fast`` (32), ``beta_slow`` (1), ``truncate`` (True); YaRN's
            attention factor is the caller's (``yarn_mscale``).
    Raises:
        NotImplementedError: another rope_type.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_scale(inv_freq, head_dim, theta, scaling)
    raise NotImplementedError(f"rope_inv_freq: rope_type {rope_type!r} is not supported; "
                              "expected default, linear, llama3 or yarn.")


def _llama3_scale(inv_freq: Tensor, s: dict[str, Any]) -> Tensor:
    """Llama 3.1: divide low frequencies by ``factor``, keep high ones, blend in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_scale(inv_freq: Tensor, dim: int, base: float, s: dict[str, Any]) -> Tensor:
    """YaRN: interpolate (divide by ``factor``) the frequencies that turn fewer than
    ``beta_slow`` times over the original context, keep those that turn more than ``beta_fast``
    times, blend linearly between (by dimension index)."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # dimension index turning `rotations` times
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_angles(head_dim: int, max_position: int, theta: float,
                scaling: Optional[dict[str, Any]]) -> Tensor:
    """Rotation angles ``position * inv_freq[i]``, [max_position, head_dim // 2] float32."""
    positions = torch.arange(max_position, dtype=torch.int64).float()
    return torch.outer(positions, rope_inv_freq(head_dim, theta, scaling))


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (neox layout); same shape and dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _AngleTables(nn.Module):
    """``cos_cached``/``sin_cached``: cos and sin of ``angles [max_position, n]`` (float32,
    non-persistent buffers: recomputed from the config, never loaded)."""

    def __init__(self, angles: Tensor):
        super().__init__()
        self.register_buffer("cos_cached", angles.cos(), persistent=False)
        self.register_buffer("sin_cached", angles.sin(), persistent=False)

    def angles_at(self, positions: Tensor, dtype: Optional[torch.dtype] = None
                  ) -> tuple[Tensor, Tensor]:
        """``cos, sin [T, 1, n]`` of ``positions [T]`` (float32, or ``dtype``), broadcasting over
        heads."""
        cos = self.cos_cached[positions]
        cos = (cos if dtype is None else cos.to(dtype)).unsqueeze(1)
        sin = self.sin_cached[positions]
        sin = (sin if dtype is None else sin.to(dtype)).unsqueeze(1)
        return cos, sin


class RotaryEmbedding(_AngleTables):
    """Applies RoPE to packed q/k by absolute position.

    Args:
        head_dim: D. max_position: positions in the table. theta, scaling: see ``rope_inv_freq``.
    Forward:
        positions: [T] int64; q: [T, Hq, D]; k: [T, Hkv, D] (any float dtype).
        Returns (q, k) rotated, same shapes and dtypes.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: Optional[dict[str, Any]] = None):
        freqs = rope_angles(head_dim, max_position, theta, scaling)
        super().__init__(torch.cat((freqs, freqs), dim=-1))  # [max_position, D]

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by ``positions [T]``; shapes kept."""
        cos, sin = self.angles_at(positions, q.dtype)  # [T, 1, D]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def rotate(self, positions: Tensor, x: Tensor) -> Tensor:
        """Rotate ``x [T, H, D]`` (any heads, e.g. q and k side by side) by ``positions [T]``."""
        cos, sin = self.angles_at(positions, x.dtype)
        return x * cos + rotate_half(x) * sin


class InterleavedRotaryEmbedding(_AngleTables):
    """RoPE rotating feature pairs ``(2i, 2i + 1)`` by ``position * inv_freq[i]``, computed in
    float32 (``transformers``' ``torch.polar`` / ``view_as_complex`` form, written with real ops).

    Args:
        head_dim: D (rotated features; must be even). max_position: positions in the table.
        theta, scaling: see ``rope_inv_freq``.
    Forward:
        positions: [T] int64; q: [T, Hq, D]; k: [T, Hkv, D] (any float dtype).
        Returns (q, k) rotated, same shapes and dtypes.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: Optional[dict[str, Any]] = None):
        super().__init__(rope_angles(head_dim, max_position, theta, scaling))  # [max_pos, D/2]

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        pairs = x.float().unflatten(-1, (-1, 2))  # [T, H, D/2, 2]
        x0, x1 = pairs[..., 0], pairs[..., 1]
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        return out.flatten(-2).to(x.dtype)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by ``positions [T]``; shapes kept."""
        cos, sin = self.angles_at(positions)  # [T, 1, D/2] float32
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def rotate(self, positions: Tensor, x: Tensor) -> Tensor:
        """Rotate ``x [T, H, D]`` (any heads, e.g. q and k side by side) by ``positions [T]``."""
        return self._rotate(x, *self.angles_at(positions))


__all__ = ["RotaryEmbedding", "InterleavedRotaryEmbedding", "rope_angles", "rope_inv_freq",
           "rotate_half", "yarn_mscale"]
