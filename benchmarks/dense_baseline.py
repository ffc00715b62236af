"""A dense-cache Llama decoder written the way gpt-fast writes one: the peer of ``bench_model``.

Each layer keeps a static KV cache ``[b, Hkv, max_len, D]``; a step writes its tokens' K/V at
their positions with ``index_copy_`` and attends over the whole cache with
``F.scaled_dot_product_attention`` under a mask of the valid positions, so every shape is fixed
and ``torch.compile(mode="reduce-overhead", fullgraph=True)`` captures the step as one device
graph. Every request of the batch sits at the same positions (gpt-fast's ``input_pos``).

The weights are the paged model's own modules (``from_paged``): the same tensors, no copy.
Everything around them (RMSNorm, neox RoPE, the cache, attention) is written here, sharing no
code with ``compile/``, so agreement of the logits checks both.

GQA: ``gqa="pack"`` (default) folds the ``Hq / Hkv`` query heads of one KV head into query rows
of one multi-head SDPA call over ``Hkv`` heads, so the cache is read once (FlashAttention's
``pack_gqa``); ``gqa="repeat"`` is gpt-fast's ``repeat_interleave`` of K/V to ``Hq`` heads,
which materialises the cache ``Hq / Hkv`` times per step.
Source: gpt-fast (pytorch-labs/gpt-fast ``model.py``), Llama (arXiv 2302.13971).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GQA_LAYOUTS = ("pack", "repeat")


def unsupported_features(config) -> list[str]:
    """Names of the ``ModelConfig`` features this dense decoder does not implement (empty: it
    computes the same function as the paged ``LlamaForCausalLM``)."""
    flags = {"rope_scaling": config.rope_scaling, "qk_norm": config.qk_norm,
             "sliding or chunked layers": set(config.layer_types) != {"full_attention"},
             "NoPE layers": config.use_rope is not None, "attention_sinks": config.attention_sinks,
             "attn_logit_softcap": config.attn_logit_softcap,
             "final_logit_softcap": config.final_logit_softcap,
             "mixture of experts": config.num_local_experts, "sandwich_norm": config.sandwich_norm,
             "norm_weight_offset": config.norm_weight_offset, "embed_scale != 1":
             config.embed_scale != 1.0, "hidden_act != silu": config.hidden_act != "silu"}
    return [name for name, on in flags.items() if on]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * x / rms(x)`` over the last dim, normalised in float32; x's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def rope_tables(head_dim: int, max_len: int, theta: float, device) -> tuple[Tensor, Tensor]:
    """cos, sin ``[max_len, head_dim // 2]`` float32 of ``position * theta ** (-2i / D)``."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.arange(max_len, device=device).float()[:, None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox layout: features ``i`` and ``i + D/2`` rotate together. ``x [b, s, H, D]``,
    ``cos``/``sin`` ``[s, D/2]``; computed in float32, returned in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]  # [s, 1, D/2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class KVCache(nn.Module):
    """Static K/V buffers ``[b, Hkv, max_len, D]``, written in place by position."""

    def __init__(self, b: int, num_kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (b, num_kv_heads, max_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device))

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k``/``v`` ``[b, Hkv, s, D]`` at ``input_pos [s]``; returns both caches."""
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        return self.k_cache, self.v_cache


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, gqa: str) -> Tensor:
    """SDPA of ``q [b, s, Hq, D]`` over ``k``/``v`` ``[b, Hkv, L, D]`` under ``mask [s, L]``
    (True: visible) -> ``[b, s, Hq * D]``."""
    b, s, hq, d = q.shape
    hkv = k.shape[1]
    if gqa == "repeat":  # gpt-fast: K/V copied to Hq heads
        k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=scale)
        return y.transpose(1, 2).reshape(b, s, hq * d)
    rows = q.view(b, s, hkv, hq // hkv, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, -1, d)
    mask = mask.repeat_interleave(hq // hkv, dim=0)  # row (t, g) sees what token t sees
    y = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scale)
    return y.view(b, hkv, s, hq // hkv, d).permute(0, 2, 1, 3, 4).reshape(b, s, hq * d)


class DenseBlock(nn.Module):
    """One pre-norm Llama layer over a ``KVCache``, with the paged layer's weight modules."""

    def __init__(self, paged_layer, config, cache: KVCache, gqa: str):
        super().__init__()
        attn = paged_layer.self_attn
        self.wqkv, self.wo = attn.qkv_proj, attn.o_proj
        self.w13, self.w2 = paged_layer.mlp.gate_up_proj, paged_layer.mlp.down_proj
        self.attention_norm = paged_layer.input_layernorm.weight
        self.ffn_norm = paged_layer.post_attention_layernorm.weight
        self.kv_cache, self.gqa = cache, gqa
        self.hq, self.hkv, self.d = attn.hq, attn.hkv, attn.d
        self.eps, self.scale = config.rms_norm_eps, config.scaling

    def forward(self, x: Tensor, input_pos: Tensor, cos: Tensor, sin: Tensor,
                mask: Tensor) -> Tensor:
        """``x [b, s, hidden]`` at ``input_pos [s]`` -> ``[b, s, hidden]``; writes the cache."""
        b, s, _ = x.shape
        qkv = self.wqkv(rms_norm(x, self.attention_norm, self.eps))
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = apply_rope(q.view(b, s, self.hq, self.d), cos, sin)
        k = apply_rope(k.view(b, s, self.hkv, self.d), cos, sin)
        k_all, v_all = self.kv_cache.update(input_pos, k.transpose(1, 2),
                                            v.view(b, s, self.hkv, self.d).transpose(1, 2))
        h = x + self.wo(attend(q, k_all, v_all, mask, self.scale, self.gqa))
        gate, up = self.w13(rms_norm(h, self.ffn_norm, self.eps)).chunk(2, dim=-1)
        return h + self.w2(F.silu(gate) * up)


