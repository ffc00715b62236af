"""The ``triton`` provider: portable Triton kernels for CUDA and XPU (registered on import).

Available on ``cuda`` and ``xpu`` whenever ``triton`` imports; on ``cpu`` only with
``TRITON_INTERPRET=1`` (Triton has no CPU code generator; its interpreter runs the same kernels
through NumPy, which is right for tests and far too slow for anything else).
One module per kernel family, each a ``_<name>_kernel`` plus its launcher ``<name>``.
"""

from ._common import HAS_TRITON, available

if HAS_TRITON:
    from . import kv_cache, merge_state, mla_decode, mla_prefill, paged_attention  # noqa: F401
    from . import swa_spec  # noqa: F401
    from . import rotary, varlen_attention  # noqa: F401
    from . import dsa_index_cache, dsa_indexer, dsa_topk  # noqa: F401
    from . import flash_mla  # noqa: F401
    from . import causal_conv1d, gated_delta_rule, gated_delta_rule_chunk  # noqa: F401
    from . import gdn_attention  # noqa: F401

__all__ = ["HAS_TRITON", "available"]
