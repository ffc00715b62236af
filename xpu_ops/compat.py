"""Run code written against sgl-kernel (an sglang attention backend, sgl-kernel's and
sgl-kernel-xpu's own tests) on xpu-ops, unchanged.

``install_sgl_kernel_shim()`` is an explicit opt-in. When no real ``sgl_kernel`` imports, it
installs small modules under that name whose functions are xpu-ops' own (``SHIM_MODULES``: each
module and the names it exports), so these resolve:

    import sgl_kernel
    from sgl_kernel.flash_attn import (flash_attn_with_kvcache, flash_attn_varlen_func,
                                       get_scheduler_metadata)
    from sgl_kernel import merge_state, merge_state_v2, store_cache_xpu, flash_mla_decode, ...
    from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata, flash_mla_sparse_fwd
    from sgl_kernel import fp8_mqa_logits, fp8_paged_mqa_logits, hadamard_transform, ...  # DSA
    from sgl_kernel.testing.rotary_embedding import _apply_rotary_emb
    from sgl_kernel.sparse_flash_attn import (sparse_attn_func, convert_vertical_slash_indexes,
                                              convert_vertical_slash_indexes_mergehead)
    from sgl_kernel import topk_transform_512, fp8_paged_mqa_logits_triton   # DeepSeek-V4
    from sgl_kernel.nsa import fp8_mqa_logits, fp8_paged_mqa_logits   # sgl-kernel-xpu's forms
    from sgl_kernel import gdn_attention     # sgl-kernel-xpu's fused GDN layer (compat_gdn)
    from sgl_kernel import causal_conv1d_fn_xpu, causal_conv1d_update_xpu   # (compat_mamba)
    torch.ops.sgl_kernel.rotary_embedding(positions, query, key, head_size, cache, is_neox)
    torch.ops.sgl_kernel.gdn_attention(core_attn_out, z, projected_states_qkvz, ...)

These cover every attention name that sglang 0.5.23's attention code (``xpu_backend.py``,
``flashattention_backend.py``, ``dsa_backend.py``, ``dsa/``, ``dsv4/``, ``qsa/``,
``deepseek_v4_backend.py``, the XPU rotary embedding) and sgl-kernel-xpu main's attention and
DSA-indexer tests import from ``sgl_kernel`` or call as ``torch.ops.sgl_kernel``
(``tests/ops/test_client_imports.py`` lists each with the file that imports it), plus
``sgl_kernel.flash_attn.build_bidirectional_block_ids``, which sglang's Gemma-3 model imports on
XPU. The raw op names are defined by ``xpu_ops.compat_ops`` when the shim is installed.
The top-level ``fp8_mqa_logits`` / ``fp8_paged_mqa_logits`` are xpu-ops' (DeepGEMM's contract
and cache layout, what sglang's DSA index buffer holds); ``sgl_kernel.nsa``'s are
sgl-kernel-xpu's (``xpu_ops.compat_dsa``). ``gdn_attention`` is sgl-kernel-xpu's signature and
layouts (in place, returns None) on ``xpu_ops.gdn_attention`` (``xpu_ops.compat_gdn``), which
sglang's ``hardware_backend/xpu/attention/xpu_gdn_backend.py`` imports; its wrapper keeps
sgl-kernel-xpu's grow-only scratch cache ``sgl_kernel.gdn_attn._gdn_ws_cache``.
``causal_conv1d_fn_xpu`` / ``causal_conv1d_update_xpu`` are sgl-kernel-xpu's channel-first,
write-into-``x`` forms (``sgl_kernel.mamba``) of xpu-ops' causal conv1d (``xpu_ops.compat_mamba``).
``get_scheduler_metadata`` returns None: FA3's precomputed tile schedule is a speed hint that ``flash_attn_with_kvcache`` accepts as
``scheduler_metadata=None``.

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
_FLASH_MLA = ("flash_mla_with_kvcache", "get_mla_metadata", "flash_mla_sparse_fwd")
_ATTENTION = ("merge_state", "merge_state_v2", "flash_mla_decode",
              "flash_mla_decode_get_workspace_size", "flash_mla_get_workspace_size",
              "flash_mla_prefill", "flash_mla_prefill_get_workspace_size") + _FLASH_MLA
_SPARSE = ("sparse_attn_func", "sparse_attn_varlen_func", "convert_vertical_slash_indexes",
           "convert_vertical_slash_indexes_mergehead")
_TOP_K = ("fast_topk_v2", "fast_topk_transform_fused", "fast_topk_transform_ragged_fused",
          "topk_transform_512", "topk_transform_512_v2")
#: Names the shim's ``sgl_kernel`` package exports (xpu-ops functions of the same name).
SGL_KERNEL_NAMES = _ATTENTION + _SPARSE + _TOP_K + (
    "store_cache_xpu",
    # the DSA indexer (DeepGEMM's contract and cache layout, what sglang's index buffer holds)
    "fp8_mqa_logits", "fp8_paged_mqa_logits", "hadamard_transform",
    "fp8_paged_mqa_logits_triton",     # sgl-kernel-xpu's DeepSeek-V4 form (0.0 past the end)
    "gdn_attention",                   # sgl-kernel-xpu's fused GDN layer (xpu_ops.compat_gdn)
    "causal_conv1d_fn_xpu", "causal_conv1d_update_xpu")   # its channel-first conv (compat_mamba)
#: Names the shim's ``sgl_kernel.flash_attn`` module exports.
SGL_KERNEL_FLASH_ATTN_NAMES = ("flash_attn_with_kvcache", "flash_attn_varlen_func",
                               "get_scheduler_metadata", "build_bidirectional_block_ids")
#: Every shim module (submodules after their package) and the names it exports.
SHIM_MODULES = {
    SHIM_NAME: SGL_KERNEL_NAMES,
    f"{SHIM_NAME}.flash_attn": SGL_KERNEL_FLASH_ATTN_NAMES,
    f"{SHIM_NAME}.attention": _ATTENTION,                 # sgl-kernel-xpu's home of these
    f"{SHIM_NAME}.elementwise": ("store_cache_xpu",),
    f"{SHIM_NAME}.flash_mla": _FLASH_MLA,   # sgl-kernel's module: base-2 sparse statistics
    f"{SHIM_NAME}.sparse_flash_attn": _SPARSE,
    f"{SHIM_NAME}.top_k": _TOP_K + ("_FAST_TOPK_SUPPORTED_K",),
    f"{SHIM_NAME}.hadamard": ("hadamard_transform",),
    # sgl-kernel-xpu's forms (xpu_ops.compat_dsa): 0.0 outside a row, a per-token paged cache
    f"{SHIM_NAME}.nsa": ("fp8_mqa_logits", "fp8_paged_mqa_logits", "_fp8_mqa_logits_impl",
                         "_HEAD_LOOP_THRESHOLD"),
    f"{SHIM_NAME}.fp8_paged_mqa_logits": ("fp8_paged_mqa_logits_triton", "FP8_DTYPE"),
    f"{SHIM_NAME}.gdn_attn": ("gdn_attention", "_gdn_ws_cache"),   # sgl-kernel-xpu's home of it
    f"{SHIM_NAME}.mamba": ("causal_conv1d_fn_xpu", "causal_conv1d_update_xpu"),
    f"{SHIM_NAME}.testing": (),
    f"{SHIM_NAME}.testing.rotary_embedding": ("_apply_rotary_emb",),
}
#: ``(module, name)`` of every attention import the clients make: sglang 0.5.23's attention
#: backends and sgl-kernel-xpu main's attention tests.
ATTENTION_IMPORTS = tuple((module, name) for module, names in SHIM_MODULES.items()
                          for name in names)


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
    modules = {}
    for name, exports in SHIM_MODULES.items():       # packages before their submodules
        parent, _, leaf = name.rpartition(".")
        is_package = any(other.startswith(name + ".") for other in SHIM_MODULES)
        functions = _functions(name)
        modules[name] = _module(name, is_package, **{n: functions[n] for n in exports})
        if parent and leaf not in SHIM_MODULES[parent]:   # sgl_kernel.fp8_paged_mqa_logits
            setattr(modules[parent], leaf, modules[name])      # stays the function
    from . import compat_ops  # noqa: F401  (defines torch.ops.sgl_kernel.<raw op names>)
    package = modules[SHIM_NAME]
    sys.modules.update(modules)
    return package


def _functions(module: str) -> dict:
    """The xpu-ops function behind each name ``module`` exports (``sgl_kernel.flash_mla``'s
    ``flash_mla_sparse_fwd`` is sgl-kernel's base-2 form, ``compat_flash_mla``;
    ``sgl_kernel.nsa``'s are sgl-kernel-xpu's forms, ``compat_dsa``)."""
    import xpu_ops
    from xpu_ops.ops.rotary import apply_rotary_emb_per_token
    from xpu_ops.ops.sparse_attn_varlen import sparse_attn_varlen_func
    from . import compat_dsa, compat_flash_mla, compat_gdn, compat_mamba
    functions = dict(vars(xpu_ops), get_scheduler_metadata=get_scheduler_metadata,
                     gdn_attention=compat_gdn.gdn_attention,
                     _gdn_ws_cache=compat_gdn._gdn_ws_cache,
                     causal_conv1d_fn_xpu=compat_mamba.causal_conv1d_fn_xpu,
                     causal_conv1d_update_xpu=compat_mamba.causal_conv1d_update_xpu,
                     _apply_rotary_emb=apply_rotary_emb_per_token,
                     sparse_attn_varlen_func=sparse_attn_varlen_func,
                     **compat_dsa.shim_functions())
    if module == f"{SHIM_NAME}.flash_mla":
        functions.update(compat_flash_mla.functions())
    if module == f"{SHIM_NAME}.nsa":
        functions.update(compat_dsa.nsa_functions())
    return functions


def uninstall_sgl_kernel_shim() -> bool:
    """Remove the shim (and only the shim) from ``sys.modules``; True when one was removed."""
    if not is_shim(sys.modules.get(SHIM_NAME)):
        return False
    for name in [n for n in sys.modules if n == SHIM_NAME or n.startswith(SHIM_NAME + ".")]:
        if is_shim(sys.modules[name]):
            del sys.modules[name]
    return True
