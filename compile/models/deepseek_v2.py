"""DeepSeek-V2 / V3 decoder with multi-head latent attention (MLA) over the paged latent cache.

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
DeepSeek-V3 (``model_type`` "deepseek_v3") is the same model with sigmoid routing and an option
for rotate-half RoPE (``rope_interleave=False``). Each layer's MLP is dense or the DeepSeek
mixture of experts (``compile.models.deepseek_moe``), as ``transformers`` lays them out.
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
from compile.models.deepseek_moe import DeepseekMoE, MoEConfig
from compile.models.decoder import DecoderForCausalLM, DecoderModel, PreNormDecoderLayer, RMSNorm
from compile.models.llama import LlamaMLP
from compile.models.weights import copy_from_hf
from compile.models.rope import InterleavedRotaryEmbedding, RotaryEmbedding, yarn_mscale

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm/kv_a_layernorm with the default eps


@dataclasses.dataclass
class DeepseekV2Config(DecoderConfig):
    """Shapes of a DeepSeek-V2 / V3 decoder: ``DecoderConfig``'s fields (num_attention_heads:
    H; attention_bias: of the q_a/kv_a/o projections) plus the MLA ranks (units: features).

    Attributes:
        q_lora_rank: rank of the query compression (None: a plain ``q_proj``).
        kv_lora_rank: R. qk_nope_head_dim: Dn. qk_rope_head_dim: r (even). v_head_dim: Dv.
        rope_scaling: None or a YaRN dict (``compile.models.rope.rope_inv_freq``; DeepSeek's
            ``mscale_all_dim`` also scales the softmax, see ``scaling``).
        rope_interleave: the rope part rotates feature pairs ``(2i, 2i + 1)`` (V2 always, V3's
            default); False: halves (rotate-half, V3's ``rope_interleave=False``).
        moe: routing and sizes of the MoE layers (``compile.models.deepseek_moe``), or None.
        mlp_layer_types: per layer "dense" (a gated MLP of ``intermediate_size``) or "sparse"
            (the MoE); None: every layer dense.
    """

    vocab_size: int = 128
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16
    v_head_dim: int = 16
    rope_interleave: bool = True
    rope_scaling: Optional[dict] = None
    moe: Optional[MoEConfig] = None
    mlp_layer_types: Optional[tuple[str, ...]] = None

    def __post_init__(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepseekV2Config: qk_rope_head_dim must be even; got "
                             f"{self.qk_rope_head_dim}.")
        types = self.mlp_layer_types
        if types is not None and (len(types) != self.num_hidden_layers
                                  or not set(types) <= {"dense", "sparse"}
                                  or ("sparse" in types and self.moe is None)):
            raise ValueError(f"DeepseekV2Config: mlp_layer_types must give 'dense' or 'sparse' "
                             f"per layer ({self.num_hidden_layers}), 'sparse' only with moe; "
                             f"got {types!r}, moe={self.moe!r}.")

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id``'s MLP is the mixture of experts (``mlp_layer_types``)."""
        return self.mlp_layer_types is not None and self.mlp_layer_types[layer_id] == "sparse"

    @property
    def scaling(self) -> float:
        """Softmax scale: ``(Dn + r) ** -0.5`` (the un-absorbed query/key head dim), times
        ``yarn_mscale(factor, mscale_all_dim) ** 2`` under YaRN with ``mscale_all_dim``."""
        scale = float(self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        s = self.rope_scaling or {}
        if s.get("mscale_all_dim"):
            scale *= yarn_mscale(s["factor"], s["mscale_all_dim"]) ** 2
        return scale

    @classmethod
    def from_hf(cls, hf_config) -> "DeepseekV2Config":
        """Build from a ``transformers`` ``DeepseekV2Config`` or ``DeepseekV3Config``.

        Raises:
            NotImplementedError: another model type, a RoPE type other than default or yarn, or a
                routing option ``transformers`` does not model (see ``hf_moe``).
        """
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in cls.model_types:
            raise NotImplementedError(f"{cls.__name__}.from_hf: model_type {model_type!r} is "
                                      f"not supported; expected one of {cls.model_types}.")
        return cls(**deepseek_kwargs(hf_config, f"{cls.__name__}.from_hf"))

    #: ``model_type``s ``from_hf`` reads (V3 differs in routing and the RoPE layout option).
    model_types = ("deepseek_v2", "deepseek_v3")


def deepseek_kwargs(hf_config, where: str) -> dict:
    """``DeepseekV2Config`` keyword arguments from a ``transformers`` DeepSeek-V2/V3/V3.2
    config (MLA ranks, RoPE, the MoE layers of ``hf_moe``).

    Raises:
        NotImplementedError: a RoPE type other than default or yarn (``hf_yarn``), or an
            unsupported routing option.
    """
    get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    moe, mlp_layer_types = hf_moe(hf_config, where)
    return dict(
        **hf_decoder_kwargs(hf_config),
        q_lora_rank=hf_config.q_lora_rank, kv_lora_rank=hf_config.kv_lora_rank,
        qk_nope_head_dim=hf_config.qk_nope_head_dim,
        qk_rope_head_dim=hf_config.qk_rope_head_dim, v_head_dim=hf_config.v_head_dim,
        rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
        rope_scaling=hf_yarn(rope, where), attention_bias=bool(get("attention_bias", False)),
        rope_interleave=hf_config.model_type == "deepseek_v2" or bool(get("rope_interleave", True)),
        moe=moe, mlp_layer_types=mlp_layer_types)


def hf_yarn(rope: dict, where: str) -> Optional[dict]:
    """The YaRN dict of ``transformers`` ``rope_parameters`` (None for default RoPE).

    Raises:
        NotImplementedError: another rope type, or a YaRN attention factor other than 1 (it
            scales cos/sin, so only the rope part of each score: DeepSeek's configs give 1,
            ``mscale == mscale_all_dim``).
    """
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn" or not rope.get("factor"):
        raise NotImplementedError(f"{where}: rope_type {rope_type!r} (factor "
                                  f"{rope.get('factor')!r}) is not supported; expected default "
                                  "or yarn with a factor.")
    factor, mscale, mscale_all = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
    attention = rope.get("attention_factor") or (
        yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
        else yarn_mscale(factor))
    if abs(attention - 1.0) > 1e-12:
        raise NotImplementedError(f"{where}: a YaRN attention factor of {attention}; expected 1 "
                                  "(mscale == mscale_all_dim, as DeepSeek's configs).")
    return {k: v for k, v in rope.items() if k != "rope_theta"} | {"rope_type": "yarn"}


def hf_moe(hf_config, where: str) -> tuple[Optional[MoEConfig], tuple[str, ...]]:
    """``(MoEConfig or None, mlp_layer_types)`` of a ``transformers`` DeepSeek config, as
    ``transformers`` builds its layers: ``mlp_layer_types`` when the config has it (V3.2), else
    dense below ``first_k_dense_replace`` and MoE ("sparse") from there on. V2 routes by softmax
    (``topk_method`` "greedy", or "group_limited_greedy" over ``n_group`` groups), V3 and V3.2
    by sigmoid with the score-correction bias over groups.

    Raises:
        NotImplementedError: ``moe_layer_freq`` other than 1 (``transformers`` has no such
            layer pattern), another V2 ``topk_method``, a ``scoring_func`` other than the
            family's, or an activation other than silu.
    """
    get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
    n, v2 = hf_config.num_hidden_layers, hf_config.model_type == "deepseek_v2"
    types = get("mlp_layer_types")
    if types is None:
        k = min(get("first_k_dense_replace", 0) or 0, n)
        types = ["dense"] * k + ["sparse"] * (n - k)
    types = tuple(types)
    if "sparse" not in types:
        return None, types
    freq = get("moe_layer_freq", 1)
    scoring = "softmax" if v2 else "sigmoid"
    method = get("topk_method", "greedy" if v2 else "noaux_tc")
    reasons = [(freq != 1, f"moe_layer_freq {freq!r}; expected 1 (transformers builds a MoE "
                           f"layer at every layer from first_k_dense_replace on)"),
               (v2 and method not in ("greedy", "group_limited_greedy"),
                f"topk_method {method!r}; expected greedy or group_limited_greedy"),
               (get("scoring_func", scoring) != scoring,
                f"scoring_func {get('scoring_func')!r}; expected {scoring!r}"),
               (get("hidden_act", "silu") != "silu",
                f"hidden_act {get('hidden_act')!r}; expected 'silu'")]
    for bad, what in reasons:
        if bad:
            raise NotImplementedError(f"{where}: {what}.")
    grouped = not v2 or method == "group_limited_greedy"
    return MoEConfig(
        n_routed_experts=hf_config.n_routed_experts,
        num_experts_per_tok=hf_config.num_experts_per_tok,
        moe_intermediate_size=hf_config.moe_intermediate_size,
        n_shared_experts=get("n_shared_experts") or 0, scoring_func=scoring,
        n_group=(get("n_group") or 1) if grouped else 1,
        topk_group=(get("topk_group") or 1) if grouped else 1,
        norm_topk_prob=bool(get("norm_topk_prob", False)) and not v2,
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0))), types


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
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        else:
            q = self.q_proj(hidden_states)
        return self.mla(positions, hidden_states, q, forward_batch)

    def mla(self, positions: Tensor, hidden_states: Tensor, q: Tensor, forward_batch,
            **extras) -> Tensor:
        """The attention after the query projection ``q [T, H * (Dn + r)]``; ``extras`` go to
        ``PagedAttention`` (DeepSeek-V3.2: the indexer's inputs). Returns ``[T, hidden]``."""
        t = hidden_states.shape[0]
        q_nope, q_rope = q.view(t, self.h, self.dn + self.r).split([self.dn, self.r], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden_states).split([self.rank, self.r], -1)
        latent = self.kv_a_layernorm(latent).unsqueeze(1)              # [T, 1, R]
        q_rope, k_rope = self.rotary_emb(positions, q_rope, k_rope.unsqueeze(1))
        w_kc, w_vc = self.absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)   # [T, H, R]
        out = self.attn(q_latent.reshape(t, self.h * self.rank), latent, None, forward_batch,
                        q_rope=q_rope.contiguous(), k_rope=k_rope, **extras)  # [T, H * R]
        out = torch.bmm(out.view(t, self.h, self.rank).transpose(0, 1), w_vc.transpose(1, 2))
        return self.o_proj(out.transpose(0, 1).reshape(t, self.h * self.dv))  # [T, hidden]


