"""xpu-ops: paged-attention kernels as first-class PyTorch operators.

Every function here is a thin wrapper over one ``torch.ops.xpu_ops`` custom op with a fake
implementation, so it traces under ``torch.compile`` and passes ``torch.library.opcheck``.
"""

from .ops.paged_attention import flash_attn_with_kvcache
from .providers import use_provider

__all__ = ["flash_attn_with_kvcache", "use_provider"]
