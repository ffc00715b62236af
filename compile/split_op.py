"""The opaque split op ``xpu_ops::unified_attention_with_output`` for piecewise graphs.

``torch.ops.xpu_ops.unified_attention_with_output(q, k, v, output, layer_id) -> ()`` attends
``q`` over the paged cache of layer ``layer_id`` after writing ``k``/``v`` into it, and writes the
result into ``output`` in place. Its arguments are tensors and an int only: the layer and the
``ForwardBatch`` (with the backend's metadata) come from the forward context
(``compile/forward_context.py``). ``compile/piecewise.py`` splits the FX graph at this op, so
the pieces between attention calls see only fixed-shape tensor traffic and can be captured per
token-count bucket, while attention runs eagerly with whatever metadata the step has.

Rows past ``forward_context.num_tokens`` are padding: they are not attended and their output rows
are zeroed, so the padded tail of a captured piece always reads zeros.

A ``PagedAttention`` layer uses the op when ``layer.use_split_op`` is True
(``enable_split_op(model)`` sets it); its forward then returns ``unified_attention(self, q, k, v)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from xpu_ops._registration import define_op

from .forward_context import get_forward_context

OP_NAME = "xpu_ops::unified_attention_with_output"


def _check(q: Tensor, output: Tensor) -> None:
    """Shape checks that need no values (run in the fake too)."""
    if output.dim() != 2 or output.shape[0] != q.shape[0]:
        raise ValueError(f"unified_attention_with_output: output has shape {tuple(output.shape)}; "
                         f"expected [tokens, Hq * Dv] with tokens = q.shape[0] = {q.shape[0]}. "
                         "Allocate it with unified_attention(layer, q, k, v).")
    if output.dtype != q.dtype or output.device != q.device:
        raise ValueError(f"unified_attention_with_output: output is {output.dtype} on "
                         f"{output.device}; expected q's {q.dtype} on {q.device}.")


@define_op(OP_NAME, mutates_args=("output",),
           schema="(Tensor q, Tensor k, Tensor v, Tensor(a!) output, int layer_id) "
                  "-> ()")
def unified_attention_with_output(q: Tensor, k: Tensor, v: Tensor, output: Tensor,
                                  layer_id: int) -> None:
    """Attention of layer ``layer_id`` over the forward context's batch, into ``output``.

    Args:
        q: [T, Hq * D] or [T, Hq, D]; rows past ``num_tokens`` are padding.
        k: [T, Hkv * D] or [T, Hkv, D] new keys (written into the cache, then attended).
        v: [T, Hkv * Dv] or [T, Hkv, Dv].
        output: [T, Hq * Dv], q's dtype; rows ``[:num_tokens]`` get the attention result, the
            rest zeros.
        layer_id: key into ``forward_context.layers``.
    Raises:
        RuntimeError: no forward context is set.
        ValueError: ``output`` has the wrong shape, dtype or device.
    """
    _check(q, output)
    ctx = get_forward_context()
    layer = ctx.layers[layer_id]
    n = ctx.num_tokens
    batch = ctx.forward_batch
    k = k[:n].reshape(n, layer.tp_k_head_num, layer.qk_head_dim)
    v = v[:n].reshape(n, layer.tp_v_head_num, layer.v_head_dim)
    result = batch.attn_backend.forward(q[:n], k, v, layer, batch, True)
    out = output[:n]
    if result.data_ptr() != out.data_ptr():
        out.copy_(result.reshape(out.shape))
    output[n:].zero_()


@unified_attention_with_output.register_fake
def _(q, k, v, output, layer_id):
    _check(q, output)


def unified_attention(layer: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """What ``PagedAttention.forward`` returns in piecewise mode: a fresh output, filled by the op.

    Args:
        layer: the PagedAttention (its ``layer_id``, ``tp_q_head_num``, ``v_head_dim``).
        q, k, v: as ``unified_attention_with_output``.
    Returns:
        [T, Hq * Dv] in q's dtype.
    """
    output = torch.empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim), dtype=q.dtype,
                         device=q.device)
    torch.ops.xpu_ops.unified_attention_with_output(q, k, v, output, layer.layer_id)
    return output


def attention_layers(model: nn.Module) -> dict[int, Any]:
    """``layer_id -> module`` of every PagedAttention-like module (has ``layer_id`` and
    ``tp_q_head_num``) in ``model``.

    Raises:
        ValueError: two modules claim the same ``layer_id``.
    """
    layers: dict[int, Any] = {}
    for name, module in model.named_modules():
        if hasattr(module, "layer_id") and hasattr(module, "tp_q_head_num"):
            if module.layer_id in layers and layers[module.layer_id] is not module:
                raise ValueError(f"attention_layers: layer_id {module.layer_id} is used twice "
                                 f"(again at {name!r}); expected unique ids per attention layer.")
            layers[module.layer_id] = module
    return layers


def enable_split_op(model: nn.Module, enabled: bool = True) -> dict[int, Any]:
    """Switch every attention layer of ``model`` to (or back from) the split op.

    Returns:
        ``layer_id -> layer``, what ``set_forward_context`` needs.
    """
    layers = attention_layers(model)
    for layer in layers.values():
        layer.use_split_op = enabled
    return layers


__all__ = ["OP_NAME", "unified_attention_with_output", "unified_attention", "attention_layers",
           "enable_split_op"]
