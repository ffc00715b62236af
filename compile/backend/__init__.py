"""Backend wing: `XPUAttentionBackend` (sglang's `AttentionBackend` role). Metadata builders per
forward mode (host, once per step), the per-layer forward (save KV, attend, cascade merge),
`PagedAttention` (sglang's `RadixAttention` role), local attention, MLA and speculative-decoding
metadata. Imports the batch wing and `xpu_ops`; never the graphs or engine wings."""
