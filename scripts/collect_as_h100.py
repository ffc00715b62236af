"""pytest plugin (``-p collect_as_h100``) for counting the client tests on a machine without CUDA.

``client_test_runs.collect_job`` loads it with ``--collect-only`` only, and only when CUDA is not
available: the client files ask ``torch.version.cuda`` and the device's compute capability at
import (for their ``skipif`` marks), which fail on a CPU-only torch. Here they answer as an H100
(CUDA 12.8, capability 9.0), so a file collects the same parametrized tests it collects on the
GPU. No test runs under it.
"""

from __future__ import annotations

import types

import torch

if not torch.cuda.is_available():
    torch.version.cuda = "12.8"
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
        major=9, minor=0, name="NVIDIA H100 80GB HBM3", total_memory=80 << 30)
