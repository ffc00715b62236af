"""KV-cache writes: ``store_kv_cache`` (MHA) and ``store_mla_kv_cache`` (latent + rope).

Both ops mutate only the addressed token slots of the caches they declare in ``mutates_args``
(entries of ``loc`` outside ``[0, slots)`` are skipped by every provider); the caller's
``k``/``v`` are read, never modified.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .. import _value_checks
from .._registration import define_op
from .._checks import (FLOAT_DTYPES, FP8_DTYPES, all_dense_on, check_same_size, check_size,
                       check_store_dtypes, check_tensor, check_tensor_args, fail, tensors_or_none)
from .common import float_scalar

STORE_KV = "store_kv_cache"
STORE_MLA = "store_mla_kv_cache"
_LOC_DTYPES = (torch.int64, torch.int32)


def num_slots(cache: Tensor):
    """Token slots of a cache ``[slots, H, D]`` or ``[num_pages, page_size, H, D]`` (no view)."""
    shape = cache.shape
    return shape[0] if len(shape) == 3 else shape[0] * shape[1]


def snapshot_aliased(caches: tuple[Tensor, ...], sources: tuple[Tensor, ...]
                     ) -> Optional[tuple[Tensor, ...]]:
    """``sources``, each one that shares memory with a cache of ``caches`` cloned first (e.g.
    ``k`` a view of rows of ``k_cache``), or None when none does: a store reads every source
    row as it was before the call, whichever slots it overwrites (API.md "Writes"); None entries
    (an absent optional cache or source) alias nothing. Storage
    addresses only, no sync; a clone only for an aliased call."""
    cache_ptrs = {c.untyped_storage().data_ptr() for c in caches if c is not None}
    aliased = [s is not None and s.untyped_storage().data_ptr() in cache_ptrs for s in sources]
    if not any(aliased):
        return None
    return tuple(s.clone() if a else s for s, a in zip(sources, aliased))


def _check_scale(fn: str, arg: str, scale, cache: Tensor) -> None:
    if scale is None:
        return
    if cache.dtype not in FP8_DTYPES:
        fail(fn, arg, "is given for a cache that is not fp8", "None for a {} cache".format(
            cache.dtype), "a tensor", f"Drop {arg} or allocate the cache in an fp8 dtype.")
    check_tensor(fn, arg, scale, dtypes=(torch.float32,), device=cache.device)
    if scale.numel() != 1:
        fail(fn, arg, "has more than one element", "a per-tensor scale (1 element)",
             f"shape {tuple(scale.shape)}")


def _check_store_kv_cache(k_cache, v_cache, loc, k, v, k_scale, v_scale) -> None:
    """Validate shapes/dtypes/devices (runs in the fake too).

    Sizes shared by several arguments (N, Hkv, D, Dv) are compared all at once, so the message
    names the argument that disagrees with the others (``check_same_size``); dtypes likewise
    (``check_store_dtypes``).
    """
    fn = STORE_KV
    check_tensor(fn, "k", k, ndim=3, dtypes=FLOAT_DTYPES)
    device = k.device
    check_tensor(fn, "v", v, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    check_tensor(fn, "loc", loc, ndim=1, dtypes=_LOC_DTYPES, device=device)
    for arg, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(fn, arg, cache, ndim=(3, 4), dtypes=FLOAT_DTYPES + FP8_DTYPES,
                     device=device)
    check_store_dtypes(fn, ("k", k, "k_cache", k_cache), ("v", v, "v_cache", v_cache))
    check_same_size(fn, "N", ("k", k, 0), ("v", v, 0), ("loc", loc, 0))
    # Rows first: on a tie (k against k_cache alone) the cache is named, as for dtypes.
    check_same_size(fn, "Hkv", ("k", k, 1), ("v", v, 1), ("k_cache", k_cache, -2),
                    ("v_cache", v_cache, -2))
    check_same_size(fn, "D", ("k", k, 2), ("k_cache", k_cache, -1))
    check_same_size(fn, "Dv", ("v", v, 2), ("v_cache", v_cache, -1))
    if num_slots(k_cache) != num_slots(v_cache):
        fail(fn, "v_cache", "has a different number of token slots than k_cache",
             f"k_cache's {num_slots(k_cache)} slots", num_slots(v_cache))
    if k_scale is not None or v_scale is not None:
        _check_scale(fn, "k_scale", k_scale, k_cache)
        _check_scale(fn, "v_scale", v_scale, v_cache)


def _is_plain_valid_store_kv_cache(k_cache, v_cache, loc, k, v) -> bool:
    """True for a call of the plain form that ``_check_store_kv_cache`` accepts: no scales, the
    caches in the rows' float dtype, every size consistent, one device. Attribute reads and
    integer comparisons only; False sends the call through the full checks."""
    dtype = k.dtype
    if not (dtype in FLOAT_DTYPES and v.dtype is dtype and k_cache.dtype is dtype
            and v_cache.dtype is dtype and k.dim() == 3 and v.dim() == 3 and loc.dim() == 1
            and loc.dtype in _LOC_DTYPES and 3 <= k_cache.dim() <= 4
            and k_cache.dim() == v_cache.dim()
            and all_dense_on(k.device, (v, loc, k_cache, v_cache, k))):
        return False
    n, num_heads_kv, head_dim = k.shape
    k_shape, v_shape = k_cache.shape, v_cache.shape
    return (v.shape[0] == n and loc.shape[0] == n and v.shape[1] == num_heads_kv
            and k_shape[-2] == num_heads_kv and v_shape[-2] == num_heads_kv
            and k_shape[-1] == head_dim and v_shape[-1] == v.shape[2]
            and k_shape[:-2] == v_shape[:-2])


@define_op("xpu_ops::store_kv_cache", mutates_args=("k_cache", "v_cache"), by_device=True)
def store_kv_cache_op(k_cache: Tensor, v_cache: Tensor, loc: Tensor, k: Tensor, v: Tensor,
                      k_scale: Optional[Tensor], v_scale: Optional[Tensor]) -> None:
    """Op form of ``store_kv_cache`` (all arguments explicit); ``k``/``v`` that share memory
    with a cache are read as they were before the call (``snapshot_aliased``)."""
    if not (k_scale is None and v_scale is None
            and _is_plain_valid_store_kv_cache(k_cache, v_cache, loc, k, v)):
        _check_store_kv_cache(k_cache, v_cache, loc, k, v, k_scale, v_scale)
    sources = snapshot_aliased((k_cache, v_cache), (k, v))
    return None if sources is None else (k_cache, v_cache, loc, *sources, k_scale, v_scale)


@store_kv_cache_op.register_fake
def _(k_cache, v_cache, loc, k, v, k_scale, v_scale):
    _check_store_kv_cache(k_cache, v_cache, loc, k, v, k_scale, v_scale)


def _scale_tensor(arg: str, scale, device) -> Optional[Tensor]:
    """A per-tensor fp8 scale given as a number becomes a 1-element float32 tensor.

    Raises:
        TypeError: not a number or tensor (a string included).
        ValueError: 0, negative, infinite or NaN (rows are divided by it). A tensor scale is
            checked for the same values only under the debug checks (a host sync).
    """
    if scale is None or isinstance(scale, Tensor):
        return scale
    value = float_scalar(STORE_KV, arg, scale)
    if not 0.0 < value < math.inf:
        fail(STORE_KV, arg, "is not a positive finite number",
             "0 < scale < inf (the fp8 cache stores rows / scale)", value,
             "Use the scale the cache was calibrated with (1.0 when unscaled).")
    return torch.tensor([value], dtype=torch.float32, device=device)


def store_kv_cache(k_cache, v_cache, loc, k, v, k_scale=None, v_scale=None):
    """Write new keys/values into the token slots ``loc`` of a KV cache (in place).

    Args:
        k_cache: [slots, Hkv, D] or paged [num_pages, page_size, Hkv, D] (slot = page *
            page_size + offset), k's dtype or fp8; any strides (pages need not be adjacent).
        v_cache: same layout with Dv, same number of slots.
        loc: [N] int64 (or int32) token slot of each new token; slots must be distinct
            (which of two rows for one slot lands is unspecified). Slots outside
            ``[0, slots)`` are never written (skipped, without a host sync); with
            ``XPU_OPS_DEBUG_CHECKS=1`` (or ``xpu_ops.debug_checks()``) they raise, and so do
            duplicate slots.
        k: [N, Hkv, D], v: [N, Hkv, Dv] fp16|bf16|fp32; never modified. They may be views
            of the caches themselves (e.g. rows of ``k_cache``): every row is read as it was
            before the call, whichever slots the call overwrites.
        k_scale, v_scale: per-tensor scale (positive finite float or 1-element float32
            tensor) for fp8 caches: the cache stores ``k / k_scale`` (read back with
            ``k_descale = k_scale``). Values beyond the fp8 range saturate to its largest
            finite value (448 for e4m3fn, 57344 for e5m2), with their sign; NaN stays NaN.
    Returns:
        None. Only the slots in ``loc`` of the two caches change.
    Raises:
        TypeError/ValueError: wrong kind, shape, dtype or device, naming the argument; a
            scale that is not a positive finite number.
        ValueError: with debug checks on, a ``loc`` entry outside ``[0, slots)`` or repeated,
            or a tensor scale that is not positive and finite (the message names the rule and
            the first bad value).
    Source: sglang ``MHATokenToKVPool.set_kv_buffer`` semantics.

    >>> import torch, xpu_ops
    >>> kc, vc = torch.zeros(8, 2, 4), torch.zeros(8, 2, 4)
    >>> k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    >>> xpu_ops.store_kv_cache(kc, vc, torch.tensor([5, 1]), k, v)
    >>> torch.equal(kc[5], k[0]) and torch.equal(vc[1], v[1]) and kc[0].abs().sum().item() == 0
    True
    """
    if not tensors_or_none((k_cache, v_cache, loc, k, v)):
        check_tensor_args(STORE_KV, k_cache=k_cache, v_cache=v_cache, loc=loc, k=k, v=v)
    if k.dim() != 3 or k_scale is not None or v_scale is not None:
        check_tensor(STORE_KV, "k", k, ndim=3)
        k_scale = _scale_tensor("k_scale", k_scale, k.device)
        v_scale = _scale_tensor("v_scale", v_scale, k.device)
    _value_checks.check_store_kv_cache(loc, k_cache, k_scale, v_scale)
    torch.ops.xpu_ops.store_kv_cache(k_cache, v_cache, loc, k, v, k_scale, v_scale)


def _check_store_mla_kv_cache(kv_cache, loc, k_nope, k_rope) -> None:
    """Validate shapes/dtypes/devices (runs in the fake too); like ``store_kv_cache``, the
    argument that disagrees with the others is named."""
    fn = STORE_MLA
    check_tensor(fn, "k_nope", k_nope, ndim=3, dtypes=FLOAT_DTYPES)
    device = k_nope.device
    check_tensor(fn, "k_rope", k_rope, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    check_tensor(fn, "loc", loc, ndim=1, dtypes=_LOC_DTYPES, device=device)
    check_tensor(fn, "kv_cache", kv_cache, ndim=(3, 4), dtypes=FLOAT_DTYPES + FP8_DTYPES,
                 device=device)
    check_store_dtypes(fn, ("k_nope", k_nope, "kv_cache", kv_cache),
                       ("k_rope", k_rope, "kv_cache", kv_cache))
    check_same_size(fn, "N", ("k_nope", k_nope, 0), ("k_rope", k_rope, 0), ("loc", loc, 0))
    check_size(fn, "k_nope", k_nope, 1, 1, "one latent head")
    check_size(fn, "k_rope", k_rope, 1, 1, "one latent head")
    if kv_cache.dim() == 4:
        check_size(fn, "kv_cache", kv_cache, 2, 1, "one latent head")
    latent_dim, rope_dim = k_nope.shape[2], k_rope.shape[2]
    check_size(fn, "kv_cache", kv_cache, -1, latent_dim + rope_dim,
               f"k_nope.shape[2] + k_rope.shape[2] (R + r) = {latent_dim} + {rope_dim}")


@define_op("xpu_ops::store_mla_kv_cache", mutates_args=("kv_cache",), by_device=True)
def store_mla_kv_cache_op(kv_cache: Tensor, loc: Tensor, k_nope: Tensor, k_rope: Tensor) -> None:
    """Op form of ``store_mla_kv_cache``; ``k_nope``/``k_rope`` that share memory with the
    cache are read as they were before the call (``snapshot_aliased``)."""
    _check_store_mla_kv_cache(kv_cache, loc, k_nope, k_rope)
    sources = snapshot_aliased((kv_cache,), (k_nope, k_rope))
    return None if sources is None else (kv_cache, loc, *sources)


@store_mla_kv_cache_op.register_fake
def _(kv_cache, loc, k_nope, k_rope):
    _check_store_mla_kv_cache(kv_cache, loc, k_nope, k_rope)


def store_mla_kv_cache(kv_cache, loc, k_nope, k_rope):
    """Write ``cat(k_nope, k_rope)`` of new tokens into slots ``loc`` of an MLA cache (in place).

    Args:
        kv_cache: [slots, 1, R + r] (or [num_pages, page_size, R + r], or
            [num_pages, page_size, 1, R + r]); latent part first, then the rope part; any
            strides. An fp8 cache saturates out-of-range values (see ``store_kv_cache``).
        loc: [N] int64 (or int32) distinct token slots. Slots outside ``[0, slots)`` are never
            written (skipped); with ``XPU_OPS_DEBUG_CHECKS=1`` (or ``xpu_ops.debug_checks()``)
            they raise, and so do duplicates.
        k_nope: [N, 1, R] (or [N, R]) compressed latent; k_rope: [N, 1, r] (or [N, r]).
    Returns:
        None. Only the slots in ``loc`` change.
    Raises:
        TypeError/ValueError: wrong kind, shape, dtype or device, naming the argument.
        ValueError: with debug checks on, a ``loc`` entry outside ``[0, slots)`` or repeated.
    Source: DeepSeek-V2 (arXiv 2405.04434) latent cache; sglang ``MLATokenToKVPool``.

    >>> import torch, xpu_ops
    >>> cache = torch.zeros(4, 1, 6)
    >>> xpu_ops.store_mla_kv_cache(cache, torch.tensor([2]), torch.ones(1, 1, 4), torch.full((1, 1, 2), 2.0))
    >>> cache[2, 0].tolist()
    [1.0, 1.0, 1.0, 1.0, 2.0, 2.0]
    """
    check_tensor_args(STORE_MLA, kv_cache=kv_cache, loc=loc, k_nope=k_nope, k_rope=k_rope)
    k_nope = check_tensor(STORE_MLA, "k_nope", k_nope, ndim=(2, 3))
    k_rope = check_tensor(STORE_MLA, "k_rope", k_rope, ndim=(2, 3))
    k_nope = k_nope.unsqueeze(1) if k_nope.dim() == 2 else k_nope
    k_rope = k_rope.unsqueeze(1) if k_rope.dim() == 2 else k_rope
    _value_checks.check_store_mla_kv_cache(loc, kv_cache)
    torch.ops.xpu_ops.store_mla_kv_cache(kv_cache, loc, k_nope, k_rope)
