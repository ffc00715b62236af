"""Fake implementations for sgl-kernel's raw native ops, which are registered without any.

Code that calls ``torch.ops.sgl_kernel.fwd`` (or ``merge_state_v2``, ``flash_mla_decode``...)
directly cannot be traced by ``torch.compile`` until those ops have fakes. Call
``register_sgl_kernel_fakes()`` once after ``import sgl_kernel``; the ``xpu_ops`` ops need none of
this (they have their own fakes).

Output shapes follow each op's schema (read from the dispatcher, so both conventions of ``fwd``
are covered): ops that return nothing get a fake that only checks nothing and returns ``None``;
the tensor-returning ``fwd`` returns ``out [total_q, Hq, Dv]`` (the ``out`` argument itself when
the schema aliases it) and ``softmax_lse [Hq, total_q]`` float32 (``[b, s, Hq, Dv]`` and
``[b, Hq, s]`` for a 4-D query), then one empty float32 tensor per further return
(split-KV accumulators, whose native sizes are not part of any published contract);
sgl-kernel-xpu's ``fp8_paged_mqa_logits`` returns float32 ``[b * next_n, max_seq_len]`` (its
``fast_topk`` writes ``indices`` and returns nothing).

Known limit: the older ``fwd`` schema returns an alias of its ``out`` argument
(``-> (Tensor(a!), ...)``). With the fake it traces under ``torch.compile`` (Dynamo) and passes
opcheck's schema and fake-tensor tests, but AOTAutograd cannot functionalize custom ops with
aliased outputs, so backends that run AOTAutograd (``aot_eager``, ``inductor``) reject it. The
newer schema (writes ``out``/``softmax_lse``, returns nothing) compiles with every backend.
"""

from __future__ import annotations

import torch

#: Raw native ops that get a fake when present and lacking one.
NATIVE_OPS = ("fwd", "merge_state", "merge_state_v2", "flash_mla_decode", "flash_mla_prefill",
              "flash_mla_sparse_decode", "flash_mla_sparse_prefill",
              "gdn_attention",   # sgl-kernel-xpu's fused GDN layer: writes its outputs and states
              "fp8_paged_mqa_logits", "fast_topk")            # the DSA indexer's

_libraries: dict[str, torch.library.Library] = {}


def has_fake(qualname: str) -> bool:
    """True when ``qualname`` can already run on fake tensors (Python fake, Meta or composite)."""
    holder = torch._library.simple_registry.singleton.find(qualname)
    if holder.fake_impl.kernel is not None:
        return True
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)
               for key in ("Meta", "CompositeImplicitAutograd"))


def _returns_nothing(*args, **kwargs) -> None:
    return None


def _fwd_fake(schema: torch.FunctionSchema):
    names = [arg.name for arg in schema.arguments]
    num_returns = len(schema.returns)
    aliases_out = num_returns > 0 and schema.returns[0].alias_info is not None

    def fake(*args, **kwargs):
        a = dict(zip(names, args), **kwargs)
        q, v = a["q"], a["v"]
        out_dtype = torch.bfloat16 if q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else q.dtype
        out = a.get("out")
        if not (aliases_out and out is not None):
            out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=out_dtype)
        if q.dim() == 4:
            lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        else:
            lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        extra = [q.new_empty((0,), dtype=torch.float32) for _ in range(num_returns - 2)]
        return (out, lse, *extra)
    return fake


def _paged_mqa_logits_fake(schema: torch.FunctionSchema):
    """``fp8_paged_mqa_logits``: float32 ``[b * next_n, max_seq_len]`` (a 3-D query: next_n 1)."""
    names = [arg.name for arg in schema.arguments]

    def fake(*args, **kwargs):
        a = dict(zip(names, args), **kwargs)
        q = a["q_fp8"]
        rows = q.shape[0] * q.shape[1] if q.dim() == 4 else q.shape[0]
        return q.new_empty((rows, a["max_seq_len"]), dtype=torch.float32)
    return fake


def _fake_for(name: str, schema: torch.FunctionSchema):
    if len(schema.returns) == 0:
        return _returns_nothing
    if name == "fwd" and len(schema.returns) >= 2:
        return _fwd_fake(schema)
    if name == "fp8_paged_mqa_logits" and len(schema.returns) == 1:
        return _paged_mqa_logits_fake(schema)
    return None   # a schema this module does not know: leave it alone


def register_sgl_kernel_fakes(namespace: str = "sgl_kernel") -> list[str]:
    """Register fakes for the raw native ops of ``torch.ops.<namespace>`` that have none.

    Idempotent: an op that already has a fake (its own, or one from an earlier call) is left
    alone, never overridden. Ops not registered (not imported, or built without them) are
    skipped.

    Args:
        namespace: torch.ops namespace of the native library (``"sgl_kernel"``).
    Returns:
        Qualified names that received a fake in this call (empty on a repeated call).

    >>> import xpu_ops
    >>> xpu_ops.register_sgl_kernel_fakes("no_such_namespace_here")
    []
    """
    ops = getattr(torch.ops, namespace)
    registered = []
    for name in NATIVE_OPS:
        if not hasattr(ops, name):
            continue
        qualname = f"{namespace}::{name}"
        fake = _fake_for(name, getattr(ops, name).default._schema)
        if fake is None or has_fake(qualname):
            continue
        lib = _libraries.get(namespace)
        if lib is None:
            lib = _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
        torch.library.register_fake(qualname, fake, lib=lib)
        registered.append(qualname)
    return registered

