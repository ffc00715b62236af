"""``store_index_k_cache`` (quantise index keys to fp8, write them and their scales into the fused
cache) and ``hadamard_transform`` (a GEMM against the Hadamard matrix generated in registers).

The store encodes fp8 ``e4m3fn`` bytes itself (round to nearest even, from the float32 bits),
so every backend writes the bytes ``torch``'s conversion gives (Triton's interpreter rounds some
values differently); ``1 / scale`` is correctly rounded (``div_rn``) as the reference's is. One
program per new key; a slot outside the cache stores nothing.

The Hadamard transform multiplies ``[rows, n]`` tiles by ``H[i, j] = (-1)^popcount(i & j)``
(tensor cores for fp16/bf16 on GPUs; IEEE float32 for float32 and in the CPU interpreter, whose
bf16 products are not exact) over the zero-padded last dimension; at
the sizes DeepSeek-V3.2 uses (n = 128) the ``n^2`` products are cheaper than ``log2 n``
passes through memory. Sizes above ``MAX_HADAMARD`` go to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import provider_table
from ..index_k_layout import AMAX_FLOOR, FP8_MAX, is_dense_blocks
from ._common import available, cdiv, launch, next_pow2

MAX_HADAMARD = 1024
AMAX_FLOOR_C = tl.constexpr(AMAX_FLOOR)
FP8_MAX_C = tl.constexpr(FP8_MAX)


@triton.jit
def _e4m3_bytes(v):
    # float32 (|v| <= 448 or NaN) -> float8_e4m3fn bits, round to nearest even.
    bits = v.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.int32)
    mag = bits & 0x7FFFFFFF
    a = mag.to(tl.float32, bitcast=True)
    # normal range: round the 23-bit mantissa to 3 bits (a carry moves into the exponent)
    rounded = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0x7FF00000
    normal = ((((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7))
    # below 2**-6: multiples of 2**-9 (8 of them give the smallest normal, 0x08)
    scaled = a * 512.0
    sub = ((scaled + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a >= 0.015625, normal, sub)
    code = tl.where(a == a, code, 0x7F)
    return (sign | code).to(tl.uint8)


@triton.jit
def _store_index_k_kernel(
    K, LOC, VALUES, SCALES, stride_k, stride_loc, stride_blk, num_slots, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, UE8M0: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(LOC + t * stride_loc).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        x = tl.load(K + t * stride_k + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        amax = tl.where(tl.sum((x != x).to(tl.int32), axis=0) > 0, float("nan"), amax)
        # the floor by a comparison: tl.maximum may drop a NaN (max.f32, the interpreter's fmax)
        scale = tl.where(amax == amax, tl.maximum(amax, AMAX_FLOOR_C), amax) / FP8_MAX_C
        if UE8M0:   # round up to a power of two: a non-zero mantissa carries into the exponent
            up = ((scale.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(
                tl.float32, bitcast=True)
            scale = tl.where(scale == scale, up, scale)
        v = x * tl.math.div_rn(tl.full([], 1.0, tl.float32), scale)
        v = tl.where(v > FP8_MAX_C, FP8_MAX_C, tl.where(v < -FP8_MAX_C, -FP8_MAX_C, v))
        base = (slot // BLOCK_SIZE) * stride_blk
        row = slot % BLOCK_SIZE
        tl.store(VALUES + base + row * head_dim + offs_d, _e4m3_bytes(v), mask=mask_d)
        tl.store(SCALES + (base + BLOCK_SIZE * head_dim + row * 4) // 4, scale)



def store_index_k_cache(index_k_cache, loc, index_k, ue8m0_scale):
    """Launch ``_store_index_k_kernel``, one program per new key. A cache whose blocks are not
    dense bytes (a strided view) is stored through a contiguous copy written back."""
    n, head_dim = index_k.shape
    num_blocks, block_size = index_k_cache.shape[:2]
    if n == 0 or num_blocks * block_size == 0:
        return
    cache = index_k_cache if is_dense_blocks(index_k_cache) else index_k_cache.contiguous()
    if head_dim > 1 and index_k.stride(1) != 1:
        index_k = index_k.contiguous()
    launch(_store_index_k_kernel, (n,), index_k.device,
           index_k, loc, cache, cache.view(torch.float32),
           index_k.stride(0), loc.stride(0), cache.stride(0), num_blocks * block_size,
           head_dim, BLOCK_SIZE=block_size, BLOCK_D=next_pow2(head_dim), UE8M0=ue8m0_scale,
           num_warps=1 if head_dim <= 256 else 4)
    if cache is not index_k_cache:
        index_k_cache.copy_(cache)


@triton.jit
def _hadamard_kernel(
    X, OUT, stride_xm, stride_om, rows, dim, scale,
    N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, N, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & (offs_k[None, :] < dim), other=0.0)
        # H[k, j] = (-1)^popcount(k & j): fold the bits' parity into bit 0
        v = offs_k[:, None] & offs_n[None, :]
        v = v ^ (v >> 8)
        v = v ^ (v >> 4)
        v = v ^ (v >> 2)
        v = v ^ (v >> 1)
        if IEEE:
            h = (1 - 2 * (v & 1)).to(tl.float32)
            acc += tl.dot(x.to(tl.float32), h, input_precision="ieee")
        else:
            acc += tl.dot(x, (1 - 2 * (v & 1)).to(x.dtype))
    tl.store(OUT + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             (acc * scale).to(OUT.dtype.element_ty),
             mask=mask_m[:, None] & (offs_n[None, :] < dim))


def hadamard_transform(x, scale):
    """Launch ``_hadamard_kernel`` over ``[rows / 32, d / 64]`` tiles of the flattened rows."""
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    rows2d = x.reshape(-1, dim)
    if dim > 1 and rows2d.stride(1) != 1:
        rows2d = rows2d.contiguous()
    n = next_pow2(dim)
    block_n = min(64, max(16, n))
    ieee = x.dtype == torch.float32 or x.device.type == "cpu"   # float32 tiles: K of 32
    launch(_hadamard_kernel, (cdiv(rows2d.shape[0], 32), cdiv(dim, block_n)), x.device,
           rows2d, out.view(-1, dim), rows2d.stride(0), dim, rows2d.shape[0], dim, scale,
           N=n, BLOCK_M=32, BLOCK_N=block_n, BLOCK_K=min(32 if ieee else 64, max(16, n)),
           IEEE=ieee, num_warps=4)
    return out


def _supports_hadamard(x, scale):
    if x.shape[-1] > MAX_HADAMARD:
        return f"last dimension {x.shape[-1]} > {MAX_HADAMARD} (the n^2 kernel's limit)"
    return None


provider_table.register("store_index_k_cache", "triton", available=available)(
    store_index_k_cache)
provider_table.register("hadamard_transform", "triton", available=available,
                        supports=_supports_hadamard)(hadamard_transform)
