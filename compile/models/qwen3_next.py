"""Qwen3-Next and Qwen3.5 (text, dense or MoE): gated-delta-net linear attention mixed with gated
full attention (three linear layers per full one in the released models).

- Linear layers (``Qwen3NextGatedDeltaNet``): project into q, k, v (mixed for the causal conv),
  the output gate z and the gating inputs b, a; ``compile.backend.LinearAttention`` runs the
  conv, the gating and the delta rule on the request's state slot; a gated RMSNorm
  (``norm(o) * silu(z)``) and ``out_proj`` follow. Qwen3-Next projects q/k/v/z and b/a in two
  matrices grouped per key head (``in_proj_qkvz``, ``in_proj_ba``); Qwen3.5 in four plain ones
  (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).
- Full layers (``Qwen3NextAttention``): ``q_proj`` yields the query and a per-head output gate
  (``o * sigmoid(gate)`` before ``o_proj``), zero-centred RMSNorm on q and k, RoPE on the
  first ``partial_rotary_factor * D`` features (neox layout), paged attention.
- MLP: Qwen3-Next's sparse MoE (softmax top-k router, renormalised when ``norm_topk_prob``,
  plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``) on the layers
  ``decoder_sparse_step`` picks, a dense gated MLP elsewhere; Qwen3.5 is dense, Qwen3.5-MoE
  has the same MoE on every layer.
- Every hidden-state RMSNorm is zero-centred (``x * (1 + weight)``).

Qwen3.5 uses multimodal RoPE; for text its three position rows are equal, which is plain RoPE
over the same frequencies. Parameter names are ``transformers``' (``from_hf`` copies by name).
Source: ``transformers`` ``models/qwen3_next/modeling_qwen3_next.py`` and
``models/qwen3_5/modeling_qwen3_5.py``, ``models/qwen3_5_moe/modeling_qwen3_5_moe.py``;
sglang 0.5.23 ``models/qwen3_next.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compile.backend import LinearAttention, PagedAttention
from compile.models.decoder import DecoderForCausalLM, DecoderModel, RMSNorm
from compile.models.llama import LlamaMLP
from compile.models.qwen3_next_config import Qwen3NextConfig
from compile.models.rope import RotaryEmbedding
from compile.models.weights import TextOnly, copy_from_hf


class GatedRMSNorm(nn.Module):
    """``weight * rms_norm(x) * silu(gate)``: normalised in float32, scaled in x's dtype, gated
    in float32, returned in x's dtype (``transformers``' ``Qwen3NextRMSNormGated``)."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        """``x``, ``gate [..., dim]`` -> same shape, x's dtype."""
        xf = x.float()
        y = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
                           ).to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)


