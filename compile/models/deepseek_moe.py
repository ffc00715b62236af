"""DeepSeek mixture of experts (DeepSeek-V2, V3, V3.2): grouped top-k routing, routed experts
and shared experts.

Routing, per token (``x [T, hidden]``, E routed experts in ``n_group`` groups of ``E / n_group``):

1. ``logits = x W^T`` in float32 (``W [E, hidden]``, kept float32 as ``transformers`` keeps it);
   ``scores = softmax(logits)`` (V2, ``scoring_func="softmax"``) or ``sigmoid(logits)`` (V3,
   ``"sigmoid"``).
2. Selection scores: ``scores`` plus ``e_score_correction_bias`` (sigmoid routing only).
3. Group-limited (V2 ``topk_method="group_limited_greedy"``; always for V3): a group's score
   is its best expert's (V2) or the sum of its two best experts' (V3); experts outside the
   ``topk_group`` best groups are masked (0 for V2, -inf for V3).
4. The ``num_experts_per_tok`` best selections are the token's experts; their weights are the
   selection scores (V2) or the unbiased ``scores`` (V3), renormalised to sum 1 when
   ``norm_topk_prob`` (V3; ``transformers``' V2 never renormalises), then times
   ``routed_scaling_factor``.

Every routed expert is a SwiGLU ``down(silu(gate) * up)`` of ``moe_intermediate_size``; the
shared experts are one such MLP of ``n_shared_experts * moe_intermediate_size`` that every token
runs (a ``LlamaMLP``, gate/up fused; biases when ``mlp_bias``). The layer's output is
``sum_e weight_e expert_e(x) + shared(x)``.

Written densely, as ``compile.models.moe``: every expert runs on every token and the dense
``[T, E]`` routing weights (zero outside the token's top-k) mix the results, so the routing has
no data-dependent control flow, no Python loop over tokens or experts and no host sync; it
traces whole under ``torch.compile(fullgraph=True)``. Parameter names and layouts match
``transformers``' ``DeepseekV3MoE`` (``gate``, ``experts.gate_up_proj [E, 2I, hidden]`` gate then
up, ``experts.down_proj [E, hidden, I]``, ``shared_experts``).
Source: DeepSeek-V2 (arXiv 2405.04434) and DeepSeek-V3 (arXiv 2412.19437) routing; sglang's
``grouped_topk`` / ``biased_grouped_topk`` roles.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compile.models.llama import LlamaMLP

SCORING_FUNCS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Routing and sizes of one DeepSeek MoE layer (``transformers`` field names).

    Attributes:
        n_routed_experts: E. num_experts_per_tok: top-k experts per token.
        moe_intermediate_size: I of each expert. n_shared_experts: shared experts (0: none).
        scoring_func: "softmax" (V2) or "sigmoid" (V3, with ``e_score_correction_bias``).
        n_group, topk_group: expert groups and the groups a token may pick from; ``n_group``
            of 1 (or None) with softmax scoring means no group limit.
        norm_topk_prob: renormalise the top-k weights to sum 1 (sigmoid scoring only).
        routed_scaling_factor: multiplier on the routed weights.
    """

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        e, k, g = self.n_routed_experts, self.num_experts_per_tok, self.n_group
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"MoEConfig: scoring_func is {self.scoring_func!r}; expected one of "
                             f"{SCORING_FUNCS}.")
        if not 0 < k <= e:
            raise ValueError(f"MoEConfig: num_experts_per_tok {k} out of range; expected "
                             f"1 <= num_experts_per_tok <= n_routed_experts ({e}).")
        if g < 1 or e % g or not 1 <= self.topk_group <= g:
            raise ValueError(f"MoEConfig: groups do not divide the experts; expected n_group "
                             f"dividing {e} and 1 <= topk_group <= n_group, got n_group={g}, "
                             f"topk_group={self.topk_group}.")
        if self.scoring_func == "sigmoid" and e // g < 2:
            raise ValueError(f"MoEConfig: sigmoid routing scores a group by its two best "
                             f"experts; expected n_routed_experts / n_group >= 2, got {e // g}.")

    @property
    def grouped(self) -> bool:
        """Whether the group limit applies (always for sigmoid routing, as in V3)."""
        return self.scoring_func == "sigmoid" or self.n_group > 1


