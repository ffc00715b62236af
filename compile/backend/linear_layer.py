"""``LinearAttention``: the linear-attention module a model calls (sglang's
``RadixLinearAttention`` role), and ``linear_layout(model)``, the facts that size the state pool.

A gated-delta-net layer projects its input into ``mixed_qkv`` (q, k and v side by side, before
the causal conv), ``a`` (the decay's input) and ``b`` (the write strength's input); the layer's
conv weight, ``A_log`` and ``dt_bias`` are parameters of the model's module, which this module
only references. The batch's attention backend (``HybridLinearAttnBackend``) runs the conv,
the gating and the delta rule over the request's state slot and returns the core output.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor, nn

from compile.batch.state_pool import LinearStateLayout


class LinearAttention(nn.Module):
    """One gated-delta-net layer over the per-request state pool (tensor-parallel sizes already
    divided).

    Args:
        layer_id: global layer index (selects the layer's state buffers).
        num_k_heads: Hk (queries and keys). num_v_heads: Hv (a multiple of Hk).
        head_k_dim: K. head_v_dim: V.
        conv_weight: the model's conv parameter, ``[conv_dim, 1, width]`` or ``[conv_dim,
            width]`` with ``conv_dim = 2 * Hk * K + Hv * V``. conv_bias: ``[conv_dim]`` or None.
        A_log: [Hv] float, the log of the decay rate. dt_bias: [Hv], the time-step bias.
        activation: of the conv ("silu").
    Attributes:
        layer_id, num_k_heads, num_v_heads, head_k_dim, head_v_dim, activation: as above
            (``num_q_heads``/``head_q_dim`` equal the key ones, sglang's names).
        q_dim, k_dim, v_dim: features of q, k and v in ``mixed_qkv``.
        scaling: the delta rule's query scale, ``K ** -0.5``.
    Raises:
        ValueError: Hv not a multiple of Hk, or a conv weight of the wrong shape.
    """

    def __init__(self, layer_id: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_weight: nn.Parameter, A_log: nn.Parameter,
                 dt_bias: nn.Parameter, conv_bias: Optional[nn.Parameter] = None,
                 activation: str = "silu"):
        super().__init__()
        if num_k_heads <= 0 or num_v_heads % num_k_heads:
            raise ValueError(f"LinearAttention: num_v_heads {num_v_heads} is not a multiple of "
                             f"num_k_heads; expected num_v_heads % num_k_heads == 0, got "
                             f"num_k_heads={num_k_heads}.")
        self.layer_id = layer_id
        self.num_q_heads = self.num_k_heads = num_k_heads
        self.num_v_heads = num_v_heads
        self.head_q_dim = self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.q_dim = self.k_dim = num_k_heads * head_k_dim
        self.v_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.k_dim + self.v_dim
        if conv_weight.shape[0] != self.conv_dim or conv_weight.dim() not in (2, 3):
            raise ValueError(f"LinearAttention: conv_weight has shape {tuple(conv_weight.shape)}; "
                             f"expected [conv_dim, 1, width] or [conv_dim, width] with conv_dim "
                             f"= 2 * Hk * K + Hv * V = {self.conv_dim}.")
        self.conv_width = conv_weight.shape[-1]
        self.activation = activation
        self.scaling = float(head_k_dim) ** -0.5
        # references to the model's parameters (not registered: they belong to the model)
        self.__dict__["_params"] = (conv_weight, conv_bias, A_log, dt_bias)
        # Piecewise mode: the graphs wing installs its split op here (enable_split_op).
        self.split_op: Optional[Callable] = None

    @property
    def conv_weights(self) -> Tensor:
        """The conv weight viewed ``[conv_dim, width]`` (sglang's name)."""
        w = self._params[0]
        return w.view(w.shape[0], w.shape[-1])

    @property
    def bias(self) -> Optional[Tensor]:
        """The conv bias ``[conv_dim]`` or None."""
        return self._params[1]

    @property
    def A_log(self) -> Tensor:  # noqa: N802 (the checkpoint's name)
        """[Hv], log of the decay rate."""
        return self._params[2]

    @property
    def dt_bias(self) -> Tensor:
        """[Hv], the time-step bias."""
        return self._params[3]

    def forward(self, mixed_qkv: Tensor, a: Tensor, b: Tensor, forward_batch) -> Tensor:
        """The layer's core output for this step's tokens, updating their requests' states.

        Args:
            mixed_qkv: [T, q_dim + k_dim + v_dim], before the conv.
            a: [T, Hv], the decay's input. b: [T, Hv], the write strength's input.
            forward_batch: ForwardBatch whose ``attn_backend`` runs the layer.
        Returns:
            [T, Hv, V] in mixed_qkv's dtype.
        """
        if self.split_op is not None:
            return self.split_op(self, mixed_qkv, a, b)
        return self.attend(mixed_qkv, a, b, forward_batch)

    def attend(self, mixed_qkv: Tensor, a: Tensor, b: Tensor, forward_batch) -> Tensor:
        """The layer itself, as ``forward`` without the split op (what the split op calls)."""
        return forward_batch.attn_backend.forward_linear(self, mixed_qkv, a, b, forward_batch)

    def extra_repr(self) -> str:
        return (f"layer_id={self.layer_id}, Hk={self.num_k_heads}, Hv={self.num_v_heads}, "
                f"K={self.head_k_dim}, V={self.head_v_dim}, width={self.conv_width}")


def linear_layers(model: nn.Module) -> list[LinearAttention]:
    """Every ``LinearAttention`` module of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, LinearAttention)]


def linear_layout(model: nn.Module) -> Optional[LinearStateLayout]:
    """The ``LinearStateLayout`` of ``model``'s ``LinearAttention`` layers, or None without any.

    Raises:
        ValueError: two layers disagree on the state shapes (one pool holds one shape).
    """
    layers = linear_layers(model)
    if not layers:
        return None
    first = layers[0]
    shape = (first.conv_dim, first.conv_width, first.num_v_heads, first.head_k_dim,
             first.head_v_dim)
    for layer in layers:
        other = (layer.conv_dim, layer.conv_width, layer.num_v_heads, layer.head_k_dim,
                 layer.head_v_dim)
        if other != shape:
            raise ValueError(f"linear_layout: layer {layer.layer_id} has (conv_dim, width, Hv, "
                             f"K, V) {other}; expected the same as layer {first.layer_id}, got "
                             f"{other} vs {shape}. One pool holds one shape.")
    return LinearStateLayout(tuple(sorted(m.layer_id for m in layers)), *shape)


__all__ = ["LinearAttention", "linear_layers", "linear_layout"]
