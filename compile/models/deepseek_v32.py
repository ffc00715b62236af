"""DeepSeek-V3.2 decoder: DeepSeek-V3 (MLA, MoE) whose attention reads only the top-k keys a
lightning indexer picks per query (DeepSeek Sparse Attention, DSA).

Per layer, besides the absorbed MLA of ``compile.models.deepseek_v2``, the indexer (parameter
names as ``transformers``' ``DeepseekV32Indexer``) computes for each token

- index queries ``q = wq_b(q_resid) -> [T, Hi, Di]`` from the query LoRA's normed latent
  (``q_resid = q_a_layernorm(q_a_proj(x))``),
- one index key ``k = LayerNorm(wk(x)) -> [T, Di]`` (``k_norm``, with bias),
- rotate-half RoPE (not the interleaved layout of the MLA rope part) on the first
  ``qk_rope_head_dim`` features of both, at the token's position,
- a Hadamard rotation ``x H / sqrt(Di)`` of both (orthogonal: ``q . k`` is unchanged; it only
  spreads outliers before the fp8 quantisation, as DeepSeek's reference and sglang do;
  ``transformers`` skips it),
- head weights ``weights_proj(x) * Hi ** -0.5 * Di ** -0.5`` float32 ``[T, Hi]``,

and hands them to ``PagedAttention`` as ``index_q``/``index_k``/``index_weights``. The DSA
backend (``compile.backend.dsa_backend``) stores the key in the index-key cache, scores
``sum_h weights_h * relu(q_h . k_j)`` over the request's cached keys, keeps the
``index_topk`` best keys (causal) and runs sparse MLA over exactly those slots.
Source: DeepSeek-V3.2-Exp (its ``inference/model.py`` Indexer), ``transformers``'
``deepseek_v32``, sglang ``python/sglang/srt/layers/attention/nsa/nsa_indexer.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor, nn

import xpu_ops

from compile.models.deepseek_v2 import (DeepseekV2Attention, DeepseekV2Config,
                                        DeepseekV2DecoderLayer, DeepseekV2ForCausalLM,
                                        DeepseekV2Model, deepseek_kwargs)
from compile.models.rope import RotaryEmbedding
from compile.models.weights import copy_from_hf

INDEX_NORM_EPS = 1e-6  # transformers' DeepseekV32Indexer.k_norm


@dataclasses.dataclass
class DeepseekV32Config(DeepseekV2Config):
    """``DeepseekV2Config`` (MLA, MoE) plus the indexer's shapes.

    Attributes:
        index_n_heads: Hi. index_head_dim: Di (a power of two: the Hadamard rotation).
        index_topk: keys each query attends at most (the indexer's top-k).
    """

    index_n_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 2048

    def __post_init__(self) -> None:
        super().__post_init__()
        di = self.index_head_dim
        if di < self.qk_rope_head_dim or di & (di - 1) or self.q_lora_rank is None:
            raise ValueError(f"DeepseekV32Config: expected a power-of-two index_head_dim >= "
                             f"qk_rope_head_dim ({self.qk_rope_head_dim}) and a q_lora_rank; got "
                             f"index_head_dim={di}, q_lora_rank={self.q_lora_rank}.")
        if self.index_topk < 1:
            raise ValueError(f"DeepseekV32Config: index_topk must be >= 1; got "
                             f"{self.index_topk}.")

    model_types = ("deepseek_v32",)

    @classmethod
    def from_hf(cls, hf_config) -> "DeepseekV32Config":
        """Build from a ``transformers`` ``DeepseekV32Config``.

        Raises:
            NotImplementedError: another model type, a RoPE type other than default or yarn, or an
                unsupported routing option (see ``compile.models.deepseek_v2.hf_moe``).
        """
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in cls.model_types:
            raise NotImplementedError(f"DeepseekV32Config.from_hf: model_type {model_type!r} is "
                                      f"not supported; expected one of {cls.model_types}.")
        kw = deepseek_kwargs(hf_config, "DeepseekV32Config.from_hf")
        kw["rope_interleave"] = True  # V3.2's MLA rope part is always interleaved
        return cls(**kw, index_n_heads=hf_config.index_n_heads,
                   index_head_dim=hf_config.index_head_dim, index_topk=hf_config.index_topk)


class Indexer(nn.Module):
    """The lightning indexer's projections (``wq_b``, ``wk``, ``k_norm``, ``weights_proj``
    float32): ``(positions [T], x [T, hidden], q_resid [T, q_lora_rank])`` -> ``(index_q
    [T, Hi, Di], index_k [T, Di], index_weights [T, Hi] float32)`` (module docstring)."""

    def __init__(self, config: DeepseekV32Config, rotary: RotaryEmbedding, dtype=None,
                 device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.hi, self.di, self.r = (config.index_n_heads, config.index_head_dim,
                                    config.qk_rope_head_dim)
        self.wq_b = nn.Linear(config.q_lora_rank, self.hi * self.di, bias=False, **kw)
        self.wk = nn.Linear(config.hidden_size, self.di, bias=False, **kw)
        self.k_norm = nn.LayerNorm(self.di, eps=INDEX_NORM_EPS, **kw)
        self.weights_proj = nn.Linear(config.hidden_size, self.hi, bias=False,
                                      dtype=torch.float32, device=device)
        self.rotary = rotary
        self.weight_scale = float(self.hi) ** -0.5 * float(self.di) ** -0.5

    def forward(self, positions: Tensor, x: Tensor, q_resid: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
        """See the class docstring."""
        t = x.shape[0]
        q = self.wq_b(q_resid).view(t, self.hi, self.di)
        k = self.k_norm(self.wk(x)).unsqueeze(1)                           # [T, 1, Di]
        q_rot, k_rot = self.rotary(positions, q[..., :self.r], k[..., :self.r])
        q = torch.cat((q_rot, q[..., self.r:]), dim=-1)
        k = torch.cat((k_rot, k[..., self.r:]), dim=-1).squeeze(1)
        scale = float(self.di) ** -0.5
        q = xpu_ops.hadamard_transform(q, scale=scale)
        k = xpu_ops.hadamard_transform(k, scale=scale)
        weights = self.weights_proj(x.float()) * self.weight_scale         # [T, Hi]
        return q, k, weights


class DeepseekV32Attention(DeepseekV2Attention):
    """``DeepseekV2Attention`` (absorbed MLA, q LoRA) plus the ``indexer``; the attention is
    sparse over the indexer's top-k keys (the DSA backend)."""

    def __init__(self, config: DeepseekV32Config, layer_id: int, rotary, index_rotary,
                 dtype=None, device=None):
        super().__init__(config, layer_id, rotary, dtype, device)
        self.indexer = Indexer(config, index_rotary, dtype, device)

    def forward(self, positions: Tensor, hidden_states: Tensor, forward_batch) -> Tensor:
        """``hidden_states [T, hidden]``, ``positions [T]`` -> ``[T, hidden]``."""
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        index_q, index_k, index_weights = self.indexer(positions, hidden_states, q_resid)
        return self.mla(positions, hidden_states, self.q_b_proj(q_resid), forward_batch,
                        index_q=index_q, index_k=index_k, index_weights=index_weights)


