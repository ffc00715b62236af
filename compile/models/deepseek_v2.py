"""DeepSeek-V2 decoder with multi-head latent attention (MLA) over the paged latent cache.

Per token, MLA caches one row ``[R + r]``: the compressed KV latent (``kv_lora_rank`` R, after
``kv_a_layernorm``) and one rope key shared by all heads (``qk_rope_head_dim`` r). The model
runs every mode absorbed, as sglang does for decode: ``kv_b_proj`` ``[H * (Dn + Dv), R]`` splits
per head into ``w_kc [H, Dn, R]`` (key up-projection) and ``w_vc [H, Dv, R]`` (value
up-projection), so

- the query's nope part moves into the latent space, ``q_nope @ w_kc -> [T, H, R]``;
- attention scores are ``q_latent . latent + q_rope . k_rope`` times ``(Dn + r) ** -0.5``;
- the attention output (a mix of latents, ``[T, H, R]``) leaves through ``w_vc -> [T, H, Dv]``.

``PagedAttention`` therefore sees ``head_dim = R + r``, ``v_head_dim = R`` and one KV head; the
backend runs ``flash_mla_decode`` for decode and ``flash_attn_with_kvcache(qv=...)`` otherwise.
The MHA prefill path (decompressed K/V over chunked prefix caches) is not used.

RoPE is the interleaved (GPT-J / complex-pair) layout that ``transformers``' DeepseekV2 uses:
features ``(2i, 2i + 1)`` rotate together (``compile.models.rope.InterleavedRotaryEmbedding``).
Dense MLP only: every layer must be dense (``first_k_dense_replace >= num_hidden_layers``).
Source: DeepSeek-V2 (arXiv 2405.04434), sglang ``python/sglang/srt/models/deepseek_v2.py``
(weight absorption, ``w_kc``/``w_vc``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor, nn

from compile.backend import PagedAttention
from compile.models.config import DecoderConfig, hf_decoder_kwargs
from compile.models.decoder import DecoderForCausalLM, DecoderModel, PreNormDecoderLayer, RMSNorm
from compile.models.llama import LlamaMLP
from compile.models.weights import copy_from_hf
from compile.models.rope import InterleavedRotaryEmbedding

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm/kv_a_layernorm with the default eps


@dataclasses.dataclass
class DeepseekV2Config(DecoderConfig):
    """Shapes of a dense DeepSeek-V2 decoder: ``DecoderConfig``'s fields (num_attention_heads:
    H; attention_bias: of the q_a/kv_a/o projections) plus the MLA ranks (units: features).

    Attributes:
        q_lora_rank: rank of the query compression (None: a plain ``q_proj``).
        kv_lora_rank: R. qk_nope_head_dim: Dn. qk_rope_head_dim: r (even). v_head_dim: Dv.
    """

    vocab_size: int = 128
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16
    v_head_dim: int = 16

    def __post_init__(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepseekV2Config: qk_rope_head_dim must be even; got "
                             f"{self.qk_rope_head_dim}.")

    @property
    def scaling(self) -> float:
        """Softmax scale: ``(Dn + r) ** -0.5`` (the un-absorbed query/key head dim)."""
        return float(self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    @classmethod
    def from_hf(cls, hf_config) -> "DeepseekV2Config":
        """Build from a ``transformers`` ``DeepseekV2Config``.

        Raises:
            NotImplementedError: another model type, a MoE layer or a non-default RoPE type.
        """
        model_type = getattr(hf_config, "model_type", None)
        if model_type != "deepseek_v2":
            raise NotImplementedError(f"DeepseekV2Config.from_hf: model_type {model_type!r} is "
                                      "not supported; expected 'deepseek_v2'.")
        n = hf_config.num_hidden_layers
        if hf_config.first_k_dense_replace < n:
            raise NotImplementedError(
                f"DeepseekV2Config.from_hf: layers {hf_config.first_k_dense_replace}..{n - 1} are "
                f"MoE; only dense layers are supported. Set first_k_dense_replace >= {n}.")
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"DeepseekV2Config.from_hf: rope_type "
                                      f"{rope['rope_type']!r} is not supported; expected default.")
        get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
        return cls(
            **hf_decoder_kwargs(hf_config),
            q_lora_rank=hf_config.q_lora_rank, kv_lora_rank=hf_config.kv_lora_rank,
            qk_nope_head_dim=hf_config.qk_nope_head_dim,
            qk_rope_head_dim=hf_config.qk_rope_head_dim, v_head_dim=hf_config.v_head_dim,
            rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
            attention_bias=bool(get("attention_bias", False)))


class DeepseekV2Attention(nn.Module):
    """MLA with weight absorption; parameter names match ``transformers``' DeepseekV2Attention."""

    def __init__(self, config: DeepseekV2Config, layer_id: int,
                 rotary: InterleavedRotaryEmbedding, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        h, hidden = config.num_attention_heads, config.hidden_size
        self.h, self.rank = h, config.kv_lora_rank
        self.dn, self.r, self.dv = (config.qk_nope_head_dim, config.qk_rope_head_dim,
                                    config.v_head_dim)
        q_out = h * (self.dn + self.r)
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=config.attention_bias, **kw)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, **kw)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_out, bias=False, **kw)
        self.q_lora = config.q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.r,
                                            bias=config.attention_bias, **kw)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, **kw)
        self.kv_b_proj = nn.Linear(self.rank, h * (self.dn + self.dv), bias=False, **kw)
        self.o_proj = nn.Linear(h * self.dv, hidden, bias=config.attention_bias, **kw)
        self.rotary_emb = rotary
        self.attn = PagedAttention(h, self.rank + self.r, config.scaling, num_kv_heads=1,
                                   layer_id=layer_id, v_head_dim=self.rank)

    def absorbed_weights(self) -> tuple[Tensor, Tensor]:
        """``(w_kc [H, Dn, R], w_vc [H, Dv, R])``: views of ``kv_b_proj.weight``, no copy."""
        w = self.kv_b_proj.weight.view(self.h, self.dn + self.dv, self.rank)
        return w[:, :self.dn], w[:, self.dn:]

    def forward(self, positions: Tensor, hidden_states: Tensor, forward_batch) -> Tensor:
        """``hidden_states [T, hidden]``, ``positions [T]`` -> ``[T, hidden]``: absorbed MLA
        over the latent cache (queries ``[T, H, R]`` plus rope ``[T, H, r]``; output through
        ``w_vc``).
        """
        t = hidden_states.shape[0]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        else:
            q = self.q_proj(hidden_states)
        q_nope, q_rope = q.view(t, self.h, self.dn + self.r).split([self.dn, self.r], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden_states).split([self.rank, self.r], -1)
        latent = self.kv_a_layernorm(latent).unsqueeze(1)              # [T, 1, R]
        q_rope, k_rope = self.rotary_emb(positions, q_rope, k_rope.unsqueeze(1))
        w_kc, w_vc = self.absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)   # [T, H, R]
        out = self.attn(q_latent.reshape(t, self.h * self.rank), latent, None, forward_batch,
                        q_rope=q_rope.contiguous(), k_rope=k_rope)      # [T, H * R]
        out = torch.bmm(out.view(t, self.h, self.rank).transpose(0, 1), w_vc.transpose(1, 2))
        return self.o_proj(out.transpose(0, 1).reshape(t, self.h * self.dv))  # [T, hidden]


