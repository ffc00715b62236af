"""The ``reference`` provider: plain PyTorch, float32 accumulation, any device.

Importing this package registers every reference implementation with ``xpu_ops.providers``.
"""

from . import paged_attention  # noqa: F401
