"""``Qwen3NextConfig``: the shapes of a Qwen3-Next or Qwen3.5 (text) decoder
(``compile.models.qwen3_next``), read from ``transformers``' ``Qwen3NextConfig``,
``Qwen3_5TextConfig`` or ``Qwen3_5MoeTextConfig``, or the ``text_config`` of a multimodal
``Qwen3_5Config`` / ``Qwen3_5MoeConfig`` (the vision tower is not part of the zoo).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from compile.models.config import DecoderConfig, hf_decoder_kwargs

_TEXT_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
#: the multimodal Qwen3.5 types, whose ``text_config`` holds the decoder's shapes
QWEN3_5_MULTIMODAL_TYPES = ("qwen3_5", "qwen3_5_moe")
#: ``model_type`` values this config reads (and ``compile.models.from_hf`` builds).
QWEN3_NEXT_MODEL_TYPES = _TEXT_MODEL_TYPES + QWEN3_5_MULTIMODAL_TYPES
HYBRID_LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass
class Qwen3NextConfig(DecoderConfig):
    """``DecoderConfig``'s fields plus the hybrid layers' (units: features, heads, tokens).

    Attributes:
        num_key_value_heads: Hkv of the full-attention layers. head_dim: their D.
        partial_rotary_factor: RoPE rotates the first ``int(D * factor)`` features.
        layer_types: per layer "linear_attention" or "full_attention".
        linear_conv_kernel_dim: width of the causal conv. linear_num_key_heads: Hk.
        linear_num_value_heads: Hv. linear_key_head_dim: K. linear_value_head_dim: V.
        num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob: the sparse
            MoE (0 experts: every layer dense). shared_expert_intermediate_size: its shared
            expert. decoder_sparse_step, mlp_only_layers: which layers are MoE (layer ``i``
            when ``(i + 1) % decoder_sparse_step == 0`` and not in ``mlp_only_layers``).
        split_projections: Qwen3.5's four linear-layer input projections instead of
            Qwen3-Next's two grouped ones.
    """

    num_key_value_heads: int = 2
    head_dim: int = 16
    partial_rotary_factor: float = 0.25
    layer_types: Optional[list[str]] = None
    linear_conv_kernel_dim: int = 4
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)
    split_projections: bool = False

    def __post_init__(self) -> None:
        if self.layer_types is None:  # transformers' default: every fourth layer full
            self.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                for i in range(self.num_hidden_layers)]
        bad = [t for t in self.layer_types if t not in HYBRID_LAYER_TYPES]
        if len(self.layer_types) != self.num_hidden_layers or bad:
            raise ValueError(f"Qwen3NextConfig: layer_types must list one of "
                             f"{HYBRID_LAYER_TYPES} per layer ({self.num_hidden_layers}); got "
                             f"{self.layer_types}.")
        if "full_attention" not in self.layer_types:
            raise ValueError("Qwen3NextConfig: layer_types has no full_attention layer; "
                             "expected at least one (the KV pool is sized from them).")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"Qwen3NextConfig: num_attention_heads must be a multiple of "
                             f"num_key_value_heads; got {self.num_attention_heads} and "
                             f"{self.num_key_value_heads}.")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"Qwen3NextConfig: the rotary dim int(head_dim * "
                             f"partial_rotary_factor) must be even and in (0, head_dim]; got "
                             f"{self.rotary_dim} for head_dim {self.head_dim}.")

    @property
    def scaling(self) -> float:
        """Softmax scale of the full-attention layers, ``D ** -0.5``."""
        return float(self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        """Features RoPE rotates, ``int(head_dim * partial_rotary_factor)``."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_is_moe(self, layer_id: int) -> bool:
        """Whether ``layer_id``'s MLP is the sparse MoE (transformers' rule)."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, hf_config) -> "Qwen3NextConfig":
        """Build from a ``transformers`` ``Qwen3NextConfig``, ``Qwen3_5TextConfig`` or
        ``Qwen3_5MoeTextConfig`` (every layer MoE, top-k weights always renormalised), or a
        multimodal ``Qwen3_5Config`` / ``Qwen3_5MoeConfig``: its ``text_config``, with the
        wrapper's ``tie_word_embeddings`` (what its ``*ForConditionalGeneration`` ties by).

        Raises:
            NotImplementedError: another model type or a RoPE type other than default.
        """
        hf_config, tie = _text_config(hf_config)
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in _TEXT_MODEL_TYPES:
            raise NotImplementedError(f"Qwen3NextConfig.from_hf: model_type {model_type!r} is "
                                      f"not supported; expected one of "
                                      f"{', '.join(QWEN3_NEXT_MODEL_TYPES)}.")
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"Qwen3NextConfig.from_hf: rope_type "
                                      f"{rope['rope_type']!r} is not supported; expected "
                                      "default.")
        get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
        kw = dict(hf_decoder_kwargs(hf_config),
                  rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
                  attention_bias=bool(get("attention_bias", False)),
                  num_key_value_heads=hf_config.num_key_value_heads,
                  head_dim=hf_config.head_dim,
                  partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                       get("partial_rotary_factor", 1.0))),
                  layer_types=list(hf_config.layer_types),
                  split_projections=model_type != "qwen3_next")
        if tie is not None:
            kw["tie_word_embeddings"] = tie
        for name in ("linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim"):
            kw[name] = get(name)
        if model_type != "qwen3_5_text":  # the MoE models
            kw.update(num_experts=hf_config.num_experts,
                      num_experts_per_tok=hf_config.num_experts_per_tok,
                      moe_intermediate_size=hf_config.moe_intermediate_size,
                      shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size)
        if model_type == "qwen3_next":
            kw.update(norm_topk_prob=bool(hf_config.norm_topk_prob),
                      decoder_sparse_step=hf_config.decoder_sparse_step,
                      mlp_only_layers=list(hf_config.mlp_only_layers or []))
        if model_type == "qwen3_5_moe_text":  # no dense MLP: intermediate_size is unused
            kw["intermediate_size"] = hf_config.moe_intermediate_size
        return cls(**kw)


def _text_config(hf_config):
    """``(text config, tie_word_embeddings or None)``: a multimodal Qwen3.5 config's
    ``text_config`` and its own ``tie_word_embeddings`` (its ``*ForConditionalGeneration``
    ties the LM head by the wrapper's flag), else ``(hf_config, None)``."""
    if getattr(hf_config, "model_type", None) not in QWEN3_5_MULTIMODAL_TYPES:
        return hf_config, None
    return hf_config.text_config, bool(getattr(hf_config, "tie_word_embeddings", False))


__all__ = ["Qwen3NextConfig", "QWEN3_NEXT_MODEL_TYPES", "QWEN3_5_MULTIMODAL_TYPES",
           "HYBRID_LAYER_TYPES"]
