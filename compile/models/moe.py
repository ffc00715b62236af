"""GPT-OSS style mixture of experts: top-k router with bias, clamped SwiGLU experts with biases.

Written densely for small reference models: every expert runs on every token and the router's
top-k softmax weights (zero elsewhere) mix the results, so there is no data-dependent control
flow, no Python loop over tokens or experts and no host sync. Parameter names and layouts match
``transformers``' ``GptOssMLP`` (gate/up interleaved along the last dim).
Source: gpt-oss model card (arXiv 2508.10925), SwiGLU with clamp and ``(up + 1)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class TopKRouter(nn.Module):
    """``logits = x W^T + b``; softmax over the top-k logits; returns dense ``[T, E]`` weights."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=dtype, device=device))
        self.top_k = top_k

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, hidden] -> [T, E]`` routing weights, zero outside each token's top-k."""
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        top, idx = torch.topk(logits, self.top_k, dim=-1)
        return torch.zeros_like(logits).scatter(-1, idx, torch.softmax(top, dim=-1))


class Experts(nn.Module):
    """E experts: ``down((up + 1) * gate * sigmoid(alpha * gate))`` with clamped gate/up."""

    def __init__(self, hidden: int, inter: int, num_experts: int, alpha: float, limit: float,
                 dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, hidden, 2 * inter, **kw))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * inter, **kw))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, inter, hidden, **kw))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden, **kw))
        self.alpha, self.limit = alpha, limit

    def forward(self, x: Tensor, weights: Tensor) -> Tensor:
        """``x [T, hidden]``, ``weights [T, E]`` -> ``[T, hidden]``: every expert runs on every
        token (dense einsum), outputs summed with ``weights``.
        """
        gate_up = torch.einsum("th,ehf->etf", x, self.gate_up_proj)
        gate_up = gate_up + self.gate_up_proj_bias[:, None]  # [E, T, 2I], gate/up interleaved
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        act = (up + 1) * gate * torch.sigmoid(gate * self.alpha)  # [E, T, I]
        out = torch.einsum("eti,eih->eth", act, self.down_proj) + self.down_proj_bias[:, None]
        return torch.einsum("eth,te->th", out, weights.to(out.dtype))


class MoEMLP(nn.Module):
    """Router plus experts (``config.num_local_experts``, ``num_experts_per_tok``)."""

    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        h, i, e = config.hidden_size, config.intermediate_size, config.num_local_experts
        self.router = TopKRouter(h, e, config.num_experts_per_tok, dtype, device)
        self.experts = Experts(h, i, e, config.swiglu_alpha, config.swiglu_limit, dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, hidden] -> [T, hidden]``: route, then the weighted expert sum."""
        return self.experts(x, self.router(x))


__all__ = ["MoEMLP", "TopKRouter", "Experts"]
