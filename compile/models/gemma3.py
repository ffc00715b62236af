"""Gemma 3 text decoder over the paged KV cache (``gemma3_text``, and the text part of ``gemma3``).

Everything but the RoPE is a ``LlamaDecoderLayer`` configured the Gemma way
(``Gemma3Config``): QK-norm and every other RMSNorm multiply by ``1 + weight``, sandwich norms
around attention and MLP, GeGLU (tanh) MLP, embeddings scaled by ``sqrt(hidden_size)`` in the
weight dtype, softmax scale ``query_pre_attn_scalar ** -0.5``, tied LM head, optional final
logit softcap. Sliding-window (local) layers attend ``sliding_window`` tokens (the query and
the ``W - 1`` before it) with RoPE base ``rope_local_base_freq``; full-attention (global) layers
attend everything with ``rope_theta`` (and ``rope_scaling``). The engine keeps the local layers'
KV in a hybrid sliding-window pool (``compile.batch.memory_pool.SWAKVPool``) that holds only their
window.

Source: Gemma 3 technical report (arXiv 2503.19786); layer structure as ``transformers``'
``Gemma3ForCausalLM`` and sglang's ``gemma3_causal.py``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from compile.models.config import Gemma3Config
from compile.models.decoder import DecoderModel
from compile.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from compile.models.weights import TextOnly, copy_from_hf
from compile.models.rope import RotaryEmbedding


class Gemma3Model(DecoderModel):
    """``DecoderModel`` of ``LlamaDecoderLayer`` layers with one RoPE table per layer kind:
    sliding-window layers share the local table, full-attention layers the global one."""

    def __init__(self, config: Gemma3Config, dtype=None, device=None):
        tables: dict[tuple, RotaryEmbedding] = {}

        def rotary(layer_id: int) -> RotaryEmbedding:
            theta, scaling = config.layer_rope(layer_id)
            key = (theta, repr(scaling))
            if key not in tables:  # at most two tables, shared by their layers
                tables[key] = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                              theta, scaling).to(device)
            return tables[key]

        def make_layer(i: int) -> nn.Module:
            return LlamaDecoderLayer(config, i, rotary(i), dtype, device)

        super().__init__(config, make_layer, dtype, device, norm_offset=config.norm_weight_offset,
                         embed_scale=config.embed_scale)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """``(input_ids [T], positions [T], forward_batch, return_all_logits=False) -> logits
    [T or b, vocab_size]`` float32 of a Gemma 3 text decoder (see the module docstring).

    Args:
        config: Gemma3Config. dtype/device: of the parameters (the RoPE tables stay float32).

    >>> import torch
    >>> from compile.models.config import Gemma3Config
    >>> cfg = Gemma3Config(vocab_size=64, hidden_size=32, intermediate_size=48,
    ...                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    ...                    head_dim=16, layer_types=["sliding_attention", "full_attention"],
    ...                    sliding_window=4, qk_norm=True, sandwich_norm=True,
    ...                    norm_weight_offset=1.0, tie_word_embeddings=True)
    >>> model = Gemma3ForCausalLM(cfg)
    >>> [layer.self_attn.attn.sliding_window_size for layer in model.model.layers]
    [3, -1]
    """

    model_class = Gemma3Model


def from_hf(hf_model, dtype: Optional[torch.dtype] = None, device=None) -> Gemma3ForCausalLM:
    """``Gemma3ForCausalLM`` holding a copy of ``hf_model``'s text weights.

    Args:
        hf_model: ``transformers``' ``Gemma3ForCausalLM`` (``gemma3_text``) or
            ``Gemma3ForConditionalGeneration`` (``gemma3``: its language model and LM head;
            the vision tower and projector are left out).
        dtype, device: default those of ``hf_model``'s first tensor.
    Raises:
        KeyError, ValueError: see ``compile.models.weights.load_state``.
    """
    config = Gemma3Config.from_hf(hf_model.config)
    return copy_from_hf(Gemma3ForCausalLM, config, TextOnly(hf_model), dtype, device)


__all__ = ["Gemma3ForCausalLM", "Gemma3Model", "from_hf"]
