"""``PagedAttention``: the attention module a model calls (sglang's ``RadixAttention`` role).

It holds the per-layer attention facts (heads, head dims, scale, window, softcap, fp8 scales) and
forwards to the batch's attention backend, which writes the new K/V into the pool and attends.
``kv_layout(model)`` gathers those facts into the ``KVLayout`` that sizes the model's KV pools.
"""

from __future__ import annotations

import enum
from typing import Callable, Optional, Union

import torch
from torch import Tensor, nn

from compile.backend.linear_layer import linear_layers
from compile.batch import KVLayout


class AttentionType(enum.Enum):
    """A self-attention layer's mask kind (sglang's ``AttentionType``, string-valued).

    DECODER: causal. DECODER_BIDIRECTIONAL (a decoder layer without the causal mask, e.g.
    DFlash's draft layers) and ENCODER_ONLY: every query sees all keys of its request.
    """

    DECODER = "decoder"
    DECODER_BIDIRECTIONAL = "decoder_bidirectional"
    ENCODER_ONLY = "encoder_only"


def is_causal(layer) -> bool:
    """Whether ``layer`` (a ``PagedAttention`` or sglang's ``RadixAttention``) masks causally:
    not for cross attention, nor for the non-causal ``attn_type`` values."""
    kind = getattr(layer, "attn_type", AttentionType.DECODER)
    if layer.is_cross_attention:
        return False
    # identity first (an enum's .value is a descriptor call); sglang's own enum by its value
    return kind is AttentionType.DECODER or kind.value == AttentionType.DECODER.value


def _attention_type(value) -> AttentionType:
    try:
        return AttentionType(value)
    except ValueError:
        raise ValueError(f"PagedAttention: attn_type is not an AttentionType; expected one of "
                         f"{[t.value for t in AttentionType]}, got {value!r}. Pass "
                         f"compile.backend.AttentionType.<NAME>.") from None