class Qwen3NextGatedDeltaNet(nn.Module):
    """A linear-attention layer: projections, ``LinearAttention``, gated norm, ``out_proj``."""

    def __init__(self, config: Qwen3NextConfig, layer_id: int, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        c, hidden = config, config.hidden_size
        self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        key_dim, value_dim = self.hk * self.dk, self.hv * self.dv
        self.split_projections = c.split_projections
        if c.split_projections:  # Qwen3.5
            self.in_proj_qkv = nn.Linear(hidden, 2 * key_dim + value_dim, bias=False, **kw)
            self.in_proj_z = nn.Linear(hidden, value_dim, bias=False, **kw)
            self.in_proj_b = nn.Linear(hidden, self.hv, bias=False, **kw)
            self.in_proj_a = nn.Linear(hidden, self.hv, bias=False, **kw)
        else:
            self.in_proj_qkvz = nn.Linear(hidden, 2 * key_dim + 2 * value_dim, bias=False, **kw)
            self.in_proj_ba = nn.Linear(hidden, 2 * self.hv, bias=False, **kw)
        conv_dim = 2 * key_dim + value_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, c.linear_conv_kernel_dim, groups=conv_dim,
                                bias=False, padding=c.linear_conv_kernel_dim - 1, **kw)
        self.dt_bias = nn.Parameter(torch.ones(self.hv, **kw))
        self.A_log = nn.Parameter(torch.zeros(self.hv, **kw))
        self.norm = GatedRMSNorm(self.dv, c.rms_norm_eps, **kw)
        self.out_proj = nn.Linear(value_dim, hidden, bias=False, **kw)
        self.attn = LinearAttention(layer_id, self.hk, self.hv, self.dk, self.dv,
                                    self.conv1d.weight, self.A_log, self.dt_bias,
                                    activation=c.hidden_act)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``x [T, hidden]`` -> ``mixed_qkv [T, 2 Hk K + Hv V]`` (q, k, v side by side),
        ``z [T, Hv, V]``, ``b [T, Hv]``, ``a [T, Hv]``."""
        t = x.shape[0]
        if self.split_projections:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(t, self.hv, self.dv),
                    self.in_proj_b(x), self.in_proj_a(x))
        r = self.hv // self.hk  # value heads per key head; projections are grouped by key head
        qkvz = self.in_proj_qkvz(x).view(t, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return (mixed, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv),
                a.reshape(t, self.hv))

    def forward(self, positions: Tensor, x: Tensor, forward_batch) -> Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; updates the requests' linear states."""
        mixed, z, b, a = self.project(x)
        core = self.attn(mixed, a, b, forward_batch)                      # [T, Hv, V]
        core = self.norm(core, z).reshape(x.shape[0], self.hv * self.dv)
        return self.out_proj(core)


class Qwen3NextAttention(nn.Module):
    """Gated full attention: fused q(+gate)/k/v projection, zero-centred q/k norms, partial RoPE,
    paged attention, ``o * sigmoid(gate)``, ``o_proj``."""

    def __init__(self, config: Qwen3NextConfig, layer_id: int, rotary: RotaryEmbedding,
                 dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.hq, self.hkv, self.d, self.rd = hq, hkv, d, config.rotary_dim
        self.qkv_proj = nn.Linear(config.hidden_size, (2 * hq + 2 * hkv) * d,
                                  bias=config.attention_bias, **kw)
        self.o_proj = nn.Linear(hq * d, config.hidden_size, bias=config.attention_bias, **kw)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, 1.0, **kw)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, 1.0, **kw)
        self.rotary_emb = rotary
        self.attn = PagedAttention(hq, d, config.scaling, num_kv_heads=hkv, layer_id=layer_id)

    def forward(self, positions: Tensor, x: Tensor, forward_batch) -> Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; writes this step's K/V into the cache."""
        t = x.shape[0]
        qg, k, v = self.qkv_proj(x).split([2 * self.hq * self.d, self.hkv * self.d,
                                           self.hkv * self.d], dim=-1)
        q, gate = qg.view(t, self.hq, 2 * self.d).chunk(2, dim=-1)       # [T, Hq, D] each
        q, k = self.q_norm(q), self.k_norm(k.view(t, self.hkv, self.d))
        q_rot, k_rot = self.rotary_emb(positions, q[..., :self.rd], k[..., :self.rd])
        q = torch.cat([q_rot, q[..., self.rd:]], dim=-1)
        k = torch.cat([k_rot, k[..., self.rd:]], dim=-1)
        out = self.attn(q.reshape(t, self.hq * self.d), k, v, forward_batch)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, self.hq * self.d)))


