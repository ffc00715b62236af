"""The ``triton`` provider: portable Triton kernels for CUDA and XPU (registered on import)."""