class PagedAttention(nn.Module):
    """One attention layer over the paged KV cache (tensor-parallel sizes already divided).

    Args:
        num_heads: Hq. head_dim: D (query/key head dim). scaling: softmax scale (float).
        num_kv_heads: Hkv. layer_id: global layer index (selects the layer's KV buffers).
        logit_cap: softcap on the scores (0 disables it).
        v_head_dim: Dv (-1: same as D).
        sliding_window_size: left window bound in tokens, as sglang's ``RadixAttention`` takes
            it: ``W - 1`` for a Hugging Face ``sliding_window = W`` (-1 or None: full
            attention); the backend attends ``window_size = (sliding_window_size, 0)``.
        is_cross_attention: encoder-decoder cross attention (keys are the encoder tokens).
        use_irope: chunked local attention (Llama 4 iRoPE layers, ``attention_chunk_size``).
        kv_sharing_target_layer_id: read the KV cache of that layer instead (cross-layer KV
            sharing; such layers are called with ``k = v = None``).
        attn_type: ``AttentionType`` (or its string value): DECODER (causal, the default) or a
            non-causal kind.
        prefix, quant_config: accepted for sglang compatibility.
    Attributes:
        tp_q_head_num, tp_k_head_num, tp_v_head_num, qk_head_dim, head_dim, v_head_dim,
        scaling, layer_id, logit_cap, sliding_window_size, is_cross_attention, use_irope:
            attn_type: as above (sglang's names).
        causal: False for cross attention and the non-causal ``attn_type`` values.
        k_scale, v_scale: None or float32 one-element tensors, fp8 KV-cache scales (stored
            value = k / k_scale); ``k_scale_float``/``v_scale_float`` the same as floats.
    Raises:
        ValueError: ``num_heads`` not a multiple of ``num_kv_heads``, or an unknown
            ``attn_type``.
    """

    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int,
                 layer_id: int, logit_cap: float = 0.0, v_head_dim: int = -1,
                 sliding_window_size: int = -1, is_cross_attention: bool = False,
                 use_irope: bool = False, kv_sharing_target_layer_id: Optional[int] = None,
                 prefix: str = "", quant_config=None,
                 attn_type: Union[AttentionType, str] = AttentionType.DECODER, **kwargs):
        super().__init__()
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"PagedAttention: num_heads {num_heads} is not a multiple of "
                             f"num_kv_heads; expected num_heads % num_kv_heads == 0, got "
                             f"num_kv_heads={num_kv_heads}.")
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = self.qk_head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim == -1 else v_head_dim
        self.scaling = float(scaling)
        self.layer_id = layer_id
        self.logit_cap = float(logit_cap)
        self.sliding_window_size = -1 if sliding_window_size is None else int(sliding_window_size)
        self.is_cross_attention = is_cross_attention
        self.use_irope = use_irope
        self.kv_sharing_target_layer_id = kv_sharing_target_layer_id
        self.attn_type = _attention_type(attn_type)
        # Piecewise mode: the graphs wing installs its split op here (enable_split_op).
        self.split_op: Optional[Callable] = None
        self.register_buffer("k_scale", None, persistent=False)
        self.register_buffer("v_scale", None, persistent=False)
        self.k_scale_float: Optional[float] = None
        self.v_scale_float: Optional[float] = None

    @property
    def causal(self) -> bool:
        """``is_causal(self)``."""
        return is_causal(self)

    @property
    def kv_cache_layer_id(self) -> int:
        """Layer whose KV buffers this layer reads (itself unless it shares another's cache)."""
        t = self.kv_sharing_target_layer_id
        return self.layer_id if t is None else t

    def set_kv_scales(self, k_scale: float, v_scale: float, device=None) -> None:
        """Set the fp8 KV-cache scales (stored = value / scale; read = stored * scale)."""
        self.k_scale_float, self.v_scale_float = float(k_scale), float(v_scale)
        self.k_scale = torch.tensor([k_scale], dtype=torch.float32, device=device)
        self.v_scale = torch.tensor([v_scale], dtype=torch.float32, device=device)

    def forward(self, q: Tensor, k: Optional[Tensor], v: Optional[Tensor], forward_batch,
                save_kv_cache: bool = True, **kwargs) -> Tensor:
        """Attend ``q`` over the cache after writing ``k``/``v`` (when given and ``save_kv_cache``):
        through ``split_op`` when one is installed (piecewise mode), else ``attend``.

        Args:
            q: [tokens, Hq * D] or [tokens, Hq, D].
            k: [tokens, Hkv * D] or [tokens, Hkv, D] or None (K/V already cached or shared);
                with ``k_rope`` in kwargs (MLA) it is the latent ``[tokens, 1, R]``.
            v: like ``k`` with Dv, or None.
            forward_batch: ForwardBatch whose ``attn_backend`` runs the attention.
            save_kv_cache: False attends without writing ``k``/``v``.
            kwargs: backend extras (``sinks [Hq] float32``, ``k_rope``, ``q_rope``).
        Returns:
            [tokens, Hq * Dv] in q's dtype.
        Raises:
            ValueError: ``k``/``v`` not paired.
        """
        if (k is None) != (v is None) and "k_rope" not in kwargs:
            raise ValueError(f"PagedAttention.forward: k and v must both be tensors or both be "
                             f"None; expected a pair, got k={type(k).__name__}, "
                             f"v={type(v).__name__}.")
        if self.split_op is not None:
            return self.split_op(self, q, k, v, save_kv_cache=save_kv_cache, **kwargs)
        return self.attend(q, k, v, forward_batch, save_kv_cache, **kwargs)

    def attend(self, q: Tensor, k: Optional[Tensor], v: Optional[Tensor], forward_batch,
               save_kv_cache: bool = True, **kwargs) -> Tensor:
        """The attention itself, as ``forward`` without the split op (what the split op calls):
        ``k``/``v`` viewed ``[tokens, Hkv, D]`` (MLA keeps its latent), then the backend."""
        if k is not None and "k_rope" not in kwargs:
            k = k.reshape(-1, self.tp_k_head_num, self.qk_head_dim)
            v = v.reshape(-1, self.tp_v_head_num, self.v_head_dim)
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache,
                                                  **kwargs)

    def extra_repr(self) -> str:
        return (f"layer_id={self.layer_id}, Hq={self.tp_q_head_num}, Hkv={self.tp_k_head_num}, "
                f"D={self.head_dim}, Dv={self.v_head_dim}, window={self.sliding_window_size}, "
                f"logit_cap={self.logit_cap}")


