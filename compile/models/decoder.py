"""What every decoder of the zoo shares: the pre-norm layer, the layer stack and the LM head.

Each model module (``llama``, ``llama4``, ``deepseek_v2``) builds its own attention, MLP and
rotary embedding and hands them to these classes, the way ``transformers``' Llama derivatives
reuse Llama's. Parameter names stay the checkpoint's (``embed_tokens``,
``layers.<i>.self_attn``, ``input_layernorm``, ``norm``, ``lm_head``), so
``compile.models.loading`` copies weights by name.

Tokens are packed: every tensor is ``[T, ...]`` for the ``T`` new tokens of the batch;
``forward_batch`` (a ``compile.batch.forward_batch.ForwardBatch``) is only read by the attention.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """``x / rms(x) * (offset + weight)``, normalised in float32, returned in x's dtype.

    ``offset = 0`` is Llama's norm (scale after the cast back), ``offset = 1`` Gemma's.
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps, self.offset = eps, offset

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., dim]`` normalised over the last dim; same shape and dtype."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (y * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * y.to(x.dtype)


class PreNormDecoderLayer(nn.Module):
    """Pre-norm residual block: ``h + self_attn(input_layernorm(h))``, then
    ``h + mlp(post_attention_layernorm(h))``.

    Args:
        config: its ``hidden_size`` and ``rms_norm_eps`` size the two norms.
        self_attn: ``self_attn(positions, x, forward_batch)``, ``x [T, hidden] -> [T, hidden]``.
        mlp: ``[T, hidden] -> [T, hidden]``, registered under ``mlp_name``.
        norm_offset: ``RMSNorm`` offset of both norms (1.0: Gemma's ``1 + weight``).
    Forward:
        ``positions [T]`` int64, ``h [T, hidden]``, ``forward_batch`` -> ``[T, hidden]``.
    """

    #: Attribute the MLP is registered under: the checkpoint's name (Llama 4: ``feed_forward``).
    mlp_name = "mlp"

    def __init__(self, config, self_attn: nn.Module, mlp: nn.Module, dtype=None, device=None,
                 *, norm_offset: float = 0.0):
        super().__init__()
        self.self_attn = self_attn
        self.add_module(self.mlp_name, mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_offset,
                                       dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                                norm_offset, dtype=dtype, device=device)

    def forward(self, positions: Tensor, h: Tensor, forward_batch) -> Tensor:
        """``h [T, hidden]``, ``positions [T]`` -> ``[T, hidden]``."""
        mlp = getattr(self, self.mlp_name)
        h = h + self.self_attn(positions, self.input_layernorm(h), forward_batch)
        return h + mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm: ``input_ids [T] -> hidden [T, hidden]``.

    Args:
        config: its ``vocab_size``, ``hidden_size``, ``rms_norm_eps`` and ``num_hidden_layers``.
        make_layer: ``make_layer(layer_id)`` builds one decoder layer, called ``layer(positions,
            h, forward_batch)``; called for ids ``0 .. num_hidden_layers - 1`` in order.
        norm_offset: ``RMSNorm`` offset of the final norm (1.0: Gemma).
        embed_scale: multiplier on the embeddings (Gemma: ``sqrt(hidden_size)``; 1.0: none).
    Forward:
        ``input_ids [T]``, ``positions [T]`` int64, ``forward_batch`` -> normed hidden states
        ``[T, hidden]``.
    """

    def __init__(self, config, make_layer: Callable[[int], nn.Module], dtype=None, device=None,
                 *, norm_offset: float = 0.0, embed_scale: float = 1.0):
        super().__init__()
        self.config = config
        self.embed_scale = embed_scale
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                         device=device)
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_offset, dtype=dtype,
                            device=device)

    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch) -> Tensor:
        """``input_ids [T]``, ``positions [T]`` int64 -> normed hidden states ``[T, hidden]``."""
        h = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        for layer in self.layers:
            h = layer(positions, h, forward_batch)
        return self.norm(h)


class LogitsProcessor(nn.Module):
    """LM head: ``h [n, hidden]``, ``weight [vocab, hidden]`` -> float32 logits ``[n, vocab]``
    (sglang's ``LogitsProcessor`` role; tensor parallelism swaps in
    ``compile.models.parallel.ParallelLogitsProcessor``, which gathers the vocabulary shards)."""

    def forward(self, h: Tensor, weight: Tensor) -> Tensor:
        """``h [n, hidden]`` -> ``[n, vocab]`` float32."""
        return F.linear(h, weight).float()


class DecoderForCausalLM(nn.Module):
    """A ``DecoderModel`` plus the LM head, sglang's calling convention.

    Subclasses set ``model_class`` (built as ``model_class(config, dtype, device)``).
    Args:
        config: the model's config; ``tie_word_embeddings`` drops ``lm_head`` (the logits then
            use ``model.embed_tokens``). dtype/device: of the parameters (RoPE tables stay
            float32).
    Attributes:
        logits_processor: ``(h, lm weight) -> logits`` (``LogitsProcessor``).
    Forward:
        input_ids: [T] int64 new tokens of the batch, packed request after request.
        positions: [T] int64 their positions.
        forward_batch: ForwardBatch with attention metadata already initialised.
        return_all_logits: False keeps only the last token of each request in extend modes
            (what sampling needs); decode always returns one row per token.
    Returns:
        logits [T or b, vocab_size] float32.
    """

    model_class: type  # a DecoderModel subclass taking (config, dtype, device)

    def __init__(self, config, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.config = config
        self.model = self.model_class(config, dtype, device)
        self.lm_head = None
        if not config.tie_word_embeddings:  # [vocab_size, hidden_size]
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                     dtype=dtype, device=device)
        self.logits_processor = LogitsProcessor()

    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch,
                return_all_logits: bool = False) -> Tensor:
        """``input_ids [T]``, ``positions [T]`` -> float32 logits ``[T or b, vocab_size]``
        (see the class docstring)."""
        h = self.model(input_ids, positions, forward_batch)
        mode = forward_batch.forward_mode
        if not return_all_logits and mode.is_extend_or_draft_extend_or_mixed(
                include_draft_extend_v2=True):
            h = h[torch.cumsum(forward_batch.extend_seq_lens, 0) - 1]  # [b], no host sync
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.logits_processor(h, weight)


__all__ = ["RMSNorm", "PreNormDecoderLayer", "DecoderModel", "DecoderForCausalLM",
           "LogitsProcessor"]