class Qwen3NextSparseMoe(nn.Module):
    """Softmax top-k router over ``num_experts`` SwiGLU experts plus a gated shared expert.

    Written densely for small models (every expert on every token, weights zero outside each
    token's top-k): no data-dependent control flow or host sync. Parameter layouts are
    ``transformers``': ``gate.weight [E, hidden]``, ``experts.gate_up_proj [E, 2 I, hidden]``,
    ``experts.down_proj [E, hidden, I]``, ``shared_expert_gate.weight [1, hidden]``.
    """

    def __init__(self, config: Qwen3NextConfig, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False, **kw)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h, **kw))
        self.experts.down_proj = nn.Parameter(torch.zeros(e, h, i, **kw))
        shared = dataclasses.replace(config,
                                     intermediate_size=config.shared_expert_intermediate_size)
        self.shared_expert = LlamaMLP(shared, **kw)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False, **kw)

    def route(self, x: Tensor) -> Tensor:
        """``x [T, hidden]`` -> ``[T, E]`` weights in x's dtype, zero outside the top-k."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs).scatter(-1, idx, top).to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, hidden] -> [T, hidden]``."""
        weights = self.route(x)
        gate, up = torch.einsum("th,efh->etf", x, self.experts.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("eti,ehi->eth", F.silu(gate) * up, self.experts.down_proj)
        routed = torch.einsum("eth,te->th", out, weights)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextDecoderLayer(nn.Module):
    """Pre-norm block: ``linear_attn`` or ``self_attn``, then the MLP (zero-centred norms)."""

    def __init__(self, config: Qwen3NextConfig, layer_id: int, rotary: RotaryEmbedding,
                 dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.is_linear = config.layer_types[layer_id] == "linear_attention"
        if self.is_linear:
            self.linear_attn = Qwen3NextGatedDeltaNet(config, layer_id, **kw)
        else:
            self.self_attn = Qwen3NextAttention(config, layer_id, rotary, **kw)
        self.mlp = (Qwen3NextSparseMoe(config, **kw) if config.layer_is_moe(layer_id)
                    else LlamaMLP(config, **kw))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, 1.0, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, 1.0,
                                                **kw)

    def forward(self, positions: Tensor, h: Tensor, forward_batch) -> Tensor:
        """``h [T, hidden]``, ``positions [T]`` -> ``[T, hidden]``."""
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h = h + mixer(positions, self.input_layernorm(h), forward_batch)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3NextModel(DecoderModel):
    """``DecoderModel`` of ``Qwen3NextDecoderLayer``s sharing one partial RoPE table."""

    def __init__(self, config: Qwen3NextConfig, dtype=None, device=None):
        rotary = RotaryEmbedding(config.rotary_dim, config.max_position_embeddings,
                                 config.rope_theta).to(device)
        super().__init__(config, lambda i: Qwen3NextDecoderLayer(config, i, rotary, dtype, device),
                         dtype, device, norm_offset=1.0)


class Qwen3NextForCausalLM(DecoderForCausalLM):
    """``DecoderForCausalLM`` of a ``Qwen3NextModel`` (Qwen3-Next or Qwen3.5 text); same
    calling convention as ``compile.models.LlamaForCausalLM``.

    Runs on a paged KV pool (full-attention layers) and a ``LinearStatePool`` (linear layers);
    ``compile.engine.Engine`` builds both and a ``HybridLinearAttnBackend``.
    Args:
        config: Qwen3NextConfig. dtype/device: of the parameters (the RoPE table stays float32).
    Forward:
        input_ids: [T] int64. positions: [T] int64. forward_batch: ForwardBatch with metadata.
        return_all_logits: False keeps only each request's last token in extend modes.
    Returns:
        logits [T or b, vocab_size] float32.
    """

    model_class = Qwen3NextModel


def from_hf(hf_model, dtype: Optional[torch.dtype] = None, device=None) -> Qwen3NextForCausalLM:
    """Zoo ``Qwen3NextForCausalLM`` holding a copy of a ``transformers``
    ``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM`` or ``Qwen3_5MoeForCausalLM``'s weights
    (q+gate/k/v and gate/up fused), or of the text part of a multimodal
    ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` (its language
    model under ``model.language_model.`` and its LM head; the vision tower is left out).

    Raises:
        NotImplementedError: see ``Qwen3NextConfig.from_hf``.
        KeyError, ValueError: a missing or mis-shaped source tensor.
    """
    config = Qwen3NextConfig.from_hf(hf_model.config)
    return copy_from_hf(Qwen3NextForCausalLM, config, TextOnly(hf_model), dtype, device)


__all__ = ["Qwen3NextConfig", "Qwen3NextForCausalLM", "Qwen3NextGatedDeltaNet",
           "Qwen3NextAttention", "Qwen3NextSparseMoe", "GatedRMSNorm", "from_hf"]