def attention_layers(model: nn.Module) -> list[PagedAttention]:
    """Every ``PagedAttention`` module of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, PagedAttention)]


def kv_layout(model: nn.Module) -> KVLayout:
    """The ``KVLayout`` that sizes ``model``'s KV pools, from its ``PagedAttention`` layers.

    Hkv, D and Dv are the layers' (all layers must agree: one pool shape); sliding-window layers
    are those with ``sliding_window_size >= 0`` (W = ``sliding_window_size + 1``, the largest
    one); the MLA latent rank is ``model.config.kv_lora_rank`` when the config has one (the
    layers then hold ``D = R + r`` and ``Dv = R``) and the DSA index-key dim its
    ``index_head_dim`` (DeepSeek-V3.2); layers with ``kv_sharing_target_layer_id`` are
    ``kv_sharing`` pairs (they get no buffers); ``LinearAttention`` layers below the last
    attention layer are ``linear_layer_ids`` (no buffers either: their state is elsewhere).

    Raises:
        ValueError: ``model`` has no ``PagedAttention`` layer, or two layers disagree on Hkv, D
            or Dv.

    >>> from torch import nn
    >>> layers = nn.ModuleList([PagedAttention(4, 8, 8 ** -0.5, 2, layer_id=0,
    ...                                        sliding_window_size=7),
    ...                         PagedAttention(4, 8, 8 ** -0.5, 2, layer_id=1)])
    >>> kv_layout(layers)
    KVLayout(num_layers=2, head_num=2, head_dim=8, v_head_dim=8, swa_layer_ids=(0,), \
sliding_window=8, kv_lora_rank=0, kv_sharing=(), linear_layer_ids=(), index_head_dim=0)
    """
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"kv_layout: model has no PagedAttention layer; expected a model "
                         f"built on compile.backend.PagedAttention, got "
                         f"{type(model).__name__}.")
    first = layers[0]
    shape = (first.tp_k_head_num, first.qk_head_dim, first.v_head_dim)
    for layer in layers:
        other = (layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim)
        if other != shape:
            raise ValueError(f"kv_layout: layer {layer.layer_id} has (Hkv, D, Dv) {other}; "
                             f"expected the same as layer {first.layer_id}, got {other} vs "
                             f"{shape}. One pool holds one shape.")
    swa = sorted(m.layer_id for m in layers if m.sliding_window_size >= 0)
    window = max((m.sliding_window_size + 1 for m in layers if m.sliding_window_size >= 0),
                 default=None)
    rank = getattr(getattr(model, "config", None), "kv_lora_rank", None) or 0
    index_dim = getattr(getattr(model, "config", None), "index_head_dim", None) or 0
    sharing = tuple(sorted((m.layer_id, m.kv_sharing_target_layer_id) for m in layers
                           if m.kv_sharing_target_layer_id is not None))
    num_layers = max(m.layer_id for m in layers) + 1
    linear = tuple(sorted(m.layer_id for m in linear_layers(model) if m.layer_id < num_layers))
    return KVLayout(num_layers=num_layers, head_num=shape[0],
                    head_dim=shape[1], v_head_dim=shape[2], swa_layer_ids=tuple(swa),
                    sliding_window=window, kv_lora_rank=rank, kv_sharing=sharing,
                    linear_layer_ids=linear, index_head_dim=index_dim if rank else 0)


__all__ = ["AttentionType", "PagedAttention", "attention_layers", "is_causal", "kv_layout"]
