"""Llama 4 text decoder over the paged KV cache (``transformers``' ``Llama4ForCausalLM``).

Built from the Llama zoo's pieces (``RMSNorm``, ``LlamaMLP``, ``LlamaAttention``'s projections
and ``PagedAttention``); what Llama 4 changes (``Llama4Config``):

- RoPE rotates interleaved feature pairs ``(2i, 2i + 1)`` (``InterleavedRotaryEmbedding``), and
  only on the layers ``use_rope`` marks; the others are NoPE layers (every fourth by default).
- iRoPE: RoPE layers are "chunked_attention" layers, where the token at position ``p`` sees
  only keys ``C * (p // C) .. p`` (``C = attention_chunk_size``); the backend runs them as
  chunk-local virtual requests (``compile.backend.local_attention``). NoPE layers attend globally.
- RoPE layers L2-normalise q and k (weightless RMS norm) after RoPE (``qk_l2_norm``).
- NoPE layers scale queries by an attention temperature that grows with the position
  (``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``).
- Dense layers' MLP has ``intermediate_size_mlp`` features; ``moe_layers`` use ``Llama4MoE``.
- The attention output projection carries a bias whenever q/k/v do (``attention_bias``).

Source: Meta's Llama 4 model card (iRoPE), ``transformers`` ``models/llama4/modeling_llama4.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compile.models.config import Llama4Config
from compile.models.decoder import PreNormDecoderLayer
from compile.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from compile.models.weights import copy_from_hf
from compile.models.rope import InterleavedRotaryEmbedding


def l2_norm(x: Tensor, eps: float) -> Tensor:
    """``x / rms(x)`` over the last dim in float32, no weight; same shape and dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(LlamaAttention):
    """``LlamaAttention`` (fused qkv, ``PagedAttention``, chunked-local on "chunked_attention"
    layers) with Llama 4's order: RoPE, then the L2 QK norm (RoPE layers), or the attention
    temperature (NoPE layers)."""

    def __init__(self, config: Llama4Config, layer_id: int,
                 rotary: Optional[InterleavedRotaryEmbedding], dtype=None, device=None):
        super().__init__(config, layer_id, rotary, dtype, device)
        self.eps = config.rms_norm_eps
        self.qk_l2_norm = config.qk_l2_norm and rotary is not None
        self.temperature_tuning = config.attn_temperature_tuning and rotary is None
        self.floor_scale, self.attn_scale = config.floor_scale, config.attn_scale

    def forward(self, positions: Tensor, hidden_states: Tensor, forward_batch) -> Tensor:
        """``hidden_states [T, hidden]``, ``positions [T]`` -> ``[T, hidden]``; writes this
        step's K/V into the cache through ``PagedAttention``.
        """
        q, k, v = self.project_qkv(hidden_states)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        if self.qk_l2_norm:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.temperature_tuning:  # [T] per-token query scale, >= 1
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale))
            q = (q * (scale * self.attn_scale + 1.0)[:, None, None]).to(q.dtype)
        return self.attend(q, k, v, forward_batch)


class Llama4Experts(nn.Module):
    """E SwiGLU experts, ``down(silu(gate) * up)``, each run on its own (pre-scaled) input.

    Parameter layouts match ``transformers``: ``gate_up_proj [E, hidden, 2I]`` (gate then up),
    ``down_proj [E, I, hidden]``.
    """

    def __init__(self, hidden: int, inter: int, num_experts: int, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, hidden, 2 * inter, **kw))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, inter, hidden, **kw))

    def forward(self, x: Tensor) -> Tensor:
        """``x [E, T, hidden]`` (expert e's input in row e) -> ``[T, hidden]``, summed over e."""
        gate, up = torch.bmm(x, self.gate_up_proj).chunk(2, dim=-1)  # [E, T, I] each
        return torch.bmm(F.silu(gate) * up, self.down_proj).sum(0)


class Llama4MoE(nn.Module):
    """Llama 4's MoE: a top-k router whose sigmoid scores scale each expert's *input*,
    ``Llama4Experts``, plus a shared expert (``LlamaMLP``, ``intermediate_size``) on every token.

    Written densely for small reference models (every expert runs on every token with a zero
    score outside the top-k), so there is no data-dependent control flow and no host sync.
    """

    def __init__(self, config: Llama4Config, dtype=None, device=None):
        super().__init__()
        h, i, e = config.hidden_size, config.intermediate_size, config.num_local_experts
        self.router = nn.Linear(h, e, bias=False, dtype=dtype, device=device)
        self.experts = Llama4Experts(h, i, e, dtype, device)
        self.shared_expert = LlamaMLP(config, dtype, device)
        self.top_k = config.num_experts_per_tok

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, hidden] -> [T, hidden]``."""
        logits = self.router(x)  # [T, E]
        top, idx = torch.topk(logits, self.top_k, dim=-1)
        scores = torch.zeros_like(logits).scatter(-1, idx, torch.sigmoid(top.float()).to(x.dtype))
        routed = torch.einsum("th,te->eth", x, scores)  # [E, T, hidden]
        return self.shared_expert(x) + self.experts(routed)


class Llama4DecoderLayer(PreNormDecoderLayer):
    """``PreNormDecoderLayer`` of ``Llama4Attention`` and, as ``feed_forward``, the dense MLP
    (``intermediate_size_mlp``) or, on ``moe_layers``, ``Llama4MoE``."""

    mlp_name = "feed_forward"  # the checkpoint's name

    def __init__(self, config: Llama4Config, layer_id: int, rotary, dtype=None, device=None):
        self_attn = Llama4Attention(config, layer_id, rotary, dtype, device)
        if layer_id in config.moe_layers:
            feed_forward = Llama4MoE(config, dtype, device)
        else:
            dense = dataclasses.replace(config, intermediate_size=config.intermediate_size_mlp)
            feed_forward = LlamaMLP(dense, dtype, device)
        super().__init__(config, self_attn, feed_forward, dtype, device,
                         norm_offset=config.norm_weight_offset)


class Llama4Model(LlamaModel):
    """``LlamaModel`` of ``Llama4DecoderLayer``s sharing one interleaved RoPE table (NoPE
    layers get none)."""

    decoder_layer_class = Llama4DecoderLayer
    rotary_class = InterleavedRotaryEmbedding


class Llama4ForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` of a ``Llama4Model``; same calling convention.

    Args:
        config: Llama4Config. dtype/device: of the parameters (the RoPE table stays float32).
    Forward:
        input_ids: [T] int64. positions: [T] int64. forward_batch: ForwardBatch with metadata
            (the engine's backend gets ``attention_chunk_size`` from ``config``).
        return_all_logits: False keeps only each request's last token in extend modes.
    Returns:
        logits [T or b, vocab_size] float32.
    """

    model_class = Llama4Model


def from_hf(hf_model, dtype: Optional[torch.dtype] = None, device=None) -> Llama4ForCausalLM:
    """Zoo ``Llama4ForCausalLM`` holding a copy of a ``transformers`` ``Llama4ForCausalLM``'s
    weights (q/k/v and gate/up fused).

    Raises:
        NotImplementedError: see ``Llama4Config.from_hf``.
        KeyError, ValueError: a missing or mis-shaped source tensor.
    """
    config = Llama4Config.from_hf(hf_model.config)
    return copy_from_hf(Llama4ForCausalLM, config, hf_model, dtype, device)


__all__ = ["Llama4ForCausalLM", "Llama4Model", "Llama4DecoderLayer", "Llama4Attention",
           "Llama4MoE", "Llama4Experts", "from_hf", "l2_norm"]
