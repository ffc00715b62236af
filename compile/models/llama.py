"""Llama-family decoder over the paged KV cache, written the way sglang writes ``llama.py``.

Tokens are packed: every tensor in the forward pass is ``[T, ...]`` for the ``T`` new tokens of
the batch, whatever the requests; ``forward_batch`` (a ``compile.forward_batch.ForwardBatch``)
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

from compile.layer import PagedAttention
from compile.models.config import ModelConfig
from compile.models.moe import MoEMLP
from compile.models.rope import RotaryEmbedding
from compile.regions import run_layers


class RMSNorm(nn.Module):
    """``x / rms(x) * (offset + weight)``, normalised in float32, returned in x's dtype.

    ``offset = 0`` is Llama's norm (scale after the cast back), ``offset = 1`` Gemma's.
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps, self.offset = eps, offset

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., dim]`` normalised over the last dim; same shape and dtype."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (y * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * y.to(x.dtype)


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
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=device)
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
        qkv = self.qkv_proj(hidden_states)  # [T, (Hq + 2 Hkv) * D]
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, k = q.view(-1, self.hq, self.d), k.view(-1, self.hkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        extra = {} if self.sinks is None else {"sinks": self.sinks}
        out = self.attn(q.reshape(-1, self.hq * self.d), k, v, forward_batch, **extra)
        return self.o_proj(out)  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block; with ``sandwich_norm`` the attention and MLP outputs are normed
    again before the residual add (Gemma2)."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary, dtype=None, device=None):
        super().__init__()
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps,  # noqa: E731
                               config.norm_weight_offset, dtype=dtype, device=device)
        self.self_attn = LlamaAttention(config, layer_id, rotary, dtype, device)
        self.mlp = (MoEMLP(config, dtype, device) if config.num_local_experts
                    else LlamaMLP(config, dtype, device))
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if config.sandwich_norm:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, positions: Tensor, h: Tensor, forward_batch) -> Tensor:
        """``h [T, hidden]``, ``positions [T]`` -> ``[T, hidden]``."""
        attn = self.self_attn(positions, self.input_layernorm(h), forward_batch)
        if self.pre_feedforward_layernorm is None:  # Llama: post_attention_layernorm = pre-MLP
            h = h + attn
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm: ``input_ids [T] -> hidden [T, hidden]``."""

    def __init__(self, config: ModelConfig, dtype=None, device=None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                         device=device)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling).to(device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary if config.layer_uses_rope(i) else None,
                              dtype, device)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset,
                            dtype=dtype, device=device)

    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch) -> Tensor:
        """``input_ids [T]``, ``positions [T]`` int64 -> normed hidden states ``[T, hidden]``."""
        h = self.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        h = run_layers(self.layers, positions, h, forward_batch)  # one compiled body per kind
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head, sglang's calling convention.

    Args:
        config: ModelConfig. dtype/device: of the parameters (the RoPE table stays float32).
    Forward:
        input_ids: [T] int64 new tokens of the batch, packed request after request.
        positions: [T] int64 their positions.
        forward_batch: ForwardBatch with attention metadata already initialised.
        return_all_logits: False keeps only the last token of each request in extend modes
            (what sampling needs); decode always returns one row per token.
    Returns:
        logits [T or b, vocab_size] float32.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype, device)
        self.lm_head = make_lm_head(config, dtype, device)

    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch,
                return_all_logits: bool = False) -> Tensor:
        """``input_ids [T]``, ``positions [T]`` -> float32 logits ``[T or b, vocab_size]``
        (see the class docstring); soft-capped when ``final_logit_softcap`` is set.
        """
        h = self.model(input_ids, positions, forward_batch)
        logits = lm_logits(self, h, forward_batch, return_all_logits)
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits


def make_lm_head(config, dtype: torch.dtype, device) -> Optional[nn.Linear]:
    """``[vocab_size, hidden_size]`` output projection, or None with tied embeddings (then
    ``lm_logits`` reads ``model.embed_tokens``)."""
    if config.tie_word_embeddings:
        return None
    return nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype,
                     device=device)


def lm_logits(causal_lm: nn.Module, h: Tensor, forward_batch, return_all_logits: bool) -> Tensor:
    """Float32 logits of a causal LM with ``model.embed_tokens`` and an optional ``lm_head``
    (None: tied embeddings): every row of ``h [T, hidden]``, or in extend-like modes only each
    request's last token unless ``return_all_logits``."""
    if not return_all_logits and forward_batch.forward_mode.is_extend_or_draft_extend_or_mixed():
        h = h[torch.cumsum(forward_batch.extend_seq_lens, 0) - 1]  # [b], no host sync
    lm_head = causal_lm.lm_head
    weight = causal_lm.model.embed_tokens.weight if lm_head is None else lm_head.weight
    return F.linear(h, weight).float()


__all__ = ["LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP",
           "RMSNorm"]
