"""``gdn_attention`` through sgl-kernel-xpu's fused native ``gdn_attention`` (conv, gating and
delta rule of one gated-delta-net layer in one call; Intel Xe2).

Argument mapping (the op's validated arguments -> the native schema, as sglang 0.5.23's
``XpuGDNAttnBackend.forward_fused_gdn`` calls it):

* ``projected_states_qkvz = [mixed_qkv | z]`` and ``projected_states_ba = [b | a]`` with
  ``reorder_input=True`` (each part head-major, Qwen3.5's split projections concatenated). The
  native op copies the ``z`` part into its ``z`` output only; this op has no ``z``, so that part
  is scratch and the native ``z`` output is dropped.
* The states go through staging rows, gathered by ``cache_indices`` and written back after the
  call: the native op reads ``conv_state`` as ``[cache, width - 1, dim]`` (a transposed view of
  the gathered ``[b, dim, width - 1]`` rows) and ``ssm_state`` as ``[cache, Hv, V, K]`` with
  each slot contiguous, this package's pool holds ``[num_slots, Hv, K, V]``; the native state
  indices are then ``0 .. b - 1``. A slot of -1 (or outside the pool) stages zeros with
  ``has_initial_state`` False and writes nothing back: its write-back row is redirected to the
  first valid request's slot with that request's values (no host sync, so a captured step
  keeps working).
* ``num_decodes = b`` for a ``decode`` call (the native decode kernels), else ``num_prefills =
  b`` (its chunked kernels); ``num_spec_decodes = 0``; ``tp_size = 1`` (heads already
  per-rank); ``A_log`` as float32, the conv weights, bias, window and ``dt_bias`` in the
  projections' dtype, as the native op reads them; no workspace (the native op allocates its scratch per call).

Declined (``supports``; the call then runs on ``triton``): float32 projections (the chunked
kernels serve fp16/bf16), a conv pool in another dtype than the projections (the native conv
reads its window in the projections' dtype: a float32 pool would lose its low bits, and a
request without a slot would round the redirected slot's state), no activation, a conv width
outside 1..5, ``K`` not 32, 64, 128 or 256, ``V`` not a multiple of 4. An empty pool (every
slot -1) stages zeros and writes nothing; a call without requests returns zeros (as the
reference does for tokens outside every request) without calling the native op, which indexes
``ssm_state[0]``; one whose requests hold no token zeroes the fresh requests' slots without it. Tested on the CPU against a stand-in of the native op
(``tests/ops/native_sgl_kernel.py``), never on an Intel GPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import provider_table
from . import native

_HEAD_K_DIMS = (32, 64, 128, 256)


def supports(mixed_qkv, a, b, conv_weights, conv_bias, A_log, dt_bias, conv_states, ssm_states,
             query_start_loc, cache_indices, has_initial_state, num_k_heads, head_k_dim,
             activation, decode) -> Optional[str]:
    """None when the native kernels serve the call, else why not."""
    if mixed_qkv.dtype not in (torch.float16, torch.bfloat16):
        return f"projections in {mixed_qkv.dtype} (the native chunked kernels serve fp16/bf16)"
    if conv_states.dtype != mixed_qkv.dtype:
        return (f"conv_states in {conv_states.dtype}, projections in {mixed_qkv.dtype} (the "
                "native conv reads its window in the projections' dtype)")
    if activation is None:
        return "no conv activation (the native conv applies silu)"
    if not 1 <= conv_weights.shape[1] <= 5:
        return f"conv width {conv_weights.shape[1]} (the native conv serves 1 to 5)"
    if head_k_dim not in _HEAD_K_DIMS:
        return f"head_k_dim {head_k_dim} (the native rule serves {_HEAD_K_DIMS})"
    if ssm_states.shape[3] % 4:
        return f"head_v_dim {ssm_states.shape[3]} (the native rule needs a multiple of 4)"
    return None


def _staged(pool: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``pool[slots]`` (rows of invalid slots zero), a fresh tensor (zeros from an empty
    pool, whose every slot is invalid)."""
    if pool.shape[0] == 0:
        return pool.new_zeros((slots.shape[0], *pool.shape[1:]))
    rows = pool.index_select(0, slots)
    return torch.where(valid.view(-1, *([1] * (rows.dim() - 1))), rows, 0)


