"""One module per op family: schema, fake, argument checks and public wrapper side by side."""

from . import kv_cache, merge_state, mla_decode, mla_prefill, paged_attention, swa_spec  # noqa: F401
from . import rotary, varlen_attention  # noqa: F401
from . import sparse_attn, store_cache  # noqa: F401
from . import dsa_index_cache, dsa_indexer, dsa_topk, hadamard  # noqa: F401
from . import causal_conv1d, gated_delta_rule  # noqa: F401
from . import gdn_attention  # noqa: F401
