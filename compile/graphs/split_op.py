"""The opaque split op ``xpu_ops::unified_attention_with_output`` for piecewise graphs.

``torch.ops.xpu_ops.unified_attention_with_output(q, k, v, output, layer_id, sinks=None,
q_rope=None, k_rope=None, save_kv_cache=True) -> ()`` attends ``q`` over the paged cache of layer
``layer_id`` after writing ``k``/``v`` into it, and writes the result into ``output`` in place.
Its arguments are tensors, an int and a bool only: the layer and the ``ForwardBatch`` (with the
backend's metadata) come from the forward context (``compile/graphs/forward_context.py``).
``compile/graphs/piecewise.py`` splits the FX graph at this op, so the pieces between attention calls see
only fixed-shape tensor traffic and can be captured per token-count bucket, while attention runs
eagerly with whatever metadata the step has.

Every attention layer kind of the zoo goes through it: plain, sliding-window and soft-capped
layers (facts of the layer), attention sinks (``sinks``, GPT-OSS), absorbed MLA (``k`` the latent,
``q_rope``/``k_rope`` the rotary parts, ``v`` None; DeepSeek-V2), sparse MLA (the same plus
``index_q``/``index_k``/``index_weights``, the DSA indexer's inputs; DeepSeek-V3.2) and
cross-layer KV sharing
(``k = v = None``; the layer reads ``kv_sharing_target_layer_id``'s cache).

Rows past ``forward_context.num_tokens`` are padding: they are not attended and their output rows
are zeroed, so the padded tail of a captured piece always reads zeros.

The op is lean, as vLLM's ``unified_attention_with_output``: it slices off the padding and calls
the layer's own attention (``PagedAttention.attend``) with ``output`` as the backend's output
buffer (``ForwardBatch._attn_output``, sglang's name); nothing is cached or replayed. The layer
does not know the op: ``enable_split_op(model)`` installs ``unified_attention`` as each
``PagedAttention``'s ``split_op``, whose forward then returns ``layer.split_op(layer, q, k, v,
sinks=..., q_rope=..., k_rope=...)``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from xpu_ops._checks import XpuOpsValueError as _ArgError  # a ValueError, also RuntimeError
from xpu_ops._registration import define_op
from xpu_ops.ops.common import SINK_DTYPES

from compile.graphs.forward_context import get_forward_context
from compile.graphs.linear_split_op import is_linear_layer, unified_linear_attention

OP_NAME = "xpu_ops::unified_attention_with_output"
# Backend extras the split op carries (its optional tensor arguments).
SPLIT_OP_KWARGS = ("sinks", "q_rope", "k_rope", "index_q", "index_k", "index_weights")
# DSA (sparse MLA) indexer inputs, appended after save_kv_cache in the schema
_INDEX_KWARGS = ("index_q", "index_k", "index_weights")
_FN = "unified_attention_with_output"


def _check_rows(name: str, x: Optional[Tensor], tokens) -> None:
    if x is not None and (x.dim() < 2 or x.shape[0] != tokens):
        raise _ArgError(f"{_FN}: {name} has shape {tuple(x.shape)}; expected [tokens, ...] with "
                        f"tokens = q.shape[0] = {tokens}. Pass this step's rows of {name}.")


def _check(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], output: Tensor,
           sinks: Optional[Tensor], q_rope: Optional[Tensor], k_rope: Optional[Tensor],
           index: tuple = ()) -> None:
    """Shape checks that need no values (run in the fake too; eagerly once per layer and step,
    so each tensor attribute is read once)."""
    tokens = q.shape[0]
    if output.dim() != 2 or output.shape[0] != tokens:
        raise _ArgError(f"{_FN}: output has shape {tuple(output.shape)}; expected [tokens, "
                        f"Hq * Dv] with tokens = q.shape[0] = {tokens}. Allocate it with "
                        "unified_attention(layer, q, k, v).")
    if output.dtype != q.dtype or output.device != q.device:
        raise _ArgError(f"{_FN}: output is {output.dtype} on {output.device}; expected q's "
                        f"{q.dtype} on {q.device}.")
    if k_rope is not None and k is None:
        raise _ArgError(f"{_FN}: k_rope is given but k is None; expected the MLA latent k "
                        "[tokens, 1, R] with k_rope [tokens, 1, r], got k=None.")
    if k_rope is None and (k is None) != (v is None):
        raise _ArgError(f"{_FN}: k and v must both be tensors or both be None (MLA passes "
                        f"k_rope instead of v); got k={type(k).__name__}, "
                        f"v={type(v).__name__}.")
    _check_rows("k", k, tokens)
    _check_rows("v", v, tokens)
    if q_rope is not None or k_rope is not None:  # MLA
        _check_rows("q_rope", q_rope, tokens)
        _check_rows("k_rope", k_rope, tokens)
    for name, x in zip(_INDEX_KWARGS, index):  # DSA indexer
        _check_rows(name, x, tokens)
    if sinks is not None and (sinks.dim() != 1 or sinks.dtype not in SINK_DTYPES):
        raise _ArgError(f"{_FN}: sinks is {sinks.dtype} of shape {tuple(sinks.shape)}; "
                        "expected [Hq] in a float dtype (one sink logit per query head).")


def _rows(x: Optional[Tensor], n: int) -> Optional[Tensor]:
    """The first ``n`` rows of ``x`` (None stays None)."""
    return None if x is None else x[:n]


@define_op(OP_NAME, mutates_args=("output",),
           schema="(Tensor q, Tensor? k, Tensor? v, Tensor(a!) output, int layer_id, "
                  "Tensor? sinks=None, Tensor? q_rope=None, Tensor? k_rope=None, "
                  "bool save_kv_cache=True, Tensor? index_q=None, Tensor? index_k=None, "
                  "Tensor? index_weights=None) -> ()")
def unified_attention_with_output(q: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                                  output: Tensor, layer_id: int, sinks: Optional[Tensor] = None,
                                  q_rope: Optional[Tensor] = None,
                                  k_rope: Optional[Tensor] = None,
                                  save_kv_cache: bool = True, index_q: Optional[Tensor] = None,
                                  index_k: Optional[Tensor] = None,
                                  index_weights: Optional[Tensor] = None) -> None:
    """Attention of layer ``layer_id`` over the forward context's batch, into ``output``.

    Args:
        q: [T, Hq * D] or [T, Hq, D]; rows past ``num_tokens`` are padding. MLA: ``q_latent``
            [T, Hq * R] (with ``q_rope``).
        k: [T, Hkv * D] or [T, Hkv, D] new keys (written into the cache, then attended); MLA:
            the latent [T, 1, R]; None: nothing to write (KV sharing, or already cached).
        v: [T, Hkv * Dv] or [T, Hkv, Dv]; None with ``k`` None, and for MLA.
        output: [T, Hq * Dv], q's dtype; rows ``[:num_tokens]`` get the attention result, the
            rest zeros.
        layer_id: key into ``forward_context.layers``.
        sinks: [Hq] sink logits (GPT-OSS) in a float dtype, or None.
        q_rope: MLA [T, Hq, r] rotary part of the query, or None.
        k_rope: MLA [T, 1, r] rotary key, or None.
        save_kv_cache: False attends without writing ``k``/``v``.
        index_q, index_k, index_weights: DSA (sparse MLA) indexer inputs ``[T, Hi, Di]``,
            ``[T, Di]``, ``[T, Hi]`` float32 (``compile.backend.dsa_backend``), or None.
    Raises:
        RuntimeError: no forward context is set.
        ValueError: ``output`` has the wrong shape, dtype or device; ``k``/``v``/``q_rope``/
            ``k_rope`` rows differ from ``q``'s; ``k``/``v`` not paired; ``sinks`` not [Hq]
            float32.
        NotImplementedError: the backend returned ``(out, lse)`` (MLA's MHA prefill path).
    """
    index = (index_q, index_k, index_weights)
    _check(q, k, v, output, sinks, q_rope, k_rope, index)
    attend_into(q, k, v, output, layer_id, sinks, q_rope, k_rope, save_kv_cache, *index)


def attend_into(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], output: Tensor,
                layer_id: int, sinks: Optional[Tensor] = None, q_rope: Optional[Tensor] = None,
                k_rope: Optional[Tensor] = None, save_kv_cache: bool = True,
                index_q: Optional[Tensor] = None, index_k: Optional[Tensor] = None,
                index_weights: Optional[Tensor] = None) -> None:
    """The split op's body without its shape checks: what the attention submodules of a split
    graph call (``graph_split.call_split_op_kernel``). Their fake ran the checks on the traced
    shapes, and Dynamo's guards hold every call to those shapes, so they would only repeat.

    Arguments, effect and errors as ``unified_attention_with_output`` (ValueError excepted).
    """
    ctx = get_forward_context()
    n, batch = ctx.num_tokens, ctx.forward_batch
    layer = ctx.layers[layer_id]
    padded = n != q.shape[0]
    out = output
    if padded:
        q, k, v, out = q[:n], _rows(k, n), _rows(v, n), output[:n]
        q_rope, k_rope = _rows(q_rope, n), _rows(k_rope, n)
    extras = {}
    if sinks is not None or q_rope is not None or k_rope is not None:
        extras = {name: x for name, x in (("sinks", sinks), ("q_rope", q_rope),
                                          ("k_rope", k_rope)) if x is not None}
    if index_q is not None:  # DSA
        extras.update(index_q=index_q[:n], index_k=_rows(index_k, n),
                      index_weights=_rows(index_weights, n))
    # The backend writes straight into the op's output (ForwardBatch._attn_output).
    previous, batch._attn_output = batch._attn_output, out
    try:
        result = layer.attend(q, k, v, batch, save_kv_cache, **extras)
    finally:
        batch._attn_output = previous
    if not isinstance(result, Tensor):
        raise NotImplementedError(f"{_FN}: layer {layer_id}'s backend returned "
                                  f"{type(result).__name__} (out, lse), which the split op cannot "
                                  "return; MLA's MHA prefill path is not supported in piecewise "
                                  "mode. Use --mode compile for it.")
    if result.data_ptr() != out.data_ptr():
        out.copy_(result.reshape(out.shape))
    if padded:
        output[n:].zero_()


@unified_attention_with_output.register_fake
def _(q, k, v, output, layer_id, sinks=None, q_rope=None, k_rope=None, save_kv_cache=True,
      index_q=None, index_k=None, index_weights=None):
    _check(q, k, v, output, sinks, q_rope, k_rope, (index_q, index_k, index_weights))


def unified_attention(layer: nn.Module, q: Tensor, k: Optional[Tensor], v: Optional[Tensor], *,
                      sinks: Optional[Tensor] = None, q_rope: Optional[Tensor] = None,
                      k_rope: Optional[Tensor] = None, save_kv_cache: bool = True,
                      index_q: Optional[Tensor] = None, index_k: Optional[Tensor] = None,
                      index_weights: Optional[Tensor] = None, **unknown) -> Tensor:
    """What ``PagedAttention.forward`` returns in piecewise mode: a fresh output, filled by the op.

    Args:
        layer: the PagedAttention (its ``layer_id``, ``tp_q_head_num``, ``v_head_dim``).
        q, k, v, sinks, q_rope, k_rope, save_kv_cache, index_q, index_k, index_weights: as
            ``unified_attention_with_output``.
        **unknown: any other keyword is refused (the op cannot carry it).
    Returns:
        [T, Hq * Dv] in q's dtype.
    Raises:
        TypeError: a keyword other than ``SPLIT_OP_KWARGS``.
    """
    if unknown:
        raise TypeError(f"PagedAttention.forward: piecewise mode got keyword(s) "
                        f"{sorted(unknown)} on layer {layer.layer_id}; expected only "
                        f"{list(SPLIT_OP_KWARGS)} (what the split op carries). Run this model "
                        "with --mode compile.")
    output = torch.empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim), dtype=q.dtype,
                         device=q.device)
    torch.ops.xpu_ops.unified_attention_with_output(
        q, k, v, output, layer.layer_id, sinks=sinks, q_rope=q_rope, k_rope=k_rope,
        save_kv_cache=save_kv_cache, index_q=index_q, index_k=index_k,
        index_weights=index_weights)
    return output


def layers_by_id(model: nn.Module) -> dict[int, Any]:
    """``layer_id -> module`` of every PagedAttention-like module (has ``layer_id`` and
    ``tp_q_head_num``) and every linear-attention layer (``is_linear_layer``) in ``model``
    (their layer ids are global, so the two kinds never share one).

    Raises:
        ValueError: two modules claim the same ``layer_id``.
    """
    layers: dict[int, Any] = {}
    for name, module in model.named_modules():
        if hasattr(module, "layer_id") and (hasattr(module, "tp_q_head_num")
                                            or is_linear_layer(module)):
            if module.layer_id in layers and layers[module.layer_id] is not module:
                raise ValueError(f"layers_by_id: layer_id {module.layer_id} is used twice "
                                 f"(again at {name!r}); expected unique ids per attention layer.")
            layers[module.layer_id] = module
    return layers


def enable_split_op(model: nn.Module, enabled: bool = True) -> dict[int, Any]:
    """Install ``unified_attention`` as every attention layer's ``split_op`` and
    ``unified_linear_attention`` as every linear-attention layer's (``enabled`` False: remove
    them, the layers attend directly again).

    Returns:
        ``layer_id -> layer``, what ``set_forward_context`` needs.
    """
    layers = layers_by_id(model)
    for layer in layers.values():
        split = unified_linear_attention if is_linear_layer(layer) else unified_attention
        layer.split_op = split if enabled else None
    return layers


__all__ = ["OP_NAME", "SPLIT_OP_KWARGS", "unified_attention_with_output", "attend_into",
           "unified_attention",
           "layers_by_id", "enable_split_op"]
