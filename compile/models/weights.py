"""Copy a ``transformers`` model's weights into a zoo model of the same shapes.

Hugging Face keeps q/k/v and gate/up as separate matrices; the zoo fuses them (one matmul each,
as sglang's ``QKVParallelLinear``/``MergedColumnParallelLinear``), so copying concatenates rows.
Each model family's ``from_hf`` calls ``copy_from_hf``; ``compile.models.loading.from_hf`` picks
the family.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

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
    # DeepSeek MoE layers: shared_experts (plural)
    "shared_experts.gate_up_proj.weight": ("shared_experts.gate_proj.weight",
                                           "shared_experts.up_proj.weight"),
    "shared_experts.gate_up_proj.bias": ("shared_experts.gate_proj.bias",
                                         "shared_experts.up_proj.bias"),
    "self_attn.q_norm.weight": ("self_attn.q_norm.weight",),
    "self_attn.k_norm.weight": ("self_attn.k_norm.weight",),
}


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


def column_major_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Store every ``nn.Linear`` weight of ``model`` column-major, in place, and a tied input
    embedding that the LM head reads (``model.lm_head is None``) too; returns ``model``.

    Shapes and values stay (``[out, in]``, the same numbers); only the strides change: the
    transpose ``[in, out]`` is the contiguous matrix (strides ``(1, out)``), so ``F.linear(x,
    w)`` hands the CPU BLAS ``x @ w.t()`` as a plain row-major product (faster than the
    transposed one only while the weight stays in cache; a whole decode step, which streams
    every weight from memory, runs slower, so ``from_hf`` does this only when asked:
    ``cpu_column_major=True``). Parameters keep their identity (``param.data`` is replaced). The embedding
    lookup then reads each token's row with stride ``vocab`` (slower per token, a few tokens
    per decode step). Any code that ``view``s a weight needs it contiguous: not for models
    with such code (DeepSeek-V2's ``kv_b_proj``).
    """
    def column_major(param: torch.nn.Parameter) -> None:
        if param.dim() == 2 and param.stride() != (1, param.shape[0]):
            param.data = param.data.t().contiguous().t()

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                column_major(module.weight)
        if getattr(model, "lm_head", False) is None:
            column_major(model.model.embed_tokens.weight)
    return model


class TextOnly:
    """``hf_model`` seen through its text decoder's parameter names, for the multimodal
    wrappers (``Gemma3ForConditionalGeneration``, ``Qwen3_5ForConditionalGeneration``, ...):
    they keep the decoder under ``model.language_model.``, the zoo (and the text-only
    ``*ForCausalLM``) under ``model.``. The LM head keeps its name; the vision tower and
    projector are left out. A model with no ``model.language_model.`` tensor (text-only
    already) is seen unchanged.
    """

    PREFIX = "model.language_model."

    def __init__(self, hf_model):
        self._model = hf_model

    def state_dict(self) -> dict[str, Tensor]:
        src = self._model.state_dict()
        text = {"model." + k[len(self.PREFIX):]: v for k, v in src.items()
                if k.startswith(self.PREFIX)}
        if not text:
            return src
        text.update({k: v for k, v in src.items() if k.startswith("lm_head.")})
        return text


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


__all__ = ["copy_from_hf", "load_state", "column_major_weights", "TextOnly"]
