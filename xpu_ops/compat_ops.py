"""sgl-kernel-xpu's raw op names that clients call as ``torch.ops.sgl_kernel.<name>``, on xpu-ops.

sglang's rotary embedding on XPU (``layers/rotary_embedding/base.py``) and sgl-kernel-xpu's tests
call some kernels through the dispatcher rather than through ``sgl_kernel``'s Python functions.
Importing this module defines those names in the ``sgl_kernel`` namespace as ``torch.library``
ops (schema, fake, mutations declared) whose kernels run xpu-ops' own ops. Only
``xpu_ops.compat.install_sgl_kernel_shim()`` imports it, and only when no real ``sgl_kernel``
imports (a real one defines these names itself; they must not be defined twice).

* ``sgl_kernel::rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key,
  int head_size, Tensor cos_sin_cache, bool is_neox) -> (Tensor, Tensor)``: sgl-kernel-xpu's
  schema (``src/torch_extension_sycl.cc``) with the writes declared; composed of
  ``torch.ops.xpu_ops.apply_rotary_emb`` (reference and Triton providers).
* ``sgl_kernel::fp8_paged_mqa_logits(Tensor q_fp8, Tensor kv_cache, Tensor weights,
  Tensor seq_lens, Tensor block_tables, Tensor? schedule_metadata, int max_seq_len,
  bool clean_logits) -> Tensor``: ``xpu_ops.compat_dsa.fp8_paged_mqa_logits`` (sgl-kernel-xpu's
  per-token index-key cache, 0.0 past each request), composed of
  ``torch.ops.xpu_ops.fp8_paged_mqa_logits``.
* ``sgl_kernel::gdn_attention(...) -> ()``: sgl-kernel-xpu's fused gated-delta-net layer, its
  schema with ``core_attn_out``, ``z``, ``conv_state``, ``ssm_state`` and the optional scratch
  ``workspace`` written
  (``xpu_ops.compat_gdn``), composed of ``torch.ops.xpu_ops.gdn_attention``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._checks import FLOAT_DTYPES, check_size, check_tensor, check_writable, fail, int_scalar
from ._registration import define_op
from .ops.common import check_flag

ROTARY = "rotary_embedding"
_INT32 = (-2**31, 2**31 - 1)


def _check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox) -> int:
    """Validate the call (runs in the fake too); returns the rotary dim."""
    fn = ROTARY
    check_tensor(fn, "query", query, ndim=(2, 3), dtypes=FLOAT_DTYPES)
    device, tokens = query.device, query.shape[0]
    check_tensor(fn, "key", key, ndim=query.dim(), dtypes=(query.dtype,), device=device)
    check_size(fn, "key", key, 0, tokens, "query.shape[0] (tokens)")
    check_tensor(fn, "positions", positions, dtypes=(torch.int64, torch.int32), device=device)
    if positions.numel() != tokens:
        fail(fn, "positions", "has the wrong number of elements", f"query.shape[0] = {tokens} "
             "(one position a token)", tuple(positions.shape))
    check_tensor(fn, "cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    rot_dim = cos_sin_cache.shape[1]
    head_size = int_scalar(fn, "head_size", head_size, "an int > 0")
    if head_size <= 0:
        fail(fn, "head_size", "is not positive", "an int > 0", head_size)
    check_flag(fn, "is_neox", is_neox)
    if query.dim() == 2:
        for arg, t in (("query", query), ("key", key)):
            if t.shape[1] % head_size:
                fail(fn, arg, "has a last dimension that is not a multiple of head_size",
                     f"[tokens, heads * {head_size}]", tuple(t.shape))
        width = head_size
    else:
        check_size(fn, "key", key, 2, query.shape[2], "query.shape[2] (head_size)")
        width = query.shape[2]
    if rot_dim % 2 or not 0 < rot_dim <= width:
        fail(fn, "cos_sin_cache", "has a wrong rotary dim (columns)",
             f"an even number in [2, {width}] (cos then sin halves)", rot_dim)
    if tokens and not cos_sin_cache.shape[0]:
        fail(fn, "cos_sin_cache", "has no rows", "[max_position >= 1, rot_dim] (a row per "
             "position)", tuple(cos_sin_cache.shape))
    if query.dim() == 2:
        for arg, t in (("query", query), ("key", key)):
            check_writable(fn, arg, t, "2-D inputs are rotated in place")
    return rot_dim


def _rotate(x3: Tensor, positions: Tensor, cos_sin_cache: Tensor, is_neox: bool) -> Tensor:
    """``apply_rotary_emb`` of ``x3 [tokens, heads, head]`` with the cache's halves as tables."""
    half = cos_sin_cache.shape[1] // 2
    rows = positions.reshape(-1).clamp(*_INT32).to(torch.int32)
    return torch.ops.xpu_ops.apply_rotary_emb(x3, cos_sin_cache[:, :half],
                                              cos_sin_cache[:, half:2 * half], rows,
                                              interleaved=not is_neox)