class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    """``PreNormDecoderLayer`` of MLA (``DeepseekV2Attention``) and a dense gated MLP."""

    def __init__(self, config: DeepseekV2Config, layer_id: int, rotary, dtype=None, device=None):
        self_attn = DeepseekV2Attention(config, layer_id, rotary, dtype, device)
        super().__init__(config, self_attn, LlamaMLP(config, dtype, device), dtype, device)


class DeepseekV2Model(DecoderModel):
    """``DecoderModel`` of ``DeepseekV2DecoderLayer``s sharing one interleaved RoPE table of
    ``qk_rope_head_dim`` features."""

    def __init__(self, config: DeepseekV2Config, dtype=None, device=None):
        rotary = InterleavedRotaryEmbedding(config.qk_rope_head_dim,
                                            config.max_position_embeddings,
                                            config.rope_theta).to(device)
        super().__init__(config, lambda i: DeepseekV2DecoderLayer(config, i, rotary, dtype, device),
                         dtype, device)


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    """``DecoderForCausalLM`` of a ``DeepseekV2Model``; same calling convention as
    ``compile.models.LlamaForCausalLM``.

    Runs on an ``MLATokenToKVPool`` (``kv_lora_rank`` R, ``qk_rope_head_dim`` r, one buffer per
    layer); ``compile.engine.engine.Engine`` builds one when the config has ``kv_lora_rank``.
    Args:
        config: DeepseekV2Config. dtype/device: of the parameters (the RoPE table stays float32).
    Forward:
        input_ids: [T] int64. positions: [T] int64. forward_batch: ForwardBatch with metadata.
        return_all_logits: False keeps only each request's last token in extend modes.
    Returns:
        logits [T or b, vocab_size] float32.
    """

    model_class = DeepseekV2Model


def from_hf(hf_model, dtype: Optional[torch.dtype] = None, device=None) -> DeepseekV2ForCausalLM:
    """Zoo ``DeepseekV2ForCausalLM`` holding a copy of a ``transformers``
    ``DeepseekV2ForCausalLM``'s weights (gate/up fused; ``kv_b_proj`` kept whole, absorbed by
    view at run time).

    Raises:
        NotImplementedError: see ``DeepseekV2Config.from_hf``.
        KeyError, ValueError: a missing or mis-shaped source tensor.
    """
    config = DeepseekV2Config.from_hf(hf_model.config)
    return copy_from_hf(DeepseekV2ForCausalLM, config, hf_model, dtype, device)


__all__ = ["DeepseekV2Config", "DeepseekV2ForCausalLM", "DeepseekV2Attention", "from_hf"]
