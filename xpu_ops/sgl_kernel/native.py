"""Finding the native ``sgl_kernel`` ops and calling them in whichever convention the build has.

sgl-kernel-xpu registers its kernels as ``torch.ops.sgl_kernel.*`` when ``import sgl_kernel``
runs. Its attention entry point ``fwd`` has changed shape over releases, so nothing here assumes
one: the schema is read from the dispatcher and the call is built by argument *name*.

* Calling conventions of ``fwd`` (``fwd_convention``):
  ``"writes"`` - ``..., Tensor(a!) out, Tensor(b!)? softmax_lse, ...) -> ()``: the caller
  allocates both; ``"returns"`` - ``-> (Tensor out, Tensor softmax_lse, ...)``, with or without an
  optional ``out`` argument that the result may alias.
* Flavours of ``fwd`` (``fwd_flavour``): ``"xpu"`` (sgl-kernel-xpu: the paged call carries the
  per-request ``cache_seqlens`` in the ``cu_seqlens_k`` slot, no ``seqused_k``) and ``"fa3"``
  (sgl-kernel's CUDA FlashAttention-3: ``cu_seqlens_k=None`` and ``seqused_k=cache_seqlens``).

Which namespace and package are used is a ``Binding``; tests point it at a test-only library with
``bound_to`` (a context manager, like ``xpu_ops.use_provider``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import sys
from typing import Iterator, Optional

import torch

from ..provider_table import DISPATCH_KEYS  # torch dispatch key of the kernels of each device type


@dataclasses.dataclass(frozen=True)
class Binding:
    """Where the native ops live.

    Attributes:
        namespace: ``torch.ops`` namespace of the ops (``"sgl_kernel"``).
        package: module whose import registers them (``"sgl_kernel"``), or ``None`` when they
            are registered already (test libraries).
    """
    namespace: str = "sgl_kernel"
    package: Optional[str] = "sgl_kernel"


_binding: contextvars.ContextVar[Binding] = contextvars.ContextVar("xpu_ops_sgl_kernel_binding",
                                                                  default=Binding())
_reasons: dict[tuple, Optional[str]] = {}


def binding() -> Binding:
    """The binding in effect (the real ``sgl_kernel`` unless inside ``bound_to``)."""
    return _binding.get()


@contextlib.contextmanager
def bound_to(namespace: str, package: Optional[str] = None) -> Iterator[Binding]:
    """Make the ``sgl_kernel`` provider use ``torch.ops.<namespace>`` inside the block.

    Args:
        namespace: torch.ops namespace holding ``fwd``, ``merge_state_v2``, ``flash_mla_decode``...
        package: module to import first, or None when the ops are registered already.
    """
    token = _binding.set(Binding(namespace, package))
    try:
        yield _binding.get()
    finally:
        _binding.reset(token)


def _package_reason(package: str) -> Optional[str]:
    module = sys.modules.get(package)
    if module is not None and getattr(module, "__xpu_ops_shim__", False):
        return (f"`{package}` is xpu-ops' own compatibility shim (xpu_ops.compat), not the "
                f"native package")
    try:
        importlib.import_module(package)
    except Exception as exc:  # any import failure means: no native kernels here
        return (f"`import {package}` failed ({type(exc).__name__}: {exc}); install "
                f"sgl-kernel-xpu (Intel GPU) or sgl-kernel (NVIDIA GPU)")
    return None


def packet(name: str):
    """``torch.ops.<namespace>.<name>`` of the current binding, or None when not registered."""
    namespace = getattr(torch.ops, binding().namespace)
    return getattr(namespace, name) if hasattr(namespace, name) else None


def schema(name: str) -> torch.FunctionSchema:
    """``FunctionSchema`` of native op ``name`` in the current binding (it must be registered)."""
    return packet(name).default._schema


def unavailable(name: str, device_type: str) -> Optional[str]:
    """None when native op ``name`` has a kernel for ``device_type``, else why not (cached)."""
    bound = binding()
    key = (bound, name, device_type)
    if key not in _reasons:
        _reasons[key] = _unavailable(bound, name, device_type)
    return _reasons[key]


def _unavailable(bound: Binding, name: str, device_type: str) -> Optional[str]:
    if bound.package is not None:
        reason = _package_reason(bound.package)
        if reason is not None:
            return reason
    where = bound.package or f"torch.ops.{bound.namespace}"
    if packet(name) is None:
        return f"{where} has no op {name} (built without it?)"
    key = DISPATCH_KEYS.get(device_type)
    if key is None:
        return f"{where} has no kernels for device type {device_type!r}"
    qualname = f"{bound.namespace}::{name}"
    if not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key):
        served = [k.lower() for k in DISPATCH_KEYS.values()
                  if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, k)]
        return (f"{where} is installed but {name} has no {key} kernel (this build serves "
                f"{', '.join(served) or 'no device'}; sgl-kernel-xpu serves xpu, sgl-kernel cuda)")
    if name == "fwd":
        return fwd_schema_problem(schema(name))
    return None


# ---- fwd: convention, flavour and the by-name call -------------------------------------------

def _arg_names(s: torch.FunctionSchema) -> list[str]:
    return [a.name for a in s.arguments]


def fwd_convention(s: torch.FunctionSchema) -> str:
    """``"writes"`` (returns nothing, writes ``out``/``softmax_lse``) or ``"returns"``."""
    return "writes" if len(s.returns) == 0 else "returns"


def fwd_flavour(s: torch.FunctionSchema) -> str:
    """``"fa3"`` when the schema has ``seqused_k`` (sgl-kernel CUDA), else ``"xpu"``."""
    return "fa3" if "seqused_k" in _arg_names(s) else "xpu"


# Arguments that xpu-ops never uses, with the value meaning "off" (FlashAttention's defaults).
_NEUTRAL = {"is_rotary_interleaved": False, "num_kv_splits": 0, "num_splits": 0,
            "sm_margin": 0, "attention_chunk": 0, "rel_bias_is_sheared": False}
_SUPPLIED = {"q", "k", "v", "q_v", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q",
             "max_seqlen_k", "page_table", "q_descale", "k_descale", "v_descale",
             "softmax_scale", "sinks", "is_causal", "window_size_left", "window_size_right",
             "softcap", "out", "softmax_lse"}


def fwd_schema_problem(s: torch.FunctionSchema) -> Optional[str]:
    """None when ``fwd`` can be called by name, else what in its schema is not understood."""
    names = _arg_names(s)
    if fwd_convention(s) == "writes" and not {"out", "softmax_lse"} <= set(names):
        return f"sgl_kernel.fwd returns nothing but has no out/softmax_lse arguments: {s}"
    if fwd_convention(s) == "returns" and len(s.returns) < 2:
        return f"sgl_kernel.fwd returns no softmax_lse: {s}"
    for arg in s.arguments:
        known = arg.name in _SUPPLIED or arg.name in _NEUTRAL
        optional = isinstance(arg.type, torch.OptionalType) or arg.has_default_value()
        if not known and not optional:
            return f"sgl_kernel.fwd has an argument xpu-ops cannot fill: {arg.name} ({s})"
    return None


def call_fwd(values: dict) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Call native ``fwd`` with ``values`` keyed by schema argument name.

    Arguments not in ``values`` get their schema default, ``None`` when optional, or the neutral
    value in ``_NEUTRAL``. Returns ``(out, softmax_lse)`` as the native op produced them (for
    the ``"writes"`` convention: the ``out``/``softmax_lse`` passed in).
    """
    op = packet("fwd").default
    s = op._schema
    args = []
    for arg in s.arguments:
        if arg.name in values:
            args.append(values[arg.name])
        elif arg.has_default_value():
            args.append(arg.default_value)
        elif arg.name in _NEUTRAL:
            args.append(_NEUTRAL[arg.name])
        else:
            args.append(None)
    result = op(*args)
    if fwd_convention(s) == "writes":
        return values.get("out"), values.get("softmax_lse")
    return result[0], result[1]
