"""Backend wing: `XPUAttentionBackend` (sglang's `AttentionBackend` role). Metadata builders per
forward mode (host, once per step), the per-layer forward (save KV, attend, cascade merge),
`PagedAttention` (sglang's `RadixAttention` role) and `kv_layout(model)`, local attention, MLA
and speculative-decoding metadata; `HybridLinearAttnBackend` with `LinearAttention` (gated delta
net layers over the per-request state pool, sglang's `RadixLinearAttention` role). Imports the batch wing and `xpu_ops`; never the models, graphs or engine wings."""

from compile.backend.attention_backend import XPUAttentionBackend
from compile.backend.hybrid_backend import HybridLinearAttnBackend
from compile.backend.layer import AttentionType, PagedAttention, attention_layers, kv_layout
from compile.backend.linear_layer import LinearAttention, linear_layers, linear_layout

__all__ = ["XPUAttentionBackend", "AttentionType", "PagedAttention", "attention_layers",
           "kv_layout", "HybridLinearAttnBackend", "LinearAttention", "linear_layers",
           "linear_layout"]
