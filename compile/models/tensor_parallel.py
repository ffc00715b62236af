"""``tensor_parallel(model, tp)``: shard a loaded Llama-family zoo model over a process group.

Each rank keeps its shard of every weight (``compile.models.parallel``): the fused q/k/v and
gate/up projections column-parallel (q heads, KV heads and MLP columns of this rank, each block
sliced on its own so the fused layout stays ``[q | k | v]`` and ``[gate | up]``), ``o_proj``
and ``down_proj`` row-parallel (one all-reduce each), the embedding and the LM head
vocabulary-parallel (an all-reduce of the lookups, an all-gather of the logits). Attention
modules see their rank's head counts (``tp_heads``: KV heads replicated when there are fewer
than ranks), so the attention backend and the KV pool (``compile.backend.kv_layout(model)``) are
sized per rank. Norms, RoPE tables and everything else stay replicated.

The model is loaded first through the zoo's usual path (``from_hf`` / ``copy_from_hf``, full
size), then sharded in place: the full tensors are freed as each module is replaced.
"""

from __future__ import annotations

from torch import nn

from compile.backend.parallel_state import ParallelGroup, tp_heads
from compile.models.decoder import DecoderForCausalLM
from compile.models.llama import LlamaAttention, LlamaMLP
from compile.models.parallel import (ColumnParallelLinear, ParallelLogitsProcessor,
                                     RowParallelLinear, VocabParallelEmbedding, divide,
                                     vocab_shard)


def tensor_parallel(model: DecoderForCausalLM, tp: ParallelGroup) -> DecoderForCausalLM:
    """Shard ``model`` in place over ``tp`` and return it (unchanged when ``tp.size == 1``).

    Args:
        model: a zoo ``DecoderForCausalLM`` whose layers have ``LlamaAttention`` and
            ``LlamaMLP`` (Llama, Qwen3, Gemma 2/3, SmolLM, GPT-OSS without experts), with
            every rank's weights equal (one checkpoint, or one seed).
        tp: this rank's tensor-parallel group.
    Returns:
        ``model``, whose forward gives the same float32 logits ``[n, vocab_size]`` on every
        rank as the unsharded model (up to the reduction order of the all-reduces).
    Raises:
        ValueError: heads, intermediate size not divisible by ``tp.size`` (naming them).
        NotImplementedError: a layer kind without a tensor-parallel layout (MLA, experts,
            gated-delta-net linear attention).
    """
    if tp.size == 1:
        return model
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)  # a linear-attention layer has none
        mlp = getattr(layer, getattr(layer, "mlp_name", "mlp"), None)
        if not isinstance(attn, LlamaAttention) or not isinstance(mlp, LlamaMLP):
            raise NotImplementedError(f"tensor_parallel: layer {type(layer).__name__} with "
                                      f"{type(attn).__name__} / {type(mlp).__name__} has no "
                                      "tensor-parallel layout; expected LlamaAttention and "
                                      "LlamaMLP (MLA, mixture-of-experts and linear-attention "
                                      "layers are not supported).")
        _shard_attention(attn, tp)
        _shard_mlp(mlp, tp)
    cfg, inner = model.config, model.model
    inner.embed_tokens = VocabParallelEmbedding.from_full(inner.embed_tokens.weight.data, tp)
    if model.lm_head is not None:
        model.lm_head = ColumnParallelLinear(vocab_shard(model.lm_head.weight.data, tp), None)
    model.logits_processor = ParallelLogitsProcessor(cfg.vocab_size, tp)
    return model


def _shard_attention(attn: LlamaAttention, tp: ParallelGroup) -> None:
    """q/k/v and o_proj of this rank's heads; sinks of its query heads."""
    hq, hkv, d = attn.hq, attn.hkv, attn.d
    hq_r, hkv_r, kv0 = tp_heads(hq, hkv, tp)
    q0 = tp.rank * hq_r
    attn.qkv_proj = ColumnParallelLinear.from_full(
        attn.qkv_proj, sizes=[hq * d, hkv * d, hkv * d], starts=[q0 * d, kv0 * d, kv0 * d],
        counts=[hq_r * d, hkv_r * d, hkv_r * d])
    attn.o_proj = RowParallelLinear.from_full(attn.o_proj, q0 * d, hq_r * d, tp)
    if attn.sinks is not None:
        attn.sinks = nn.Parameter(attn.sinks.data[q0:q0 + hq_r].clone(), requires_grad=False)
    attn.hq, attn.hkv = hq_r, hkv_r
    layer = attn.attn
    layer.tp_q_head_num, layer.tp_k_head_num, layer.tp_v_head_num = hq_r, hkv_r, hkv_r


def _shard_mlp(mlp: LlamaMLP, tp: ParallelGroup) -> None:
    """gate/up columns and down_proj rows of this rank's slice of the intermediate size."""
    inter = mlp.down_proj.in_features
    i_r = divide(inter, tp.size, "intermediate_size")
    i0 = tp.rank * i_r
    mlp.gate_up_proj = ColumnParallelLinear.from_full(
        mlp.gate_up_proj, sizes=[inter, inter], starts=[i0, i0], counts=[i_r, i_r])
    mlp.down_proj = RowParallelLinear.from_full(mlp.down_proj, i0, i_r, tp)


__all__ = ["tensor_parallel"]
