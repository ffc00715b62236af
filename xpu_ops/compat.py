"""Run code written against sgl-kernel (an sglang attention backend) on xpu-ops, unchanged.

``install_sgl_kernel_shim()`` is an explicit opt-in. When no real ``sgl_kernel`` imports, it
installs a small module under that name whose functions are xpu-ops' own, so these resolve:

    import sgl_kernel
    from sgl_kernel.flash_attn import (flash_attn_with_kvcache, flash_attn_varlen_func,
                                       get_scheduler_metadata)
    from sgl_kernel import (merge_state_v2, flash_mla_decode, flash_mla_decode_get_workspace_size,
                            flash_mla_get_workspace_size, flash_mla_prefill,
                            flash_mla_prefill_get_workspace_size, flash_mla_with_kvcache,
                            flash_mla_sparse_fwd)
    from sgl_kernel.flash_mla import (get_mla_metadata, flash_mla_with_kvcache,
                                      flash_mla_sparse_fwd)     # base-2 statistics here

These are every name that sglang 0.5.23's ``xpu_backend.py`` and ``flashattention_backend.py``
import from ``sgl_kernel`` (``SGL_KERNEL_NAMES`` / ``SGL_KERNEL_FLASH_ATTN_NAMES``), plus
``sgl_kernel.flash_attn.build_bidirectional_block_ids``, which its Gemma-3 model imports on XPU.
``get_scheduler_metadata`` returns None: FA3's precomputed tile schedule is a speed hint that
``flash_attn_with_kvcache`` accepts as ``scheduler_metadata=None``.

A real installation (sgl-kernel-xpu, sgl-kernel) is never shadowed: if ``import sgl_kernel``
succeeds the shim is not installed and the real module is returned. The shim carries
``__xpu_ops_shim__ = True``; the ``sgl_kernel`` provider reports it as "not the native package".
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

SHIM_NAME = "sgl_kernel"
#: Names the shim's ``sgl_kernel`` package exports (xpu-ops functions of the same name).
SGL_KERNEL_NAMES = ("merge_state_v2", "flash_mla_decode", "flash_mla_decode_get_workspace_size",
                    "flash_mla_get_workspace_size", "flash_mla_prefill",
                    "flash_mla_prefill_get_workspace_size",
                    "flash_mla_with_kvcache", "flash_mla_sparse_fwd")  # sgl-kernel-xpu's
#: Names the shim's ``sgl_kernel.flash_attn`` module exports.
SGL_KERNEL_FLASH_ATTN_NAMES = ("flash_attn_with_kvcache", "flash_attn_varlen_func",
                               "get_scheduler_metadata", "build_bidirectional_block_ids")


def get_scheduler_metadata(*args, **kwargs) -> None:
    """sgl-kernel's FA3 scheduler-metadata hook: xpu-ops plans its own launches, so there is no
    precomputed schedule; returns None (what ``scheduler_metadata`` accepts). Arguments are
    ignored.

    >>> get_scheduler_metadata(batch_size=2, max_seqlen_q=1, max_seqlen_k=64) is None
    True
    """
    return None


def is_shim(module: object) -> bool:
    """True when ``module`` is the shim installed by ``install_sgl_kernel_shim``."""
    return bool(getattr(module, "__xpu_ops_shim__", False))


def _module(name: str, is_package: bool, **attrs) -> types.ModuleType:
    module = types.ModuleType(name, f"xpu-ops compatibility shim for `{name}` (xpu_ops.compat).")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=is_package)
    if is_package:
        module.__path__ = []
    module.__xpu_ops_shim__ = True
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def install_sgl_kernel_shim() -> types.ModuleType:
    """Make ``import sgl_kernel`` resolve to xpu-ops when no real sgl_kernel imports.

    Returns:
        The module ``import sgl_kernel`` now gives: the real package when it imports (nothing is
        installed then), else the shim (installed once; later calls return the same module).

    >>> import sys, xpu_ops
    >>> module = xpu_ops.compat.install_sgl_kernel_shim()
    >>> from sgl_kernel.flash_attn import flash_attn_with_kvcache
    >>> flash_attn_with_kvcache is xpu_ops.flash_attn_with_kvcache or not xpu_ops.compat.is_shim(module)
    True
    >>> _ = xpu_ops.compat.uninstall_sgl_kernel_shim()
    """
    existing = sys.modules.get(SHIM_NAME)
    if existing is not None:
        return existing            # the shim already, or a real package already imported
    try:
        return importlib.import_module(SHIM_NAME)   # a real installation wins
    except ImportError:
        pass
    import xpu_ops
    functions = dict(vars(xpu_ops), get_scheduler_metadata=get_scheduler_metadata)
    flash_attn = _module(f"{SHIM_NAME}.flash_attn", False,
                         **{name: functions[name] for name in SGL_KERNEL_FLASH_ATTN_NAMES})
    from . import compat_flash_mla                 # sgl-kernel's flash_mla module
    flash_mla = _module(f"{SHIM_NAME}.flash_mla", False, **compat_flash_mla.functions())
    package = _module(SHIM_NAME, True, flash_attn=flash_attn, flash_mla=flash_mla,
                      **{name: functions[name] for name in SGL_KERNEL_NAMES})
    sys.modules[SHIM_NAME] = package
    sys.modules[flash_attn.__name__] = flash_attn
    sys.modules[flash_mla.__name__] = flash_mla
    return package


def uninstall_sgl_kernel_shim() -> bool:
    """Remove the shim (and only the shim) from ``sys.modules``; True when one was removed."""
    if not is_shim(sys.modules.get(SHIM_NAME)):
        return False
    for name in [n for n in sys.modules if n == SHIM_NAME or n.startswith(SHIM_NAME + ".")]:
        if is_shim(sys.modules[name]):
            del sys.modules[name]
    return True
