"""Model configs: ``DecoderConfig``, the fields every zoo decoder shares, and ``ModelConfig``, one
dataclass describing every Llama-family decoder the zoo builds.

Field names follow Hugging Face ``transformers`` configs, so ``ModelConfig.from_hf(hf_config)``
is mostly a copy. Per-layer attention options are lists indexed by layer id (``layer_types``,
``use_rope``); everything else is global. Supported ``model_type`` values: llama, mistral,
qwen2, qwen3, gemma2 (softcap, sandwich norms, scaled embeddings), gemma3_text and the text part
of gemma3 (``Gemma3Config``: a RoPE base of its own for the sliding-window layers), gpt_oss
(attention sinks, mixture of experts; default or llama3 RoPE only) and llama4_text
(``Llama4Config``: the fields only ``compile.models.llama4`` reads). DeepSeek-V2/V3's ``DeepseekV2Config`` (MLA, MoE) is a
``DecoderConfig`` too (``compile.models.deepseek_v2``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Optional

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


@dataclasses.dataclass
class DecoderConfig:
    """Fields every decoder of the zoo has (units: tokens, features, heads).

    Attributes:
        vocab_size, hidden_size, intermediate_size, num_hidden_layers: usual sizes.
        num_attention_heads: Hq.
        rms_norm_eps: epsilon of the hidden-state RMSNorms.
        rope_theta: RoPE base. max_position_embeddings: positions the rotary table covers.
        tie_word_embeddings: lm_head shares the embedding matrix.
        attention_bias: attention projections carry biases (Llama family: q/k/v, as Qwen2;
            DeepSeek-V2: q_a/kv_a/o).
        mlp_bias: MLP biases. hidden_act: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma).
        bos_token_id, eos_token_id: from the source config (eos may be a list).
    """

    vocab_size: int = 32000
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: Optional[int] = None
    eos_token_id: Any = None


@dataclasses.dataclass
class ModelConfig(DecoderConfig):
    """Shapes and options of a Llama-family decoder: ``DecoderConfig``'s fields plus these.

    Attributes:
        num_key_value_heads: Hkv (Hq % Hkv == 0). head_dim: D.
        norm_weight_offset: 1.0 when the norm multiplies by ``1 + weight`` (Gemma), else 0.0.
        rope_scaling: None or a dict with ``rope_type`` in {"default", "linear", "llama3"} and
            that type's keys (``factor``, ...).
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3; Gemma 3, whose norms, like all
            its norms, multiply by ``norm_weight_offset + weight``).
        layer_types: per layer, one of LAYER_TYPES (None: all full attention).
        sliding_window: W of "sliding_attention" layers, the Hugging Face meaning: a query sees
            itself and the W - 1 keys before it.
        attention_chunk_size: chunk of "chunked_attention" layers (iRoPE local attention).
        use_rope: per layer, whether RoPE is applied (None: every layer).
        attn_logit_softcap: tanh softcap of attention scores (0: off).
        final_logit_softcap: tanh softcap of the output logits (0: off).
        attention_sinks: every attention layer learns one sink logit per query head.
        o_proj_bias: the attention output projection carries a bias (GPT-OSS).
        num_local_experts / num_experts_per_tok: mixture-of-experts MLP (GPT-OSS style) when
            num_local_experts > 0; swiglu_alpha / swiglu_limit: its clamped SwiGLU.
        query_pre_attn_scalar: softmax scale is its ``** -0.5`` (None: ``D ** -0.5``).
        embed_scale: multiplier on the embeddings (Gemma: ``sqrt(hidden_size)``).
        sandwich_norm: extra RMSNorms after attention and after the MLP (Gemma2).
    """

    num_key_value_heads: int = 2
    head_dim: Optional[int] = None
    norm_weight_offset: float = 0.0
    rope_scaling: Optional[dict[str, Any]] = None
    qk_norm: bool = False
    layer_types: Optional[list[str]] = None
    sliding_window: Optional[int] = None
    attention_chunk_size: Optional[int] = None
    use_rope: Optional[list[bool]] = None
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    attention_sinks: bool = False
    o_proj_bias: bool = False
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    query_pre_attn_scalar: Optional[float] = None
    embed_scale: float = 1.0
    sandwich_norm: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"ModelConfig: num_attention_heads must be a multiple of "
                             f"num_key_value_heads; got {self.num_attention_heads} and "
                             f"{self.num_key_value_heads}.")
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if len(self.layer_types) != self.num_hidden_layers or bad:
            raise ValueError(f"ModelConfig: layer_types must list one of {LAYER_TYPES} per layer "
                             f"({self.num_hidden_layers}); got {self.layer_types}.")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("ModelConfig: sliding_attention layers need sliding_window > 0; "
                             f"got {self.sliding_window}.")
        if "chunked_attention" in self.layer_types and not self.attention_chunk_size:
            raise ValueError("ModelConfig: chunked_attention layers need attention_chunk_size > 0;"
                             f" got {self.attention_chunk_size}.")

    @property
    def scaling(self) -> float:
        """Softmax scale of every attention layer."""
        base = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(base) ** -0.5

    def layer_sliding_window(self, layer_id: int) -> int:
        """Left window bound ``W - 1`` of ``layer_id`` for a Hugging Face ``sliding_window = W``
        (-1: not a sliding layer), as ``PagedAttention``'s ``sliding_window_size`` takes it (the
        sglang convention)."""
        if self.layer_types[layer_id] == "sliding_attention":
            return self.sliding_window - 1
        return -1

    def layer_uses_rope(self, layer_id: int) -> bool:
        """True unless ``use_rope`` marks ``layer_id`` as a NoPE layer."""
        return True if self.use_rope is None else bool(self.use_rope[layer_id])

    @classmethod
    def from_hf(cls, hf_config) -> "ModelConfig":
        """Build from a ``transformers`` config (llama/mistral/qwen2/qwen3/gemma2/gpt_oss; a
        llama4_text config gives a ``Llama4Config``, gemma3_text and gemma3 a ``Gemma3Config``).

        Raises:
            NotImplementedError: a model type or RoPE type this zoo does not implement.
        """
        model_type = getattr(hf_config, "model_type", "llama")
        if model_type == "llama4_text":
            return Llama4Config.from_hf(hf_config)
        if model_type in ("gemma3_text", "gemma3"):
            return Gemma3Config.from_hf(hf_config)
        check_model_type("ModelConfig.from_hf", model_type, CONFIG_MODEL_TYPES)
        get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
        kw = _hf_common(hf_config, model_type)
        kw.update(_hf_layer_types(hf_config, model_type))
        if model_type == "gemma2":
            kw.update(norm_weight_offset=1.0, embed_scale=float(hf_config.hidden_size) ** 0.5,
                      sandwich_norm=True, query_pre_attn_scalar=get("query_pre_attn_scalar"),
                      attn_logit_softcap=float(get("attn_logit_softcapping") or 0.0),
                      final_logit_softcap=float(get("final_logit_softcapping") or 0.0),
                      hidden_act=get("hidden_activation") or "gelu_pytorch_tanh")
        if model_type == "gpt_oss":
            kw.update(attention_sinks=True, o_proj_bias=bool(get("attention_bias", True)),
                      num_local_experts=hf_config.num_local_experts,
                      num_experts_per_tok=hf_config.num_experts_per_tok,
                      swiglu_alpha=float(get("swiglu_alpha", 1.702)),
                      swiglu_limit=float(get("swiglu_limit", 7.0)))
        return cls(**kw)


_HF_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt_oss"}
#: ``model_type`` values ``ModelConfig.from_hf`` reads (DeepSeek-V2 has a config of its own).
CONFIG_MODEL_TYPES = tuple(sorted(_HF_MODEL_TYPES | {"llama4_text", "gemma3_text", "gemma3"}))
#: Every ``transformers`` ``model_type`` the zoo builds (``compile.models.from_hf``); Qwen3-Next
#: and Qwen3.5 have a config of their own (``compile.models.qwen3_next_config``; of the
#: multimodal qwen3_5 and qwen3_5_moe the text model is built).
SUPPORTED_MODEL_TYPES = tuple(sorted(CONFIG_MODEL_TYPES
                                     + ("deepseek_v2", "deepseek_v3", "deepseek_v32")
                                     + ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
                                     + ("qwen3_5", "qwen3_5_moe")))


def check_model_type(where: str, model_type, supported=SUPPORTED_MODEL_TYPES) -> None:
    """Raise ``NotImplementedError`` naming the ``supported`` types unless ``model_type`` is
    one. The message is one line: ``python -m compile`` prints it as the argument error."""
    if model_type not in supported:
        raise NotImplementedError(f"{where}: model_type {model_type!r} is not supported; "
                                  f"expected one of {', '.join(supported)}.")


@dataclasses.dataclass
class Llama4Config(ModelConfig):
    """A Llama 4 text decoder (``compile.models.llama4``): ``ModelConfig`` plus Llama 4's options.

    Inherited fields keep their meaning; in Llama 4 ``layer_types`` marks the RoPE layers
    "chunked_attention" (``attention_chunk_size``) and the NoPE layers (``use_rope`` False)
    "full_attention", and ``intermediate_size`` is the size of each expert and of the shared
    expert. ``qk_norm`` (Qwen3's weighted norm before RoPE) must stay False.

    Attributes:
        intermediate_size_mlp: hidden size of the dense (non-MoE) layers' MLP.
        moe_layers: ids of the layers whose MLP is Llama 4's MoE (``num_local_experts`` experts,
            top-``num_experts_per_tok`` sigmoid router, one shared expert); empty: all dense.
        qk_l2_norm: weightless RMS ("L2") norm of q and k after RoPE, on RoPE layers only.
        attn_temperature_tuning: NoPE layers scale the query at position ``p`` by
            ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` (floor_scale in tokens).
    """

    intermediate_size_mlp: int = 128
    moe_layers: list[int] = dataclasses.field(default_factory=list)
    qk_l2_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"Llama4Config: moe_layers must be layer ids below "
                             f"{self.num_hidden_layers}; got {self.moe_layers}.")
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"Llama4Config: MoE layers need 0 < num_experts_per_tok <= "
                             f"num_local_experts; got {self.num_experts_per_tok} and "
                             f"{self.num_local_experts}.")
        if self.qk_norm:
            raise ValueError("Llama4Config: qk_norm (weighted, before RoPE) is not Llama 4's; "
                             "set qk_l2_norm=True instead.")

    @classmethod
    def from_hf(cls, hf_config) -> "Llama4Config":
        """Build from a ``transformers`` ``Llama4TextConfig`` (for a multimodal ``Llama4Config``
        pass its ``text_config``).

        Raises:
            NotImplementedError: another model type or an unsupported RoPE type.
        """
        model_type = getattr(hf_config, "model_type", None)
        if model_type != "llama4_text":
            raise NotImplementedError(f"Llama4Config.from_hf: model_type {model_type!r} is not "
                                      "supported; expected 'llama4_text' (pass a multimodal "
                                      "config's text_config).")
        n, types = hf_config.num_hidden_layers, list(hf_config.layer_types)
        bias = bool(hf_config.attention_bias)
        kw = _hf_common(hf_config, model_type)
        kw.update(layer_types=types, use_rope=[bool(r) for r in hf_config.no_rope_layers[:n]],
                  attention_chunk_size=(hf_config.attention_chunk_size
                                        if "chunked_attention" in types else None),
                  attention_bias=bias, o_proj_bias=bias, qk_norm=False,
                  intermediate_size_mlp=hf_config.intermediate_size_mlp,
                  moe_layers=list(hf_config.moe_layers),
                  num_local_experts=hf_config.num_local_experts,
                  num_experts_per_tok=hf_config.num_experts_per_tok,
                  qk_l2_norm=bool(hf_config.use_qk_norm),
                  attn_temperature_tuning=bool(hf_config.attn_temperature_tuning),
                  floor_scale=float(hf_config.floor_scale),
                  attn_scale=float(hf_config.attn_scale))
        return cls(**kw)


@dataclasses.dataclass
class Gemma3Config(ModelConfig):
    """A Gemma 3 text decoder (``compile.models.gemma3``): ``ModelConfig`` plus the RoPE of its
    sliding-window layers.

    Gemma 3 interleaves ``sliding_attention`` layers (window ``sliding_window``) with
    ``full_attention`` ones (5:1 in the released models), normalises q and k per head, wraps
    attention and MLP in sandwich norms, scales the embeddings by ``sqrt(hidden_size)`` and
    uses ``query_pre_attn_scalar ** -0.5`` as the softmax scale; ``rope_theta`` and
    ``rope_scaling`` are those of the full-attention (global) layers.

    Attributes:
        rope_local_base_freq: RoPE base of the sliding-window (local) layers.
        rope_local_scaling: their RoPE scaling (None: default RoPE, as in every released model).
    """

    rope_local_base_freq: float = 10000.0
    rope_local_scaling: Optional[dict[str, Any]] = None

    def layer_rope(self, layer_id: int) -> tuple[float, Optional[dict[str, Any]]]:
        """``(theta, scaling)`` of ``layer_id``'s RoPE: local for sliding layers, else global."""
        if self.layer_types[layer_id] == "sliding_attention":
            return self.rope_local_base_freq, self.rope_local_scaling
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_hf(cls, hf_config) -> "Gemma3Config":
        """Build from a ``transformers`` ``Gemma3TextConfig``, or a multimodal ``Gemma3Config``
        (its ``text_config``: the vision tower is not part of the zoo).

        Raises:
            NotImplementedError: another model type, an unsupported RoPE type, or
                ``use_bidirectional_attention`` (EmbeddingGemma's encoder, not a decoder).
        """
        model_type = getattr(hf_config, "model_type", None)
        if model_type == "gemma3":
            hf_config, model_type = hf_config.text_config, hf_config.text_config.model_type
        if model_type != "gemma3_text":
            raise NotImplementedError(f"Gemma3Config.from_hf: model_type {model_type!r} is not "
                                      "supported; expected 'gemma3_text' or 'gemma3'.")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise NotImplementedError("Gemma3Config.from_hf: use_bidirectional_attention=True "
                                      "is an encoder (EmbeddingGemma); expected a causal decoder.")
        get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
        (theta, scaling), (local_theta, local_scaling) = _gemma3_rope(hf_config)
        kw = _hf_common(hf_config, model_type, rope=(theta, scaling))
        kw.update(_hf_layer_types(hf_config, model_type))
        kw.update(norm_weight_offset=1.0, embed_scale=float(hf_config.hidden_size) ** 0.5,
                  sandwich_norm=True, qk_norm=True,
                  query_pre_attn_scalar=get("query_pre_attn_scalar"),
                  attn_logit_softcap=float(get("attn_logit_softcapping") or 0.0),
                  final_logit_softcap=float(get("final_logit_softcapping") or 0.0),
                  hidden_act=get("hidden_activation") or "gelu_pytorch_tanh",
                  rope_local_base_freq=local_theta, rope_local_scaling=local_scaling)
        return cls(**kw)


def _gemma3_rope(hf_config) -> tuple[tuple[float, Optional[dict]], tuple[float, Optional[dict]]]:
    """``((theta, scaling) of full layers, (theta, scaling) of sliding layers)`` from
    transformers 5's per-layer-type ``rope_parameters`` or 4.x's ``rope_theta``,
    ``rope_scaling`` and ``rope_local_base_freq``."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if "full_attention" in params:
        kinds = [dict(params["full_attention"]), dict(params["sliding_attention"])]
    else:
        kinds = [{**(getattr(hf_config, "rope_scaling", None) or {}),
                  "rope_theta": getattr(hf_config, "rope_theta", 1_000_000.0)},
                 {"rope_theta": getattr(hf_config, "rope_local_base_freq", 10_000.0)}]
    full, local = (_hf_rope(SimpleNamespace(rope_parameters=p)) for p in kinds)
    return full, local


def hf_decoder_kwargs(hf_config) -> dict[str, Any]:
    """``DecoderConfig`` keyword arguments read alike from every supported ``transformers``
    config: all but ``rope_theta`` and ``attention_bias``, whose sources and defaults differ."""
    get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
    return dict(
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
        intermediate_size=get("intermediate_size", 0),  # absent where every layer is MoE
        num_hidden_layers=hf_config.num_hidden_layers,
        num_attention_heads=hf_config.num_attention_heads, rms_norm_eps=hf_config.rms_norm_eps,
        max_position_embeddings=get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        mlp_bias=bool(get("mlp_bias", False)),
        hidden_act=get("hidden_act") or get("hidden_activation") or "silu",
        bos_token_id=get("bos_token_id"), eos_token_id=get("eos_token_id"))


def _hf_common(hf_config, model_type: str,
               rope: Optional[tuple[float, Optional[dict[str, Any]]]] = None) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments every supported ``transformers`` config shares
    (``rope``: ``(rope_theta, rope_scaling)`` when the caller read them, else ``_hf_rope``'s)."""
    get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
    theta, scaling = rope or _hf_rope(hf_config)
    return dict(
        hf_decoder_kwargs(hf_config),
        num_key_value_heads=get("num_key_value_heads") or hf_config.num_attention_heads,
        head_dim=get("head_dim"), rope_theta=theta, rope_scaling=scaling,
        attention_bias=bool(get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type == "qwen3")


def _hf_rope(hf_config) -> tuple[float, Optional[dict[str, Any]]]:
    """(rope_theta, rope_scaling) from either transformers 5 ``rope_parameters`` or 4.x fields."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise NotImplementedError(f"ModelConfig.from_hf: rope_type {rope_type!r} is not "
                                  "supported; expected default, linear or llama3.")
    theta = float(params.pop("rope_theta"))
    return theta, (None if rope_type == "default" else {**params, "rope_type": rope_type})


def _hf_layer_types(hf_config, model_type: str) -> dict[str, Any]:
    """Per-layer attention kinds: explicit ``layer_types`` or Mistral's global sliding window."""
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    n = hf_config.num_hidden_layers
    if not window:  # Qwen2/3 drop the window unless use_sliding_window; then every layer is full
        types = None
    if types is None:
        kind = "sliding_attention" if (model_type == "mistral" and window) else "full_attention"
        types = [kind] * n
    types = list(types)
    return dict(layer_types=types,
                sliding_window=window if "sliding_attention" in types else None)


__all__ = ["DecoderConfig", "ModelConfig", "Llama4Config", "Gemma3Config", "LAYER_TYPES",
           "CONFIG_MODEL_TYPES", "SUPPORTED_MODEL_TYPES", "check_model_type",
           "hf_decoder_kwargs"]