@define_op("sgl_kernel::rotary_embedding", mutates_args=("query", "key"))
def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor, head_size: int,
                     cos_sin_cache: Tensor, is_neox: bool) -> tuple[Tensor, Tensor]:
    """sgl-kernel-xpu's ``rotary_embedding`` (``torch.ops.sgl_kernel.rotary_embedding``).

    Token ``t`` at ``p = positions.flatten()[t]`` takes the angles of row ``p`` of
    ``cos_sin_cache [max_position, rot_dim]`` (cos in the first ``rot_dim / 2`` columns, sin in
    the rest) and rotates the first ``rot_dim`` features of every head of ``query`` and ``key``:
    pairs ``(x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos)``, NeoX halves (``is_neox``) or
    GPT-J's interleaved pairs. Computed in float32, rounded once to the inputs' dtype; features
    past ``rot_dim`` are unchanged; a position outside the cache takes its nearest row.

    Args:
        positions: int64|int32, ``tokens`` elements (any shape, e.g. ``[batch, seq]``).
        query, key: 2-D ``[tokens, heads * head_size]`` (rotated **in place**, as the native
            kernel does; no expanded dims; both are read before either is written, so a
            ``key`` sharing memory with ``query`` is rotated once) or 3-D ``[tokens, heads, D]`` (not modified; ``head_size`` is then
            read from ``D``); fp16|bf16|fp32, the same dtype; any strides.
        head_size: features a head (2-D inputs).
        cos_sin_cache: any float dtype; ``rot_dim`` even, at most the head size; at least one
            row when there are tokens.
        is_neox: NeoX (True) or GPT-J (False) pairs.
    Returns:
        ``(query_out, key_out)``: new contiguous tensors of the inputs' shapes holding the
        rotated values (never aliases of the inputs).
    Raises:
        TypeError/ValueError (also RuntimeError): wrong kind, rank, dtype, device or size, naming
        the argument; nothing is written then.
    Source: RoFormer (Su et al., arXiv 2104.09864); sgl-kernel-xpu ``src/sycl/Rope.cpp``
    (schema, 2-D in place / 3-D out of place).
    """
    _check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    if query.dim() == 3:
        return (_rotate(query, positions, cos_sin_cache, is_neox),
                _rotate(key, positions, cos_sin_cache, is_neox))
    # both rotations before either write: key may share memory with query (one is read after
    # the other is written otherwise), and a write happens only once both have run
    views = [x.unflatten(-1, (-1, head_size)) for x in (query, key)]
    rotated = [_rotate(x3, positions, cos_sin_cache, is_neox) for x3 in views]
    for x3, r in zip(views, rotated):
        x3.copy_(r)
    return rotated[0].view(query.shape), rotated[1].view(key.shape)


@rotary_embedding.register_fake
def _(positions, query, key, head_size, cos_sin_cache, is_neox):
    _check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    return (torch.empty_like(query, memory_format=torch.contiguous_format),
            torch.empty_like(key, memory_format=torch.contiguous_format))