class DenseLlama(nn.Module):
    """gpt-fast's ``Transformer``: ``(idx [b, s], input_pos [s]) -> logits [b, s, vocab]``
    float32; every request of the batch holds its tokens at ``input_pos``.

    Built with ``from_paged``; ``max_len`` is the cache length in tokens (positions
    ``0 .. max_len - 1``).
    """

    def __init__(self, paged_model, b: int, max_len: int, gqa: str = "pack"):
        super().__init__()
        cfg, weight = paged_model.config, next(paged_model.parameters())
        base = paged_model.model
        self.tok_embeddings, self.norm = base.embed_tokens, base.norm.weight
        self.output = paged_model.lm_head  # None: tied to tok_embeddings
        self.layers = nn.ModuleList(
            DenseBlock(layer, cfg, KVCache(b, cfg.num_key_value_heads, max_len, cfg.head_dim,
                                           weight.dtype, weight.device), gqa)
            for layer in base.layers)
        cos, sin = rope_tables(cfg.head_dim, max_len, cfg.rope_theta, weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.eps, self.max_len = cfg.rms_norm_eps, max_len

    @classmethod
    def from_paged(cls, paged_model, b: int, max_len: int, gqa: str = "pack") -> "DenseLlama":
        """The dense twin of a zoo ``LlamaForCausalLM`` (shares its weight tensors).

        Raises:
            ValueError: ``gqa`` not in ``GQA_LAYOUTS``, or ``max_len`` beyond the model's
                positions.
            NotImplementedError: the model uses a feature listed by ``unsupported_features``.
        """
        cfg = paged_model.config
        if gqa not in GQA_LAYOUTS:
            raise ValueError(f"DenseLlama.from_paged: gqa is {gqa!r}; expected one of "
                             f"{GQA_LAYOUTS}. Pass gqa='pack' or gqa='repeat'.")
        if not 1 <= max_len <= cfg.max_position_embeddings:
            raise ValueError(f"DenseLlama.from_paged: max_len out of range; expected 1 <= "
                             f"max_len <= max_position_embeddings={cfg.max_position_embeddings}"
                             f", got {max_len}. Use a shorter context.")
        missing = unsupported_features(cfg)
        if missing:
            raise NotImplementedError(f"DenseLlama.from_paged: the model uses {missing}, which "
                                      "the dense baseline does not implement.")
        return cls(paged_model, b, max_len, gqa)

    def forward(self, idx: Tensor, input_pos: Tensor) -> Tensor:
        """``idx [b, s]`` int64 tokens at positions ``input_pos [s]`` int64 -> ``[b, s, vocab]``
        float32 logits; writes every layer's cache at ``input_pos``."""
        mask = torch.arange(self.max_len, device=idx.device) <= input_pos[:, None]  # [s, L]
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [s, D/2]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, cos, sin, mask)
        x = rms_norm(x, self.norm, self.eps)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        return F.linear(x, weight).float()


def compile_dense(dense: DenseLlama, mode: str | None = "reduce-overhead"):
    """``torch.compile(dense, mode=mode, fullgraph=True)``; the default is gpt-fast's decode
    setting, Inductor plus one device graph of the whole step (no graph on the CPU); ``None``:
    Inductor alone."""
    return torch.compile(dense, mode=mode, fullgraph=True)


__all__ = ["DenseLlama", "KVCache", "GQA_LAYOUTS", "compile_dense", "unsupported_features"]
