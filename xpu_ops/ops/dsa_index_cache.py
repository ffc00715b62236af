"""``store_index_k_cache``: quantise DSA index keys to fp8 and write them into the paged
index-key cache (layout: ``xpu_ops.index_k_layout``), as sglang's DSA index buffer stores them.

Each new key ``index_k[t]`` (``D`` features) gets one float32 scale
``s = max(amax(|index_k[t]|), 1e-4) / 448`` (with ``scale_fmt="ue8m0"`` rounded up to a power
of two, DeepSeek-V3.2's ``act_quant``), its fp8 bytes are ``float8_e4m3fn(index_k[t] * (1 / s))``
(round to nearest even; ``|value| <= 448`` by construction; NaN stays NaN), written at token
slot ``loc[t]`` with the scale. Entries of ``loc`` outside ``[0, num_blocks * block_size)``
(``-1`` included, sglang's padding) are skipped; repeated slots store one of their rows (which
one is unspecified; ``xpu_ops.debug_checks()`` rejects slots below -1 or past the cache and
repeated slots). Only the addressed slots' bytes change; every check runs before the write.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _value_checks
from .._checks import FLOAT_DTYPES, check_same_size, check_size, check_tensor, \
    check_tensor_args, fail
from .._registration import define_op
from ..index_k_layout import SCALE_BYTES
from .common import check_flag
from .kv_cache import snapshot_aliased

NAME = "store_index_k_cache"
_LOC_DTYPES = (torch.int64, torch.int32)
SCALE_FMTS = (None, "ue8m0")


def _check_store_index_k_cache(index_k_cache, loc, index_k, ue8m0_scale) -> None:
    """Validate shapes/dtypes/devices (runs in the fake too)."""
    fn = NAME
    check_tensor(fn, "index_k", index_k, ndim=2, dtypes=FLOAT_DTYPES)
    device, dim = index_k.device, index_k.shape[1]
    check_tensor(fn, "loc", loc, ndim=1, dtypes=_LOC_DTYPES, device=device)
    check_same_size(fn, "N", ("index_k", index_k, 0), ("loc", loc, 0))
    check_tensor(fn, "index_k_cache", index_k_cache, ndim=4, dtypes=(torch.uint8,),
                 device=device, fix="Pass the fused fp8 index-key cache's bytes "
                 "(.view(torch.uint8)).")
    check_size(fn, "index_k_cache", index_k_cache, 2, 1, "one index-key head")
    check_size(fn, "index_k_cache", index_k_cache, 3, dim + SCALE_BYTES,
               "index_k's D + 4 (fp8 key, float32 scale)")
    if dim % SCALE_BYTES:
        fail(fn, "index_k", "has a head dim that is not a multiple of 4", "D % 4 == 0 (the "
             "scales after a block's keys stay 4-byte aligned)", f"shape {tuple(index_k.shape)}")
    check_flag(fn, "ue8m0_scale", ue8m0_scale)


@define_op("xpu_ops::store_index_k_cache", mutates_args=("index_k_cache",), by_device=True)
def store_index_k_cache_op(index_k_cache: Tensor, loc: Tensor, index_k: Tensor,
                           ue8m0_scale: bool) -> None:
    """Op form of ``store_index_k_cache``: writes the addressed slots of ``index_k_cache``."""
    _check_store_index_k_cache(index_k_cache, loc, index_k, ue8m0_scale)
    _value_checks.check_store_index_k_cache(loc, index_k_cache)
    src = snapshot_aliased((index_k_cache,), (index_k,))
    return None if src is None else (index_k_cache, loc, src[0], ue8m0_scale)


@store_index_k_cache_op.register_fake
def _(index_k_cache, loc, index_k, ue8m0_scale):
    _check_store_index_k_cache(index_k_cache, loc, index_k, ue8m0_scale)


def store_index_k_cache(index_k_cache, loc, index_k, scale_fmt=None):
    """Quantise ``index_k`` to fp8 with one scale per token and store it at slots ``loc``.

    Rules: the module docstring (scale formula, skipped slots, nothing else written).

    Args:
        index_k_cache: [num_blocks, block_size, 1, D + 4] uint8 (or float8_e4m3fn viewed as
            its bytes), the fused index-key cache; mutated in place.
        loc: [N] int64 or int32 token slots (sglang's ``out_cache_loc``).
        index_k: [N, D] (or [N, 1, D]) fp16|bf16|fp32 new index keys (after the Hadamard
            rotation); not modified.
        scale_fmt: None (scale ``amax / 448``) or ``"ue8m0"`` (rounded up to a power of two).
    Returns:
        None.
    Raises:
        TypeError/ValueError: wrong kind, shape, dtype or device, or an unknown scale_fmt,
            naming the argument; nothing is written then.
    Source: DeepSeek-V3.2 ``act_quant`` (block 128 = the index head dim); DeepGEMM's paged
    fp8 layout; sglang's DSA index-key buffer.

    >>> import torch, xpu_ops
    >>> from xpu_ops.index_k_layout import split_blocks
    >>> cache = torch.zeros(2, 4, 1, 20, dtype=torch.uint8)
    >>> k = torch.tensor([[1.0] * 15 + [-448.0]])
    >>> xpu_ops.store_index_k_cache(cache, torch.tensor([5]), k)
    >>> values, scales = split_blocks(cache)
    >>> scales[1, 1].item(), values[1, 1].view(torch.float8_e4m3fn).float()[-1].item()
    (1.0, -448.0)
    """
    check_tensor_args(NAME, index_k_cache=index_k_cache, loc=loc, index_k=index_k)
    if scale_fmt not in SCALE_FMTS:
        fail(NAME, "scale_fmt", "is not a known scale format", "None or 'ue8m0'", repr(scale_fmt))
    if index_k.dim() == 3 and index_k.shape[1] == 1:
        index_k = index_k[:, 0]
    if index_k_cache.dtype == torch.float8_e4m3fn:
        index_k_cache = index_k_cache.view(torch.uint8)
    torch.ops.xpu_ops.store_index_k_cache(index_k_cache, loc, index_k, scale_fmt == "ue8m0")


def gather_index_k_cache(index_k_cache, slots):
    """The fp8 keys and scales stored at token ``slots`` (sglang's index-buffer read for the
    ragged ``fp8_mqa_logits`` of an extend: each request's cached and new index keys).

    Plain tensor ops on the cache with any strides (traceable, capturable, no host sync); a
    slot outside ``[0, num_blocks * block_size)`` reads as a zero key with scale 0 (its logits
    are 0, so keep such slots outside every query's ``[ks, ke)`` range).

    Args:
        index_k_cache: [num_blocks, block_size, 1, D + 4] uint8 fused cache (any strides).
        slots: [n] int32 or int64 token slots.
    Returns:
        ``(k [n, D] float8_e4m3fn, k_scale [n] float32)``, new tensors: ``fp8_mqa_logits``' kv.
    Raises:
        TypeError/ValueError: wrong kind, rank, dtype or device, naming the argument.

    >>> import torch, xpu_ops
    >>> cache = torch.zeros(2, 4, 1, 20, dtype=torch.uint8)
    >>> xpu_ops.store_index_k_cache(cache, torch.tensor([6]), torch.full((1, 16), 2.0))
    >>> k, scale = xpu_ops.gather_index_k_cache(cache, torch.tensor([6, 1, -1]))
    >>> (k.float() * scale[:, None])[:, 0].tolist(), k.dtype
    ([2.0, 0.0, 0.0], torch.float8_e4m3fn)
    """
    fn = "gather_index_k_cache"
    check_tensor_args(fn, index_k_cache=index_k_cache, slots=slots)
    check_tensor(fn, "index_k_cache", index_k_cache, ndim=4, dtypes=(torch.uint8,),
                 fix="Pass the fused fp8 index-key cache's bytes (.view(torch.uint8)).")
    check_size(fn, "index_k_cache", index_k_cache, 2, 1, "one index-key head")
    if index_k_cache.shape[3] <= SCALE_BYTES or index_k_cache.shape[3] % SCALE_BYTES:
        fail(fn, "index_k_cache", "has a last dimension that is not D + 4 with D % 4 == 0",
             "D + 4 bytes per token, D a positive multiple of 4", tuple(index_k_cache.shape))
    check_tensor(fn, "slots", slots, ndim=1, dtypes=_LOC_DTYPES, device=index_k_cache.device)
    num_blocks, block_size, _, width = index_k_cache.shape
    dim = width - SCALE_BYTES
    s = slots.long()
    inside = (s >= 0) & (s < num_blocks * block_size)
    if num_blocks * block_size == 0:
        s = s.new_zeros(s.shape)
        index_k_cache = index_k_cache.new_zeros((1, 1, 1, width))
        block_size = 1
    s = torch.where(inside, s, 0)
    block, row = (s // block_size)[:, None], (s % block_size)[:, None]
    # byte f of a block (its logical order) sits at [f // width, 0, f % width]
    value_byte = row * dim + torch.arange(dim, device=s.device)                   # [n, D]
    scale_byte = block_size * dim + row * SCALE_BYTES + torch.arange(
        SCALE_BYTES, device=s.device)                                               # [n, 4]
    k = index_k_cache[block, value_byte // width, 0, value_byte % width]
    scale = index_k_cache[block, scale_byte // width, 0, scale_byte % width]
    k = torch.where(inside[:, None], k, 0).view(torch.float8_e4m3fn)
    scale = torch.where(inside, scale.view(torch.float32)[:, 0], 0.0)
    return k, scale


__all__ = ["store_index_k_cache", "gather_index_k_cache"]
