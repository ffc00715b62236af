"""Batch wing: what one step runs on. `ForwardBatch` and `ForwardMode` (sglang's names), the
request-to-token table, the KV pools (MHA, hybrid sliding window, MLA) and the page allocator.
Pools know nothing of layers or graphs; this wing imports only `xpu_ops` and torch."""