@define_op("sgl_kernel::fp8_paged_mqa_logits", mutates_args=())
def fp8_paged_mqa_logits(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor, seq_lens: Tensor,
                         block_tables: Tensor, schedule_metadata: Optional[Tensor],
                         max_seq_len: int, clean_logits: bool) -> Tensor:
    """sgl-kernel-xpu's raw ``fp8_paged_mqa_logits``: ``q_fp8 [B, 1, H, D]`` fp8 bytes, the
    per-token cache ``[num_pages, page_size, 1, D + 4]``; float32 ``[B, max_seq_len]``, 0.0 past
    ``seq_lens`` (contract: ``xpu_ops.compat_dsa.fp8_paged_mqa_logits``)."""
    from . import compat_dsa
    return compat_dsa.fp8_paged_mqa_logits(q_fp8, kv_cache, weights, seq_lens, block_tables,
                                           schedule_metadata, max_seq_len, clean_logits)


@fp8_paged_mqa_logits.register_fake
def _(q_fp8, kv_cache, weights, seq_lens, block_tables, schedule_metadata, max_seq_len,
      clean_logits):
    from . import compat_dsa
    compat_dsa.check_paged_call(q_fp8, kv_cache, weights, seq_lens, block_tables, max_seq_len)
    return q_fp8.new_empty((q_fp8.shape[0], max_seq_len), dtype=torch.float32)


@define_op("sgl_kernel::gdn_attention", mutates_args=("core_attn_out", "z", "conv_state",
                                                     "ssm_state", "workspace"))
def gdn_attention(core_attn_out: Tensor, z: Tensor, projected_states_qkvz: Tensor,
                  projected_states_ba: Tensor, num_k_heads: int, num_v_heads: int,
                  head_k_dim: int, head_v_dim: int, conv_state: Tensor, ssm_state: Tensor,
                  conv_weights: Tensor, conv_bias: Optional[Tensor], activation: str,
                  A_log: Tensor, dt_bias: Tensor, num_prefills: int, num_decodes: int,
                  num_spec_decodes: int, has_initial_state: Optional[Tensor],
                  non_spec_query_start_loc: Optional[Tensor],
                  non_spec_token_indx: Optional[Tensor],
                  non_spec_state_indices_tensor: Optional[Tensor],
                  spec_query_start_loc: Optional[Tensor], spec_token_indx: Optional[Tensor],
                  spec_state_indices_tensor: Optional[Tensor],
                  num_accepted_tokens: Optional[Tensor], num_actual_tokens: int, tp_size: int,
                  reorder_input: bool, workspace: Optional[Tensor] = None) -> None:
    """sgl-kernel-xpu's raw fused ``gdn_attention`` (writes ``core_attn_out``, ``z``, both
    state pools and, when usable, the scratch ``workspace``: contract ``xpu_ops.compat_gdn``)."""
    from . import compat_gdn
    compat_gdn.gdn_attention_(
        core_attn_out, z, projected_states_qkvz, projected_states_ba, num_k_heads, num_v_heads,
        head_k_dim, head_v_dim, conv_state, ssm_state, conv_weights, conv_bias, activation,
        A_log, dt_bias, num_prefills, num_decodes, num_spec_decodes, has_initial_state,
        non_spec_query_start_loc, non_spec_token_indx, non_spec_state_indices_tensor,
        spec_query_start_loc, spec_token_indx, spec_state_indices_tensor, num_accepted_tokens,
        num_actual_tokens, tp_size, reorder_input, workspace)


@gdn_attention.register_fake
def _(*args):
    from . import compat_gdn
    compat_gdn.gdn_attention_(*args[:29], write=False)   # the checks (workspace: scratch)


#: ``torch.ops.sgl_kernel`` names this module defines.
OP_NAMES = (ROTARY, "fp8_paged_mqa_logits", "gdn_attention")

__all__ = ["OP_NAMES", "rotary_embedding", "fp8_paged_mqa_logits", "gdn_attention"]