class DeepseekV32DecoderLayer(DeepseekV2DecoderLayer):
    """``DeepseekV2DecoderLayer`` with ``DeepseekV32Attention``."""

    def __init__(self, config: DeepseekV32Config, layer_id: int, rotary, index_rotary,
                 dtype=None, device=None):
        self_attn = DeepseekV32Attention(config, layer_id, rotary, index_rotary, dtype, device)
        super().__init__(config, layer_id, rotary, dtype, device, self_attn=self_attn)


class DeepseekV32Model(DeepseekV2Model):
    """``DeepseekV2Model`` of ``DeepseekV32DecoderLayer``s; the indexers share one rotate-half
    RoPE table of ``qk_rope_head_dim`` features."""

    def __init__(self, config: DeepseekV32Config, dtype=None, device=None):
        index_rotary = RotaryEmbedding(config.qk_rope_head_dim, config.max_position_embeddings,
                                       config.rope_theta, config.rope_scaling).to(device)
        super().__init__(config, dtype, device, make_layer=lambda i, rotary: (
            DeepseekV32DecoderLayer(config, i, rotary, index_rotary, dtype, device)))


class DeepseekV32ForCausalLM(DeepseekV2ForCausalLM):
    """``DeepseekV2ForCausalLM`` of a ``DeepseekV32Model``; runs on a ``DSATokenToKVPool``
    (``compile.batch.dsa_pool``) with ``compile.backend.dsa_backend.DSAAttentionBackend``,
    which ``compile.engine.engine.Engine`` picks for a config with ``index_head_dim``."""

    model_class = DeepseekV32Model


def from_hf(hf_model, dtype: Optional[torch.dtype] = None, device=None
            ) -> DeepseekV32ForCausalLM:
    """Zoo ``DeepseekV32ForCausalLM`` holding a copy of a ``transformers``
    ``DeepseekV32ForCausalLM``'s weights (as ``compile.models.deepseek_v2.from_hf``).

    Raises:
        NotImplementedError: see ``DeepseekV32Config.from_hf``.
        KeyError, ValueError: a missing or mis-shaped source tensor.
    """
    config = DeepseekV32Config.from_hf(hf_model.config)
    return copy_from_hf(DeepseekV32ForCausalLM, config, hf_model, dtype, device)


__all__ = ["DeepseekV32Config", "DeepseekV32ForCausalLM", "Indexer", "from_hf"]
