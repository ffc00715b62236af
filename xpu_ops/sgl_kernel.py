"""The ``sgl_kernel`` provider: native kernels from sgl-kernel(-xpu) where it imports."""
