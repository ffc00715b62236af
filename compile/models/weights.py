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


__all__ = ["copy_from_hf", "load_state"]
