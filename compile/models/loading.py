"""``from_hf``: build the zoo's model from a loaded ``transformers`` model with the same weights
(the family's module by ``model_type``; ``compile.models.weights`` copies the tensors).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from compile.models import deepseek_v2, deepseek_v32, gemma3, llama4, qwen3_next
from compile.models.config import ModelConfig, check_model_type
from compile.models.llama import LlamaForCausalLM
from compile.models.qwen3_next_config import QWEN3_NEXT_MODEL_TYPES
from compile.models.weights import column_major_weights, copy_from_hf


def from_hf(hf_model, dtype: Optional[torch.dtype] = None, device=None, *,
            cpu_column_major: bool = False) -> torch.nn.Module:
    """Zoo model holding a copy of ``hf_model``'s weights.

    Args:
        hf_model: a ``transformers`` causal LM of a type ``ModelConfig.from_hf`` supports
            (``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``Gemma2ForCausalLM``, ...), or a
            ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` (MLA, MoE;
            ``compile.models.deepseek_v2``), a ``DeepseekV32ForCausalLM`` (MLA with DSA sparse
            attention; ``compile.models.deepseek_v32``) or a
            ``Llama4ForCausalLM`` (text; ``compile.models.llama4``), or a Gemma 3
            ``Gemma3ForCausalLM`` / ``Gemma3ForConditionalGeneration`` (text part;
            ``compile.models.gemma3``), or a ``Qwen3NextForCausalLM`` / ``Qwen3_5ForCausalLM`` /
            ``Qwen3_5MoeForCausalLM`` (``compile.models.qwen3_next``: gated-delta-net and
            full-attention layers), or the text part of a multimodal
            ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` (the
            vision tower is ignored).
        dtype: parameter dtype (default: the HF model's). device: default the HF model's.
        cpu_column_major: True: on the CPU, a ``LlamaForCausalLM`` (every type but the three
            above) stores its linear weights and tied embedding column-major
            (``compile.models.weights.column_major_weights``, same values). Off by default: a
            decode step streams every weight from memory once, and the row-major ``x @ W^T``
            (what ``transformers`` runs) reads them faster than the column-major product
            (``benchmarks/bench_cpu_decode.py --layouts``).
    Returns:
        The model in eval mode; its attention runs through ``PagedAttention``.
    Raises:
        TypeError: ``hf_model`` is no loaded model (a folder's path, say).
        KeyError: a parameter of the zoo model has no source in ``hf_model``'s state dict.
        ValueError: a source tensor's shape differs from the zoo parameter's.
        NotImplementedError: a ``model_type`` outside ``SUPPORTED_MODEL_TYPES`` (the message
            names them) or an unsupported option of a supported one.
    """
    if getattr(hf_model, "config", None) is None:  # a folder's path, say: load it first
        got = repr(str(hf_model)) if isinstance(hf_model, (str, os.PathLike)) else \
            type(hf_model).__name__
        raise TypeError(f"from_hf: hf_model expected a loaded transformers model (one with a "
                        f".config), got {got}. Load a folder first: transformers."
                        f"AutoModelForCausalLM.from_pretrained(path), or compile.models.gguf."
                        f"load_hf(path) for the model and its tokenizer")
    model_type = getattr(hf_model.config, "model_type", None)
    check_model_type("from_hf", model_type)
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return deepseek_v2.from_hf(hf_model, dtype=dtype, device=device)
    if model_type == "deepseek_v32":
        return deepseek_v32.from_hf(hf_model, dtype=dtype, device=device)
    if model_type == "llama4_text":
        return llama4.from_hf(hf_model, dtype=dtype, device=device)
    if model_type in ("gemma3_text", "gemma3"):
        return gemma3.from_hf(hf_model, dtype=dtype, device=device)
    if model_type in QWEN3_NEXT_MODEL_TYPES:
        return qwen3_next.from_hf(hf_model, dtype=dtype, device=device)
    model = copy_from_hf(LlamaForCausalLM, ModelConfig.from_hf(hf_model.config), hf_model, dtype,
                         device)
    if cpu_column_major and next(model.parameters()).device.type == "cpu":
        column_major_weights(model)
    return model


__all__ = ["from_hf"]
