"""Llama-family decoder over the paged KV cache, written the way sglang writes ``llama.py``.

Tokens are packed: every tensor in the forward pass is ``[T, ...]`` for the ``T`` new tokens of
the batch, whatever the requests; ``forward_batch`` (a ``compile.batch.forward_batch.ForwardBatch``)
says which request each token belongs to and is only read by ``PagedAttention``. Attention is the
only place that sees the cache, so the same module runs extend, decode and target verify.

Covers (``ModelConfig``): RMSNorm, RoPE with Llama-3/linear scaling, GQA, SwiGLU/GeGLU, tied
embeddings, QK-norm (Qwen3), per-layer sliding window, chunked local attention (iRoPE, optional
NoPE layers), logit softcap and sandwich norms (Gemma2), attention sinks and a mixture-of-experts
MLP (GPT-OSS).
Source: Llama (arXiv 2302.13971), sglang ``python/sglang/srt/models/llama.py`` structure.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compile.backend import PagedAttention
from compile.models.config import ModelConfig
from compile.models.decoder import (DecoderForCausalLM, DecoderModel, PreNormDecoderLayer,
                                    RMSNorm)
from compile.models.moe import MoEMLP
from compile.models.rope import RotaryEmbedding


class LlamaMLP(nn.Module):
    """Gated MLP with the gate and up projections fused: ``down(act(gate) * up)``."""

    def __init__(self, config: ModelConfig, dtype=None, device=None):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=config.mlp_bias, dtype=dtype, device=device)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias, dtype=dtype, device=device)
        if config.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise NotImplementedError(f"LlamaMLP: hidden_act {config.hidden_act!r} is not "
                                      "supported; expected silu or gelu_pytorch_tanh.")
        self.act = config.hidden_act

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, hidden] -> [T, hidden]``."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        gate = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(gate * up)


class LlamaAttention(nn.Module):
    """q/k/v projection (fused), optional QK-norm, RoPE, paged attention, output projection."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary: Optional[RotaryEmbedding],
                 dtype=None, device=None):
        super().__init__()
        hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.hq, self.hkv, self.d = hq, hkv, d
        self.qkv_proj = nn.Linear(config.hidden_size, (hq + 2 * hkv) * d,
                                  bias=config.attention_bias, dtype=dtype, device=device)
        self.o_proj = nn.Linear(hq * d, config.hidden_size, bias=config.o_proj_bias,
                                dtype=dtype, device=device)
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # Qwen3's plain weight; Gemma 3's 1 + weight
            offset = config.norm_weight_offset
            self.q_norm = RMSNorm(d, config.rms_norm_eps, offset, dtype=dtype, device=device)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, offset, dtype=dtype, device=device)
        self.rotary_emb = rotary  # shared by all layers; None for NoPE layers
        self.sinks = None
        if config.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(hq, dtype=torch.float32, device=device))
        self.attn = PagedAttention(
            hq, d, config.scaling, num_kv_heads=hkv, layer_id=layer_id,
            logit_cap=config.attn_logit_softcap,
            sliding_window_size=config.layer_sliding_window(layer_id),
            use_irope=config.layer_types[layer_id] == "chunked_attention")

    def forward(self, positions: Tensor, hidden_states: Tensor, forward_batch) -> Tensor:
        """``hidden_states [T, hidden]``, ``positions [T]`` -> ``[T, hidden]``; writes this
        step's K/V into the cache through ``PagedAttention``.
        """
        if self.q_norm is None and self.rotary_emb is not None:
            return self.attend(*self.project_rotated_qkv(positions, hidden_states),
                               forward_batch)
        q, k, v = self.project_qkv(hidden_states)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.attend(q, k, v, forward_batch)

    def project_rotated_qkv(self, positions: Tensor, hidden_states: Tensor
                            ) -> tuple[Tensor, Tensor, Tensor]:
        """``project_qkv`` with RoPE applied to q and k as one ``[T, Hq + Hkv, D]`` view of the
        projection (one elementwise kernel for both when compiled, not one each); q and k are
        views of the rotated tensor (row stride ``(Hq + Hkv) * D``)."""
        qkv = self.qkv_proj(hidden_states)  # [T, (Hq + 2 Hkv) * D]
        qk, v = qkv.split([(self.hq + self.hkv) * self.d, self.hkv * self.d], dim=-1)
        qk = self.rotary_emb.rotate(positions, qk.view(-1, self.hq + self.hkv, self.d))
        q, k = qk.split([self.hq, self.hkv], dim=1)
        return q, k, v

    def project_qkv(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``[T, hidden]`` -> ``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv * D]``."""
        qkv = self.qkv_proj(hidden_states)  # [T, (Hq + 2 Hkv) * D]
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        return q.view(-1, self.hq, self.d), k.view(-1, self.hkv, self.d), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, forward_batch) -> Tensor:
        """Paged attention (with the sinks, if any) of ``q [T, Hq, D]`` over the cache plus
        this step's ``k``/``v``, then ``o_proj`` -> ``[T, hidden]``."""
        extra = {} if self.sinks is None else {"sinks": self.sinks}
        out = self.attn(q.reshape(-1, self.hq * self.d), k, v, forward_batch, **extra)
        return self.o_proj(out)  # [T, hidden]