class GroupedTopKRouter(nn.Module):
    """``x [T, hidden] -> [T, E]`` float32 routing weights, zero outside each token's top-k
    (steps 1-4 of the module docstring). Parameters: ``weight [E, hidden]`` float32 and, for
    sigmoid scoring, ``e_score_correction_bias [E]`` float32 (a parameter here, a buffer in
    ``transformers``: both are in the state dict)."""

    def __init__(self, cfg: MoEConfig, hidden: int, device=None):
        super().__init__()
        e = cfg.n_routed_experts
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(e, hidden, dtype=torch.float32, device=device))
        self.e_score_correction_bias = None
        if cfg.scoring_func == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(e, dtype=torch.float32, device=device), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, hidden]`` -> dense weights ``[T, E]`` float32."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())                    # [T, E]
        sigmoid = cfg.scoring_func == "sigmoid"
        scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
        choice = scores if self.e_score_correction_bias is None else (
            scores + self.e_score_correction_bias)
        if cfg.grouped:
            choice = self._limit_groups(choice, fill=float("-inf") if sigmoid else 0.0)
        idx = torch.topk(choice, cfg.num_experts_per_tok, dim=-1).indices   # [T, k]
        weights = (scores if sigmoid else choice).gather(1, idx)
        if sigmoid and cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * cfg.routed_scaling_factor
        return torch.zeros_like(scores).scatter(1, idx, weights)

    def _limit_groups(self, choice: Tensor, fill: float) -> Tensor:
        """``choice [T, E]`` with the experts outside each token's ``topk_group`` best groups
        set to ``fill``."""
        cfg = self.cfg
        t, g = choice.shape[0], cfg.n_group
        grouped = choice.view(t, g, -1)                                     # [T, G, E / G]
        if cfg.scoring_func == "sigmoid":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)       # [T, G]
        else:
            group_scores = grouped.amax(dim=-1)
        best = torch.topk(group_scores, cfg.topk_group, dim=-1).indices    # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), fill).view(t, -1)


class RoutedExperts(nn.Module):
    """E SwiGLU experts, ``gate_up_proj [E, 2I, hidden]`` (gate rows then up rows) and
    ``down_proj [E, hidden, I]``: ``x [T, hidden]``, ``weights [T, E]`` -> ``[T, hidden]``,
    every expert on every token, summed with ``weights`` (zero for unrouted experts)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * inter, hidden, **kw))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, inter, **kw))

    def forward(self, x: Tensor, weights: Tensor) -> Tensor:
        """``x [T, hidden]``, ``weights [T, E]`` float32 -> ``[T, hidden]`` in x's dtype."""
        gate, up = torch.einsum("th,efh->etf", x, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("eti,ehi->eth", F.silu(gate) * up, self.down_proj)   # [E, T, hidden]
        return torch.einsum("eth,te->th", out.float(), weights).to(x.dtype)


class DeepseekMoE(nn.Module):
    """Router (``gate``), routed ``experts`` and ``shared_experts`` of one DeepSeek MoE layer.

    Args:
        cfg: MoEConfig. config: the decoder's ``DecoderConfig`` (``hidden_size``; ``mlp_bias``
            and ``hidden_act`` of the shared experts, a ``LlamaMLP``). dtype/device: of the
            expert weights (the router's stay float32).
    Forward:
        ``x [T, hidden] -> [T, hidden]``: routed experts' weighted sum plus the shared experts.
    """

    def __init__(self, cfg: MoEConfig, config, dtype=None, device=None):
        super().__init__()
        hidden = config.hidden_size
        self.gate = GroupedTopKRouter(cfg, hidden, device)
        self.experts = RoutedExperts(cfg.n_routed_experts, hidden, cfg.moe_intermediate_size,
                                     dtype, device)
        self.shared_experts = None
        if cfg.n_shared_experts:
            inter = cfg.n_shared_experts * cfg.moe_intermediate_size
            self.shared_experts = LlamaMLP(dataclasses.replace(config, intermediate_size=inter),
                                           dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, hidden] -> [T, hidden]``."""
        out = self.experts(x, self.gate(x))
        return out if self.shared_experts is None else out + self.shared_experts(x)


__all__ = ["MoEConfig", "GroupedTopKRouter", "RoutedExperts", "DeepseekMoE", "SCORING_FUNCS"]