def _write_back(pool: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor,
                rows: torch.Tensor) -> None:
    """``pool[slots[r]] = rows[r]`` for the valid requests only, without a host sync: invalid
    rows rewrite the first valid request's slot with its own values (or, with none valid,
    slot ``slots[0]`` with its old contents)."""
    first = torch.argmax(valid.to(torch.int32))          # 0 when none is valid
    any_valid = valid[first]
    target = torch.where(valid, slots, slots[first])
    fallback = torch.where(any_valid, rows[first], pool[slots[first]].to(rows.dtype))
    shape = (-1, *([1] * (rows.dim() - 1)))
    pool.index_copy_(0, target, torch.where(valid.view(shape), rows, fallback).to(pool.dtype))


def _without_tokens(pools, slots: torch.Tensor, valid: torch.Tensor,
                    initial: torch.Tensor) -> None:
    """A call whose requests hold no token: each request with a slot ends at its initial
    state, its own (``has_initial_state``) or zeros, as the reference's conv and rule leave it."""
    for pool in pools:
        if pool.shape[0]:
            _write_back(pool, slots, valid, _staged(pool, slots, initial))


def available(device_type: str) -> Optional[str]:
    """None when the native ``gdn_attention`` has a kernel for ``device_type``, else why not."""
    return native.unavailable("gdn_attention", device_type)


@provider_table.register("gdn_attention", "sgl_kernel", available=available, supports=supports)
def gdn_attention(mixed_qkv, a, b, conv_weights, conv_bias, A_log, dt_bias, conv_states,
                  ssm_states, query_start_loc, cache_indices, has_initial_state, num_k_heads,
                  head_k_dim, activation, decode):
    """sgl_kernel ``gdn_attention`` (contract: ``xpu_ops/ops/gdn_attention.py``; mapping: the
    module docstring)."""
    tokens, hv = mixed_qkv.shape[0], a.shape[1]
    v_dim, batch = ssm_states.shape[3], cache_indices.shape[0]
    dtype, device = mixed_qkv.dtype, mixed_qkv.device
    num_slots = ssm_states.shape[0]
    if batch == 0:  # no request: nothing to run (the native op indexes ssm_state[0]) or write
        return mixed_qkv.new_zeros((tokens, hv, v_dim))
    slots = cache_indices.long()
    valid = (slots >= 0) & (slots < num_slots)
    slots = torch.where(valid, slots, 0)
    initial = (torch.ones_like(has_initial_state) if decode else has_initial_state) & valid
    if tokens == 0:  # requests without a token: nothing to run (the native op needs tokens)
        _without_tokens((conv_states, ssm_states), slots, valid, initial)
        return mixed_qkv.new_empty((0, hv, v_dim))
    conv_rows = _staged(conv_states, slots, valid).to(dtype)            # [b, dim, width - 1]
    ssm_rows = _staged(ssm_states, slots, valid).transpose(-1, -2).contiguous()  # [b, Hv, V, K]
    qkvz = torch.cat([mixed_qkv, mixed_qkv.new_zeros((tokens, hv * v_dim))], dim=1)
    ba = torch.cat([b.to(dtype), a.to(dtype)], dim=1)
    core = mixed_qkv.new_empty((tokens, hv, v_dim))
    native.packet("gdn_attention").default(
        core, torch.empty_like(core), qkvz, ba, num_k_heads, hv, head_k_dim, v_dim,
        conv_rows.transpose(1, 2), ssm_rows, conv_weights.to(dtype).contiguous(),
        None if conv_bias is None else conv_bias.to(dtype).contiguous(), activation,
        A_log.float().contiguous(), dt_bias.to(dtype).contiguous(),
        0 if decode else batch, batch if decode else 0, 0, initial.contiguous(),
        query_start_loc.contiguous(), None,
        torch.arange(batch, dtype=torch.int32, device=device), None, None, None, None, tokens,
        1, True, None)
    if num_slots:                    # an empty pool has no slot to write
        _write_back(conv_states, slots, valid, conv_rows)
        _write_back(ssm_states, slots, valid, ssm_rows.transpose(-1, -2))
    return core
