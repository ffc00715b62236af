"""Batch wing: what one step runs on. `ForwardBatch` and `ForwardMode` (sglang's names), the
request-to-token table, the KV pools (MHA, hybrid sliding window, MLA, MLA with the DSA index
keys), the page allocators and `KVLayout`, the plain facts pools are sized from; the
linear-attention state pool (`LinearStatePool`, sized by `LinearStateLayout`). Pools know
nothing of layers or graphs; this wing imports only `xpu_ops` and torch."""

from compile.batch.forward_batch import (ForwardBatch, ForwardMode, SpecInfo, SpecInputType,
                                         is_draft_extend)
from compile.batch.dsa_pool import DSATokenToKVPool
from compile.batch.kv_layout import KVLayout, make_kv_pool
from compile.batch.memory_pool import (KVWriteLoc, MHATokenToKVPool, MLATokenToKVPool,
                                       PageAllocator, ReqToTokenPool, SWAKVPool)
from compile.batch.state_pool import LinearStateLayout, LinearStatePool
from compile.batch.swa_pages import SWAPageAllocator, hybrid_kv_pool, kv_cache_bytes

__all__ = ["ForwardBatch", "ForwardMode", "SpecInfo", "SpecInputType", "KVLayout",
           "make_kv_pool", "DSATokenToKVPool", "KVWriteLoc", "MHATokenToKVPool",
           "MLATokenToKVPool", "PageAllocator", "ReqToTokenPool", "SWAKVPool", "SWAPageAllocator",
           "hybrid_kv_pool", "kv_cache_bytes", "is_draft_extend", "LinearStateLayout",
           "LinearStatePool"]