class LlamaDecoderLayer(PreNormDecoderLayer):
    """``PreNormDecoderLayer`` of ``LlamaAttention`` and ``LlamaMLP`` (``MoEMLP`` with
    ``num_local_experts``); with ``sandwich_norm`` the attention and MLP outputs are normed
    again before the residual add (Gemma2)."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary, dtype=None, device=None):
        self_attn = LlamaAttention(config, layer_id, rotary, dtype, device)
        mlp = (MoEMLP(config, dtype, device) if config.num_local_experts
               else LlamaMLP(config, dtype, device))
        super().__init__(config, self_attn, mlp, dtype, device,
                         norm_offset=config.norm_weight_offset)
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if config.sandwich_norm:
            norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps,  # noqa: E731
                                   config.norm_weight_offset, dtype=dtype, device=device)
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, positions: Tensor, h: Tensor, forward_batch) -> Tensor:
        """``h [T, hidden]``, ``positions [T]`` -> ``[T, hidden]``."""
        if self.pre_feedforward_layernorm is None:  # Llama: post_attention_layernorm = pre-MLP
            return super().forward(positions, h, forward_batch)
        attn = self.self_attn(positions, self.input_layernorm(h), forward_batch)
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class LlamaModel(DecoderModel):
    """``DecoderModel`` of ``decoder_layer_class`` layers (``LlamaDecoderLayer``); one
    ``rotary_class`` table shared by the layers ``config.layer_uses_rope`` marks (the others
    are NoPE layers)."""

    decoder_layer_class: type = LlamaDecoderLayer
    rotary_class: type = RotaryEmbedding

    def __init__(self, config: ModelConfig, dtype=None, device=None):
        rotary = self.rotary_class(config.head_dim, config.max_position_embeddings,
                                   config.rope_theta, config.rope_scaling).to(device)

        def make_layer(i: int) -> nn.Module:
            layer_rotary = rotary if config.layer_uses_rope(i) else None
            return self.decoder_layer_class(config, i, layer_rotary, dtype, device)

        super().__init__(config, make_layer, dtype, device, norm_offset=config.norm_weight_offset,
                         embed_scale=config.embed_scale)


class LlamaForCausalLM(DecoderForCausalLM):
    """``DecoderForCausalLM`` of a ``LlamaModel``: ``(input_ids [T], positions [T],
    forward_batch, return_all_logits=False) -> logits [T or b, vocab_size]`` float32, tanh
    soft-capped when ``config.final_logit_softcap`` is set.

    Args:
        config: ModelConfig. dtype/device: of the parameters (the RoPE table stays float32).
    """

    model_class = LlamaModel

    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch,
                return_all_logits: bool = False) -> Tensor:
        """``input_ids [T]``, ``positions [T]`` -> float32 logits ``[T or b, vocab_size]``
        (see ``DecoderForCausalLM``); soft-capped when ``final_logit_softcap`` is set.
        """
        logits = super().forward(input_ids, positions, forward_batch, return_all_logits)
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits


__all__ = ["LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP",
           "RMSNorm"]
