"""``causal_conv1d_fn`` / ``causal_conv1d_update``: depthwise causal conv1d with per-request
conv states, one channel block per program.

A request's input is the extended sequence ``e = state ++ tokens``; output ``t`` reads
``e[t : t + width]``. Entry ``j`` of ``e`` (relative to the first token, so ``j < 0`` is state
column ``width - 1 + j``) comes from one of two masked loads, never both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import provider_table
from ._common import available, cdiv, launch, next_pow2

BLOCK_T = 16
TOKEN_PROGRAMS = 1024   # token-block programs of a prefill launch, shared by its requests


@triton.jit
def _both(mask, flag):
    """``mask & flag`` for a scalar or tensor ``flag``, broadcast to ``mask``'s shape first
    (the interpreter rejects a mask that combines a tensor with a scalar bool)."""
    return mask & ((tl.zeros(mask.shape, tl.int32) + flag.to(tl.int32)) != 0)


@triton.jit
def _extended(X, STATE, x_row0, j, stride_xt, stride_xd, state_row, stride_sw, offs_d_x,
              offs_d_s, mask, read, WIDTH: tl.constexpr):
    """``e[j]`` (float32) for a vector of ``j`` (tokens) x channels: token ``j >= 0`` of x from
    row ``x_row0``, or state column ``WIDTH - 1 + j`` when ``j < 0`` and ``read``."""
    jx = tl.maximum(j, 0).to(tl.int64)
    js = tl.maximum(j + WIDTH - 1, 0).to(tl.int64)
    xv = tl.load(X + (x_row0 + jx) * stride_xt + offs_d_x * stride_xd,
                 mask=_both(mask, j >= 0), other=0.0)
    sv = tl.load(STATE + state_row + js * stride_sw + offs_d_s,
                 mask=_both(_both(mask, j < 0), read), other=0.0)
    return xv.to(tl.float32) + sv.to(tl.float32)


@triton.jit
def _conv_tokens(X, STATE, W, BIAS, x_row0, pos, mask, stride_xt, stride_xd, state_row,
                 stride_sw, offs_d_x, offs_d_s, offs_d, mask_d, stride_wd, stride_ww, stride_b,
                 read,
                 WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """Outputs (float32) of the tokens at positions ``pos`` (broadcast against channels)."""
    acc = tl.zeros(mask.shape, tl.float32)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_d * stride_b, mask=mask_d, other=0.0).to(tl.float32)
    for w in tl.static_range(WIDTH):
        tap = tl.load(W + offs_d * stride_wd + w * stride_ww, mask=mask_d, other=0.0)
        acc += tap.to(tl.float32) * _extended(X, STATE, x_row0, pos + w - (WIDTH - 1), stride_xt,
                                              stride_xd, state_row, stride_sw, offs_d_x, offs_d_s,
                                              mask, read, WIDTH)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    return acc


@triton.jit
def _write_state(X, STATE, x_row0, length, stride_xt, stride_xd, state_row, stride_sw, offs_d,
                 stride_sd, mask_d, read, valid, WIDTH: tl.constexpr):
    """New state column ``c`` = ``e[length - (WIDTH - 1) + c]``, in increasing ``c``: column
    ``c`` is written after the (higher or equal) column it reads, so no read sees a new value."""
    for c in tl.static_range(WIDTH - 1):
        value = _extended(X, STATE, x_row0, length - (WIDTH - 1) + c, stride_xt, stride_xd,
                          state_row, stride_sw, offs_d, offs_d * stride_sd, mask_d, read, WIDTH)
        tl.store(STATE + state_row + c * stride_sw + offs_d * stride_sd,
                 value.to(STATE.dtype.element_ty), mask=_both(mask_d, valid))


@triton.jit
def _slot_of(SLOTS, r, stride_slot, num_slots, HAS_SLOTS: tl.constexpr):
    """``(slot as int64, 0 when invalid; valid)`` of request ``r``."""
    if HAS_SLOTS:
        slot = tl.load(SLOTS + r * stride_slot)
    else:
        slot = r
    valid = (slot >= 0) & (slot < num_slots)
    return tl.where(valid, slot, 0).to(tl.int64), valid


@triton.jit
def _conv_fn_kernel(
    X, W, BIAS, STATE, QSL, SLOTS, INIT, OUT,
    stride_xt, stride_xd, stride_wd, stride_ww, stride_b, stride_ss, stride_sd, stride_sw,
    stride_q, stride_slot, stride_init, total, dim, num_slots,
    WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    # Grid (b, token-block programs, channel blocks): outputs only. Program p of a request
    # takes its token blocks p, p + P, p + 2P, ... (P = the grid's second size), so any
    # request length is covered without knowing the longest on the host.
    r = tl.program_id(0)
    start = tl.minimum(tl.maximum(tl.load(QSL + r * stride_q), 0), total)
    end = tl.minimum(tl.maximum(tl.load(QSL + (r + 1) * stride_q), 0), total)
    length = tl.maximum(end - start, 0)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    slot, valid = _slot_of(SLOTS, r, stride_slot, num_slots, True)
    read = valid & (tl.load(INIT + r * stride_init) != 0)
    for block in range(tl.program_id(1), tl.cdiv(length, BLOCK_T), tl.num_programs(1)):
        pos = block * BLOCK_T + tl.arange(0, BLOCK_T)
        mask = (pos < length)[:, None] & mask_d[None, :]
        acc = _conv_tokens(X, STATE, W, BIAS, start.to(tl.int64), pos[:, None], mask, stride_xt,
                           stride_xd, slot * stride_ss, stride_sw, offs_d[None, :],
                           offs_d[None, :] * stride_sd, offs_d[None, :], mask_d[None, :],
                           stride_wd, stride_ww, stride_b, read, WIDTH, HAS_BIAS, SILU)
        rows = (start + pos).to(tl.int64)
        tl.store(OUT + rows[:, None] * dim + offs_d[None, :], acc.to(OUT.dtype.element_ty),
                 mask=mask)


@triton.jit
def _conv_fn_state_kernel(
    X, STATE, QSL, SLOTS, INIT,
    stride_xt, stride_xd, stride_ss, stride_sd, stride_sw, stride_q, stride_slot, stride_init,
    total, dim, num_slots,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Grid (b, channel blocks), after the outputs: each request's new state.
    r = tl.program_id(0)
    start = tl.minimum(tl.maximum(tl.load(QSL + r * stride_q), 0), total)
    end = tl.minimum(tl.maximum(tl.load(QSL + (r + 1) * stride_q), 0), total)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    slot, valid = _slot_of(SLOTS, r, stride_slot, num_slots, True)
    read = valid & (tl.load(INIT + r * stride_init) != 0)
    length = tl.maximum(end - start, 0) + offs_d * 0
    _write_state(X, STATE, start.to(tl.int64), length, stride_xt, stride_xd,
                 slot * stride_ss, stride_sw, offs_d, stride_sd, offs_d < dim, read, valid, WIDTH)


@triton.jit
def _conv_update_kernel(
    X, W, BIAS, STATE, SLOTS, OUT,
    stride_xb, stride_xs, stride_xd, stride_wd, stride_ww, stride_b, stride_ss, stride_sd,
    stride_sw, stride_slot, seqlen, dim, num_slots,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
):
    # Grid (b, channel blocks): the request's s tokens in order, then its new state.
    r = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    slot, valid = _slot_of(SLOTS, r, stride_slot, num_slots, HAS_SLOTS)
    row_x = X + r.to(tl.int64) * stride_xb
    for t in range(0, seqlen):
        acc = _conv_tokens(row_x, STATE, W, BIAS, 0, t + offs_d * 0, mask_d, stride_xs, stride_xd,
                           slot * stride_ss, stride_sw, offs_d, offs_d * stride_sd, offs_d,
                           mask_d, stride_wd, stride_ww, stride_b, valid, WIDTH, HAS_BIAS, SILU)
        tl.store(OUT + (r.to(tl.int64) * seqlen + t) * dim + offs_d,
                 acc.to(OUT.dtype.element_ty), mask=mask_d)
    _write_state(row_x, STATE, 0, seqlen + offs_d * 0, stride_xs, stride_xd, slot * stride_ss,
                 stride_sw, offs_d, stride_sd, mask_d, valid, valid, WIDTH)


def _block_d(dim: int) -> int:
    return min(128, next_pow2(dim))


@provider_table.register("causal_conv1d_fn", "triton", available=available)
def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices,
                     has_initial_state, activation):
    """Triton ``causal_conv1d_fn`` (contract: ``xpu_ops/ops/causal_conv1d.py``): outputs over
    (request, token-block program, channel block), about ``TOKEN_PROGRAMS`` token-block
    programs shared by the requests (each strides over its request's blocks), then one state
    launch (every state read before any write)."""
    total, dim = x.shape
    batch, width = cache_indices.shape[0], weight.shape[1]
    out = x.new_zeros((total, dim))
    if batch == 0 or dim == 0:
        return out
    block_d = _block_d(dim)
    bias_arg = bias if bias is not None else weight
    if total:
        programs = min(cdiv(total, BLOCK_T), max(1, TOKEN_PROGRAMS // batch))
        launch(_conv_fn_kernel, (batch, programs, cdiv(dim, block_d)), x.device,
               x, weight, bias_arg, conv_states, query_start_loc, cache_indices,
               has_initial_state, out, x.stride(0), x.stride(1), weight.stride(0),
               weight.stride(1), bias.stride(0) if bias is not None else 0,
               conv_states.stride(0), conv_states.stride(1),
               conv_states.stride(2), query_start_loc.stride(0), cache_indices.stride(0),
               has_initial_state.stride(0), total, dim, conv_states.shape[0], WIDTH=width,
               BLOCK_T=BLOCK_T, BLOCK_D=block_d, HAS_BIAS=bias is not None,
               SILU=activation is not None, num_warps=4)
    if width > 1:
        launch(_conv_fn_state_kernel, (batch, cdiv(dim, block_d)), x.device, x, conv_states,
               query_start_loc, cache_indices, has_initial_state, x.stride(0), x.stride(1),
               conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
               query_start_loc.stride(0), cache_indices.stride(0), has_initial_state.stride(0),
               total, dim, conv_states.shape[0], WIDTH=width, BLOCK_D=block_d, num_warps=4)
    return out


@provider_table.register("causal_conv1d_update", "triton", available=available)
def causal_conv1d_update(x, conv_state, weight, bias, activation, conv_state_indices):
    """Triton ``causal_conv1d_update`` (contract: ``xpu_ops/ops/causal_conv1d.py``): one
    program per (request, channel block) runs the request's tokens in order and then writes
    its state (the decode hot path: one launch)."""
    xs = x if x.dim() == 3 else x[:, None, :]
    batch, seqlen, dim = xs.shape
    out = torch.empty((batch, seqlen, dim), dtype=x.dtype, device=x.device)
    if batch == 0 or dim == 0:
        return out.reshape(x.shape)
    block_d = _block_d(dim)
    slots = conv_state_indices if conv_state_indices is not None else conv_state
    launch(_conv_update_kernel, (batch, cdiv(dim, block_d)), x.device, xs, weight,
           bias if bias is not None else weight, conv_state, slots, out, xs.stride(0),
           xs.stride(1), xs.stride(2), weight.stride(0), weight.stride(1),
           bias.stride(0) if bias is not None else 0, conv_state.stride(0),
           conv_state.stride(1), conv_state.stride(2),
           conv_state_indices.stride(0) if conv_state_indices is not None else 0, seqlen, dim,
           conv_state.shape[0], WIDTH=weight.shape[1], BLOCK_D=block_d,
           HAS_BIAS=bias is not None, SILU=activation is not None,
           HAS_SLOTS=conv_state_indices is not None, num_warps=4)
    return out.reshape(x.shape)
