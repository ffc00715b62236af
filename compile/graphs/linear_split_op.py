"""The opaque split op of linear-attention layers,
``xpu_ops::unified_linear_attention_with_output``.

``torch.ops.xpu_ops.unified_linear_attention_with_output(mixed_qkv, a, b, output, layer_id) ->
()`` runs linear-attention layer ``layer_id`` (a ``compile.backend.LinearAttention``: causal
conv, gating and delta rule over the requests' state slots) and writes its core output into
``output`` in place. Like the paged layers' split op (``compile/graphs/split_op.py``), its
arguments are tensors and an int: the layer and the ``ForwardBatch`` come from the forward
context, and ``compile/graphs/piecewise.py`` cuts the graph at it, so a linear layer, whose
state slots and request boundaries change every step, runs eagerly between captured pieces
(the way sglang and vLLM make mamba layers split points).

Rows past ``forward_context.num_tokens`` are padding: not run, output rows zeroed.
``enable_split_op`` (``split_op.py``) installs ``unified_linear_attention`` as each linear
layer's ``split_op``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from xpu_ops._registration import define_op

from compile.graphs.forward_context import get_forward_context

OP_NAME = "xpu_ops::unified_linear_attention_with_output"
_FN = "unified_linear_attention_with_output"


def _check(mixed_qkv: Tensor, a: Tensor, b: Tensor, output: Tensor) -> None:
    """Shape checks that need no values (run in the fake too)."""
    tokens = mixed_qkv.shape[0]
    for name, x in (("a", a), ("b", b), ("output", output)):
        if x.dim() != 2 or x.shape[0] != tokens:
            raise ValueError(f"{_FN}: {name} has shape {tuple(x.shape)}; expected [tokens, ...] "
                             f"with tokens = mixed_qkv.shape[0] = {tokens}. Pass this step's "
                             f"rows of {name}.")
    if output.dtype != mixed_qkv.dtype or output.device != mixed_qkv.device:
        raise ValueError(f"{_FN}: output is {output.dtype} on {output.device}; expected "
                         f"mixed_qkv's {mixed_qkv.dtype} on {mixed_qkv.device}.")


@define_op(OP_NAME, mutates_args=("output",),
           schema="(Tensor mixed_qkv, Tensor a, Tensor b, Tensor(a!) output, int layer_id) -> ()")
def unified_linear_attention_with_output(mixed_qkv: Tensor, a: Tensor, b: Tensor, output: Tensor,
                                         layer_id: int) -> None:
    """Linear-attention layer ``layer_id`` over the forward context's batch, into ``output``.

    Args:
        mixed_qkv: [T, q_dim + k_dim + v_dim] before the conv; rows past ``num_tokens`` are
            padding.
        a, b: [T, Hv] the gating inputs.
        output: [T, Hv * V], mixed_qkv's dtype; rows ``[:num_tokens]`` get the core output,
            the rest zeros.
        layer_id: key into ``forward_context.layers``.
    Raises:
        RuntimeError: no forward context is set.
        ValueError: ``a``, ``b`` or ``output`` rows differ from ``mixed_qkv``'s, or ``output``
            has another dtype or device.
    """
    _check(mixed_qkv, a, b, output)
    linear_attend_into(mixed_qkv, a, b, output, layer_id)


def linear_attend_into(mixed_qkv: Tensor, a: Tensor, b: Tensor, output: Tensor,
                       layer_id: int) -> None:
    """The split op's body without its shape checks (what split graphs call, as
    ``split_op.attend_into``); arguments and effect as ``unified_linear_attention_with_output``.
    """
    ctx = get_forward_context()
    n, layer = ctx.num_tokens, ctx.layers[layer_id]
    padded = n != mixed_qkv.shape[0]
    if padded:
        mixed_qkv, a, b = mixed_qkv[:n], a[:n], b[:n]
    result = layer.attend(mixed_qkv, a, b, ctx.forward_batch)            # [n, Hv, V]
    output[:n].copy_(result.reshape(n, output.shape[1]))
    if padded:
        output[n:].zero_()


@unified_linear_attention_with_output.register_fake
def _(mixed_qkv, a, b, output, layer_id):
    _check(mixed_qkv, a, b, output)


def unified_linear_attention(layer: nn.Module, mixed_qkv: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """What ``LinearAttention.forward`` returns in piecewise mode: a fresh ``[T, Hv, V]``,
    filled by the op."""
    t = mixed_qkv.shape[0]
    output = torch.empty((t, layer.num_v_heads * layer.head_v_dim), dtype=mixed_qkv.dtype,
                         device=mixed_qkv.device)
    torch.ops.xpu_ops.unified_linear_attention_with_output(mixed_qkv, a, b, output,
                                                           layer.layer_id)
    return output.view(t, layer.num_v_heads, layer.head_v_dim)


def is_linear_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a linear-attention layer (duck-typed: ``layer_id``,
    ``num_v_heads`` and ``head_v_dim``, as ``compile.backend.LinearAttention`` and sglang's
    ``RadixLinearAttention``)."""
    return all(hasattr(module, n) for n in ("layer_id", "num_v_heads", "head_v_dim"))


__all__ = ["OP_NAME", "unified_linear_attention_with_output", "linear_attend_into",
           "unified_linear_attention", "is_linear_layer"]
