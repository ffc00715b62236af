"""The ``reference`` provider: plain PyTorch, float32 accumulation, any device.

Importing this package registers every reference implementation with ``xpu_ops.providers``.
"""

from . import kv_cache, merge_state, mla_decode, mla_prefill, paged_attention, swa_spec  # noqa: F401
from . import rotary, varlen_attention  # noqa: F401
from . import flash_mla  # noqa: F401
from . import dsa_indexer  # noqa: F401
from . import causal_conv1d, gated_delta_rule  # noqa: F401
from . import gdn_attention  # noqa: F401
from . import sparse_attn  # noqa: F401
