"""The ``sgl_kernel`` provider: native kernels of sgl-kernel-xpu (Intel GPU) or sgl-kernel (CUDA).

Available on a device type only when ``import sgl_kernel`` works and the native op has a kernel
for that device's dispatch key (an XPU build on ``xpu``, a CUDA build on ``cuda``); otherwise the
reason says what is missing. Calls the kernel cannot serve (see ``limits``) are declined through
the registry's ``supports=`` hook and fall back to ``triton``, recorded for
``python -m xpu_ops info``.

Argument mapping (providers receive the op's own, validated arguments):

* ``flash_attn_with_kvcache`` -> ``fwd`` with the paged cache; on sgl-kernel-xpu the per-request
  ``cache_seqlens`` go into the ``cu_seqlens_k`` slot, on FlashAttention-3 into ``seqused_k``;
  ``max_seqlen_k`` is the page-table capacity (a shape-only bound).
* ``flash_attn_varlen_func`` -> ``fwd`` without a page table.
* Both: ``out`` is written in place (a staging copy when it is not contiguous), the LSE is
  ``[Hq, total_q]`` float32; ``+inf`` LSE of empty rows (FlashAttention-3) becomes ``-inf``.
  Works with both conventions of ``fwd``: returning ``(out, lse, ...)`` or writing
  ``out``/``softmax_lse`` and returning nothing (``native.fwd_convention``).
* ``merge_state_v2``, ``merge_state`` and ``flash_mla_decode`` -> the native ops of the same
  name.

Nothing here has run on an Intel GPU: the mapping is tested against a test-only library that
defines sgl-kernel-xpu's schemas with reference implementations (``tests/ops``).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from .. import provider_table
from . import limits, native
from .native import Binding, binding, bound_to

__all__ = ["Binding", "binding", "bound_to", "limits", "native"]


def _available(op: str):
    def available(device_type: str) -> Optional[str]:
        """``None`` when the native op has a kernel for ``device_type``, else why not."""
        return native.unavailable(op, device_type)
    return available


def _contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


# Arguments of native ``fwd`` that are not small metadata (their layouts are handled apart).
_LARGE = frozenset({"q", "k", "v", "q_v", "out", "softmax_lse"})


def _run_fwd(out: torch.Tensor, values: dict) -> torch.Tensor:
    """Run native ``fwd``; write its output into ``out``; return the LSE ``[Hq, total_q]``.

    The one place where the small tensors (lengths, prefix sums, page table, descales, sinks,
    leftpad) become contiguous: native kernels index them densely, and API.md allows any view
    (a column slice of a page table, an expanded per-tensor descale)."""
    for name, value in values.items():
        if name not in _LARGE and isinstance(value, torch.Tensor) and not value.is_contiguous():
            values[name] = value.contiguous()
    q = values["q"]
    staging = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    values["out"] = staging
    values["softmax_lse"] = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    result, lse = native.call_fwd(values)
    if result is not staging:
        staging.copy_(result)
    if staging is not out:
        out.copy_(staging)
    lse = lse.reshape(q.shape[1], q.shape[0]).float()
    return lse.masked_fill(lse == float("inf"), float("-inf"))


def _attention_values(q, k, v, qv, q_descale, k_descale, v_descale, sinks, *, max_seqlen_q,
                      softmax_scale, causal, window_size_left, window_size_right, softcap,
                      num_splits):
    # num_splits: FlashAttention-3's name; sgl-kernel-xpu calls it num_kv_splits.
    return dict(q=_contiguous(q), k=_contiguous(k), v=_contiguous(v), q_v=qv, q_descale=q_descale,
                k_descale=k_descale, v_descale=v_descale, sinks=sinks, max_seqlen_q=max_seqlen_q,
                softmax_scale=softmax_scale, is_causal=causal, window_size_left=window_size_left,
                window_size_right=window_size_right, softcap=softcap, num_splits=num_splits,
                num_kv_splits=num_splits)


@provider_table.register("flash_attn_with_kvcache", "sgl_kernel", available=_available("fwd"),
                    supports=limits.flash_attn_with_kvcache)
def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out,
                            qv, q_descale, k_descale, v_descale, sinks, cache_leftpad,
                            bidirectional_block_ids, max_seqlen_q, softmax_scale, causal,
                            window_size_left, window_size_right, softcap, num_splits,
                            return_softmax_lse):
    """sgl_kernel ``flash_attn_with_kvcache`` (contract: ``xpu_ops/ops/paged_attention.py``).

    Native ``fwd`` with the paged cache (``cache_seqlens`` as ``cu_seqlens_k`` on sgl-kernel-xpu,
    ``seqused_k`` on FlashAttention-3; ``cache_leftpad`` as ``leftpad_k``). Writes ``out``,
    returns the LSE ``[Hq, total_q]`` float32. ``bidirectional_block_ids`` is declined
    (``limits``).
    """
    values = _attention_values(q, k_cache, v_cache, qv, q_descale, k_descale, v_descale, sinks,
                               max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale,
                               causal=causal, window_size_left=window_size_left,
                               window_size_right=window_size_right, softcap=softcap,
                               num_splits=num_splits)
    values.update(cu_seqlens_q=cu_seqlens_q, page_table=page_table, leftpad_k=cache_leftpad,
                  max_seqlen_k=page_table.shape[1] * k_cache.shape[1])
    if native.fwd_flavour(native.schema("fwd")) == "xpu":
        values["cu_seqlens_k"] = cache_seqlens          # per-request lengths, not prefix sums
    else:
        values.update(cu_seqlens_k=None, seqused_k=cache_seqlens)
    lse = _run_fwd(out, values)
    return lse if return_softmax_lse else provider_table.empty_lse(q)


@provider_table.register("flash_attn_varlen_func", "sgl_kernel", available=_available("fwd"),
                    supports=limits.flash_attn_varlen_func)
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, out, seqused_k, qv, q_descale,
                           k_descale, v_descale, sinks, seqused_q, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window_size_left, window_size_right, softcap,
                           num_splits):
    """sgl_kernel ``flash_attn_varlen_func`` (contract: ``xpu_ops/ops/varlen_attention.py``).

    Native ``fwd`` without a page table. Writes ``out``, returns the LSE ``[Hq, total_q]`` float32.
    """
    values = _attention_values(q, k, v, qv, q_descale, k_descale, v_descale, sinks,
                               max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale,
                               causal=causal, window_size_left=window_size_left,
                               window_size_right=window_size_right, softcap=softcap,
                               num_splits=num_splits)
    values.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, page_table=None,
                  max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, seqused_q=seqused_q)
    return _run_fwd(out, values)


@provider_table.register("merge_state_v2", "sgl_kernel", available=_available("merge_state_v2"))
def merge_state_v2(v_a, s_a, v_b, s_b, v_merged, s_merged):
    """sgl_kernel ``merge_state_v2`` (contract: ``xpu_ops/ops/merge_state.py``).

    Calls the native op on contiguous copies; non-contiguous outputs are staged, then copied back.
    An LSE of ``+inf`` is passed as ``-inf`` (both mean an empty state here; native kernels are
    not all known to treat ``+inf`` so).
    """
    _merge_native("merge_state_v2", v_a, s_a, v_b, s_b, v_merged, s_merged)


@provider_table.register("merge_state", "sgl_kernel", available=_available("merge_state"))
def merge_state(v_a, s_a, v_b, s_b, v_merged, s_merged):
    """sgl_kernel ``merge_state`` (v1, base-2 LSEs; contract: ``xpu_ops/ops/merge_state.py``):
    the native op of that name, staged as ``merge_state_v2``."""
    _merge_native("merge_state", v_a, s_a, v_b, s_b, v_merged, s_merged)


def _merge_native(name: str, v_a, s_a, v_b, s_b, v_merged, s_merged) -> None:
    # Native kernels index dense rows; callers often pass a transposed LSE ([H, N] -> [N, H]).
    outputs = [t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
               for t in (v_merged, s_merged)]
    s_a, s_b = (torch.where(s == math.inf, -math.inf, s).contiguous() for s in (s_a, s_b))
    native.packet(name).default(v_a.contiguous(), s_a, v_b.contiguous(), s_b, *outputs)
    for staged, target in zip(outputs, (v_merged, s_merged)):
        if staged is not target:
            target.copy_(staged)


@provider_table.register("flash_mla_decode", "sgl_kernel", available=_available("flash_mla_decode"),
                    supports=limits.flash_mla_decode)
def flash_mla_decode(q_nope, q_rope, kv_cache, cache_seqlens, page_table, workspace,
                     softmax_scale, num_kv_splits):
    """sgl_kernel ``flash_mla_decode`` (contract: ``xpu_ops/ops/mla_decode.py``).

    Calls the native split-KV MLA decode kernel; returns a new ``[b, H, R]`` tensor.
    """
    batch, num_heads, latent_dim = q_nope.shape
    out = q_nope.new_empty((batch, num_heads, latent_dim))
    native.packet("flash_mla_decode").default(
        out, q_nope.contiguous(), q_rope.contiguous(), kv_cache, cache_seqlens, page_table,
        workspace, softmax_scale, num_kv_splits)
    return out


def _supports_store_cache(k, v, k_cache, v_cache, indices):
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} has a non-unit stride in its last dimension"
    return None


@provider_table.register("store_cache", "sgl_kernel", available=_available("store_cache"),
                         supports=_supports_store_cache)
def store_cache(k, v, k_cache, v_cache, indices):
    """sgl_kernel ``store_cache`` (contract: ``xpu_ops/ops/store_cache.py``): the native op of
    the same schema (sgl-kernel-xpu; rows need a unit stride in their last dimension)."""
    native.packet("store_cache").default(k, v, k_cache, v_cache, indices)


from . import flash_mla  # noqa: E402,F401  (the FlashMLA surface's native glue registers)
from . import dsa_indexer  # noqa: E402,F401  (the DSA indexer glue registers on import)
from . import gdn_attention  # noqa: E402,F401  (the fused gated-delta-net glue registers)