class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    """``PreNormDecoderLayer`` of MLA (``DeepseekV2Attention``) and a dense gated MLP or, where
    ``config.is_moe_layer``, the DeepSeek mixture of experts."""

    def __init__(self, config: DeepseekV2Config, layer_id: int, rotary, dtype=None, device=None,
                 self_attn: Optional[nn.Module] = None):
        if self_attn is None:
            self_attn = DeepseekV2Attention(config, layer_id, rotary, dtype, device)
        mlp = (DeepseekMoE(config.moe, config, dtype, device) if config.is_moe_layer(layer_id)
               else LlamaMLP(config, dtype, device))
        super().__init__(config, self_attn, mlp, dtype, device)


class DeepseekV2Model(DecoderModel):
    """``DecoderModel`` of ``DeepseekV2DecoderLayer``s sharing one RoPE table of
    ``qk_rope_head_dim`` features (interleaved pairs, or halves without ``rope_interleave``)."""

    def __init__(self, config: DeepseekV2Config, dtype=None, device=None, make_layer=None):
        """``make_layer(layer_id, rotary)`` builds a layer (default ``DeepseekV2DecoderLayer``)."""
        rope_class = InterleavedRotaryEmbedding if config.rope_interleave else RotaryEmbedding
        rotary = rope_class(config.qk_rope_head_dim, config.max_position_embeddings,
                            config.rope_theta, config.rope_scaling).to(device)
        make_layer = make_layer or (lambda i, rotary: DeepseekV2DecoderLayer(
            config, i, rotary, dtype, device))
        super().__init__(config, lambda i: make_layer(i, rotary), dtype, device)


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
    ``DeepseekV2ForCausalLM`` or ``DeepseekV3ForCausalLM``'s weights (gate/up fused, experts'
    stacked tensors as they are; ``kv_b_proj`` kept whole, absorbed by view at run time).

    Raises:
        NotImplementedError: see ``DeepseekV2Config.from_hf``.
        KeyError, ValueError: a missing or mis-shaped source tensor.
    """
    config = DeepseekV2Config.from_hf(hf_model.config)
    return copy_from_hf(DeepseekV2ForCausalLM, config, hf_model, dtype, device)


__all__ = ["DeepseekV2Config", "DeepseekV2ForCausalLM", "DeepseekV2Attention", "deepseek_kwargs",
           "hf_moe", "from_hf"]
