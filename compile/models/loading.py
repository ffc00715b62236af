"""``from_hf``: build the zoo's model from a loaded ``transformers`` model with the same weights.

Hugging Face keeps q/k/v and gate/up as separate matrices; the zoo fuses them (one matmul each,
as sglang's ``QKVParallelLinear``/``MergedColumnParallelLinear``), so loading concatenates rows.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from compile.models.config import ModelConfig, check_model_type
from compile.models.llama import LlamaForCausalLM

# our parameter suffix -> Hugging Face suffixes concatenated along dim 0
_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.gate_up_proj.bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
    # Llama 4 names its MLP feed_forward; MoE layers add a shared expert
    "feed_forward.gate_up_proj.weight": ("feed_forward.gate_proj.weight",
                                         "feed_forward.up_proj.weight"),
    "shared_expert.gate_up_proj.weight": ("shared_expert.gate_proj.weight",
                                          "shared_expert.up_proj.weight"),
    "self_attn.q_norm.weight": ("self_attn.q_norm.weight",),
    "self_attn.k_norm.weight": ("self_attn.k_norm.weight",),
}


def from_hf(hf_model, dtype: Optional[torch.dtype] = None, device=None) -> torch.nn.Module:
    """Zoo model holding a copy of ``hf_model``'s weights.

    Args:
        hf_model: a ``transformers`` causal LM of a type ``ModelConfig.from_hf`` supports
            (``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``Gemma2ForCausalLM``, ...), or a
            ``DeepseekV2ForCausalLM`` (MLA; ``compile.models.deepseek_v2``) or a
            ``Llama4ForCausalLM`` (text; ``compile.models.llama4``), or a Gemma 3
            ``Gemma3ForCausalLM`` / ``Gemma3ForConditionalGeneration`` (text part;
            ``compile.models.gemma3``).
        dtype: parameter dtype (default: the HF model's). device: default the HF model's.
    Returns:
        The model in eval mode; its attention runs through ``PagedAttention``.
    Raises:
        KeyError: a parameter of the zoo model has no source in ``hf_model``'s state dict.
        ValueError: a source tensor's shape differs from the zoo parameter's.
        NotImplementedError: a ``model_type`` outside ``SUPPORTED_MODEL_TYPES`` (the message
            names them) or an unsupported option of a supported one.
    """
    model_type = getattr(hf_model.config, "model_type", None)
    check_model_type("from_hf", model_type)
    if model_type == "deepseek_v2":
        from compile.models import deepseek_v2   # imports this module: resolve at call time
        return deepseek_v2.from_hf(hf_model, dtype=dtype, device=device)
    if model_type == "llama4_text":
        from compile.models import llama4   # imports this module: resolve at call time
        return llama4.from_hf(hf_model, dtype=dtype, device=device)
    if model_type in ("gemma3_text", "gemma3"):
        from compile.models import gemma3   # imports this module: resolve at call time
        return gemma3.from_hf(hf_model, dtype=dtype, device=device)
    return copy_from_hf(LlamaForCausalLM, ModelConfig.from_hf(hf_model.config), hf_model, dtype,
                        device)


def copy_from_hf(model_class, config, hf_model, dtype: Optional[torch.dtype] = None,
                 device=None) -> torch.nn.Module:
    """``model_class(config)`` in eval mode holding a copy of ``hf_model``'s weights (q/k/v and
    gate/up fused); ``dtype`` and ``device`` default to those of ``hf_model``'s first tensor.

    Raises:
        KeyError, ValueError: see ``load_state``.
    """
    src = hf_model.state_dict()
    first = next(iter(src.values()))
    model = model_class(config, dtype=dtype or first.dtype, device=device or first.device)
    load_state(model, lambda name: _source(src, name))
    return model.eval()


def load_state(model: torch.nn.Module, fetch: Callable[[str], Tensor]) -> None:
    """Copy ``fetch(name)`` into every parameter ``name`` of ``model`` (shape-checked)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = fetch(name)
            if value.shape != param.shape:
                raise ValueError(f"load_state: {name} has shape {tuple(value.shape)} in the "
                                 f"source; expected {tuple(param.shape)}.")
            param.copy_(value)


def _source(src: dict[str, Tensor], name: str) -> Tensor:
    """HF tensor(s) behind zoo parameter ``name`` (fused ones concatenated)."""
    for ours, theirs in _FUSED.items():
        if name.endswith(ours):
            prefix = name[: -len(ours)]
            return torch.cat([src[prefix + t] for t in theirs], dim=0)
    if name in src:
        return src[name]
    raise KeyError(f"from_hf: no source tensor for parameter {name!r}; the Hugging Face model "
                   f"has e.g. {sorted(src)[:4]}.")


__all__ = ["from_hf", "copy_from_hf", "load_state"]
