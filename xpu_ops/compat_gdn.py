"""sgl-kernel-xpu's fused ``gdn_attention`` (the shim's ``sgl_kernel.gdn_attention`` and
``torch.ops.sgl_kernel.gdn_attention``) as an adapter onto ``xpu_ops.gdn_attention``.

The native op (``src/torch_extension_sycl.cc``; ``src/sycl/gdn_attn/``) runs one gated-delta-net
layer's core for a batch: the causal conv, the gating and the delta rule, writing
``core_attn_out`` and ``z`` and updating both state pools in place. This module maps its
arguments onto xpu-ops' op, which computes the same layer (no new math here):

* ``projected_states_qkvz`` holds ``q | k | v | z``: part by part with ``reorder_input``
  (sglang's Qwen3.5 split projections), else per key-head group (Qwen3-Next's fused projection:
  for each key head its ``q, k`` and its group's ``v, z``); ``projected_states_ba`` likewise
  ``b | a``. ``split_projections`` takes them apart; ``z`` is copied to the ``z`` output.
* The native pools are ``conv_state [cache, width - 1, dim]`` (any strides: sglang passes a
  transposed view of its ``[cache, dim, width - 1]`` pool) and ``ssm_state [cache, Hv, V, K]``;
  xpu-ops' are ``[num_slots, dim, width - 1]`` and ``[num_slots, Hv, K, V]``: the last two
  dimensions of each are swapped (views, so the updates land in the caller's pools).
* Heads are per rank: ``num_k_heads / tp_size`` and ``num_v_heads / tp_size``.
* ``num_prefills == 0`` (decode only) runs xpu-ops' decode path (one token per request); else
  the chunked path over every request. ``has_initial_state`` None: every request continues
  from its state. A slot of -1 (the native pad slot) runs from zeros and writes no state.
* Only the first ``num_actual_tokens`` rows are read and written (rows past them, a padded
  capture's, are left as they are).

* ``ssm_state`` may be float32, float16 or bfloat16 (the native op's state types): a
  16-bit pool's addressed slots are staged in float32 for the call and rounded back (pad slots
  untouched).
* ``workspace`` (the raw op's last argument, sgl-kernel-xpu's optional scratch buffer): a 1-D
  contiguous uint8 tensor on the projections' device of at least ``gdn_workspace_bytes`` bytes
  holds the call's conv input (``q | k | v``, ``[T, 2 Hk K + Hv V]``); anything else (None, too
  small, another dtype) is ignored and the call allocates, as the native op falls back.
  ``gdn_attention`` (the wrapper) keeps one such buffer per device in ``_gdn_ws_cache``,
  grow-only (regrown with 1.25x headroom, reused when large enough), as sgl-kernel-xpu's
  ``python/sgl_kernel/gdn_attn.py`` does; a rejected call leaves the cache as it was.

Not served (ValueError): speculative decodes (``num_spec_decodes > 0``, the ``spec_*``
arguments, ``num_accepted_tokens``) and ``non_spec_token_indx`` (a gather of the non-speculative
tokens, used only next to speculative ones); sglang's XPU backend passes neither.
"""

from __future__ import annotations


import torch
from torch import Tensor

from ._checks import (FLOAT_DTYPES, check_size, check_tensor, check_tensor_args,
                      check_writable, fail, int_scalar)
from .ops.common import check_cu_seqlens, check_flag, check_index

FN = "gdn_attention"
_SPEC_ARGS = ("spec_query_start_loc", "spec_token_indx", "spec_state_indices_tensor",
              "num_accepted_tokens", "non_spec_token_indx")


def split_projections(qkvz: Tensor, ba: Tensor, hk: int, hv: int, k_dim: int, v_dim: int,
                      reorder: bool) -> tuple[Tensor, ...]:
    """``q, k [T, Hk, K]``, ``v, z [T, Hv, V]``, ``b, a [T, Hv]`` from sgl-kernel-xpu's
    projection layouts (``reorder``: part by part, else per key-head group); views where the
    layout allows."""
    t, g = qkvz.shape[0], hv // hk
    if reorder:
        q, k, v, z = qkvz.split([hk * k_dim, hk * k_dim, hv * v_dim, hv * v_dim], dim=1)
        b, a = ba.split([hv, hv], dim=1)
    else:
        group = 2 * k_dim + 2 * g * v_dim       # explicit: a view of 0 rows cannot infer it
        q, k, v, z = qkvz.view(t, hk, group).split([k_dim, k_dim, g * v_dim, g * v_dim], dim=2)
        b, a = ba.view(t, hk, 2 * g).split([g, g], dim=2)
    return (q.reshape(t, hk, k_dim), k.reshape(t, hk, k_dim), v.reshape(t, hv, v_dim),
            z.reshape(t, hv, v_dim), b.reshape(t, hv), a.reshape(t, hv))


def _heads(num_k_heads, num_v_heads, tp_size) -> tuple[int, int]:
    """Per-rank ``(Hk, Hv)``."""
    hk = int_scalar(FN, "num_k_heads", num_k_heads, "an int >= 1")
    hv = int_scalar(FN, "num_v_heads", num_v_heads, "an int >= 1")
    tp = int_scalar(FN, "tp_size", tp_size, "an int >= 1")
    if tp < 1 or hk < tp or hv < tp or hk % tp or hv % tp:
        fail(FN, "tp_size", "does not divide the head counts", "an int >= 1 dividing "
             f"num_k_heads={hk} and num_v_heads={hv}", tp)
    hk, hv = hk // tp, hv // tp
    if hv % hk:
        fail(FN, "num_v_heads", "is not a multiple of num_k_heads", "num_v_heads a multiple "
             f"of num_k_heads={hk * tp}", hv * tp)
    return hk, hv


def _check_counts(num_prefills, num_decodes, num_spec_decodes, num_actual_tokens, spec) -> int:
    """The batch ``b = num_prefills + num_decodes`` (non-speculative calls only)."""
    counts = [int_scalar(FN, arg, value, "an int >= 0") for arg, value in
              (("num_prefills", num_prefills), ("num_decodes", num_decodes),
               ("num_spec_decodes", num_spec_decodes), ("num_actual_tokens", num_actual_tokens))]
    for arg, value in zip(("num_prefills", "num_decodes", "num_spec_decodes",
                           "num_actual_tokens"), counts):
        if value < 0:
            fail(FN, arg, "is negative", "an int >= 0", value)
    if counts[2]:
        fail(FN, "num_spec_decodes", "is not 0", "0 (speculative decodes are not served by "
             "xpu-ops' shim)", counts[2])
    for arg, value in zip(_SPEC_ARGS, spec):
        if value is not None:
            fail(FN, arg, "is given", "None (the shim serves non-speculative calls over all "
                 "num_actual_tokens tokens)", type(value).__name__)
    return counts[0] + counts[1]


def _check_projections(qkvz, ba, hk, hv, head_k_dim, head_v_dim, tokens) -> tuple[int, int]:
    """``(K, V)``; the projections hold ``tokens`` rows of the native widths."""
    k_dim = int_scalar(FN, "head_k_dim", head_k_dim, "an int >= 1")
    v_dim = int_scalar(FN, "head_v_dim", head_v_dim, "an int >= 1")
    if k_dim < 1 or v_dim < 1:
        fail(FN, "head_k_dim/head_v_dim", "are not positive", "ints >= 1", (k_dim, v_dim))
    check_tensor(FN, "projected_states_qkvz", qkvz, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(FN, "projected_states_ba", ba, ndim=2, dtypes=FLOAT_DTYPES, device=qkvz.device)
    for arg, t, width, rule in (
            ("projected_states_qkvz", qkvz, 2 * hk * k_dim + 2 * hv * v_dim,
             "2 Hk K + 2 Hv V (per-rank heads)"),
            ("projected_states_ba", ba, 2 * hv, "2 Hv (per-rank heads)")):
        check_size(FN, arg, t, 1, width, rule)
        if t.shape[0] < tokens:
            fail(FN, arg, "has fewer rows than num_actual_tokens", f">= {tokens} rows",
                 f"shape {tuple(t.shape)}")
    return k_dim, v_dim


def _check_outputs(core_attn_out, z, qkvz, hv, v_dim, tokens) -> None:
    """Both outputs ``[rows >= tokens, Hv, V]`` in the projections' dtype, writable."""
    for arg, t in (("core_attn_out", core_attn_out), ("z", z)):
        check_tensor(FN, arg, t, ndim=3, dtypes=(qkvz.dtype,), device=qkvz.device)
        if t.shape[0] < tokens or tuple(t.shape[1:]) != (hv, v_dim):
            fail(FN, arg, "has the wrong shape", f"[rows >= num_actual_tokens = {tokens}, "
                 f"Hv = {hv}, head_v_dim = {v_dim}]", tuple(t.shape))
        check_writable(FN, arg, t)


def _check_states(conv_state, ssm_state, conv_weights, device, hk, hv, k_dim, v_dim) -> None:
    """The native pool layouts: ``conv_state [cache, width - 1, dim]``, ``ssm_state [cache, Hv,
    V, K]`` (fp32|fp16|bf16), named as this call names them (the rest is checked by
    ``xpu_ops.gdn_attention``)."""
    check_tensor(FN, "conv_state", conv_state, ndim=3, dtypes=FLOAT_DTYPES, device=device)
    check_size(FN, "conv_state", conv_state, 2, 2 * hk * k_dim + hv * v_dim,
               "2 Hk K + Hv V (the conv channels)")
    if isinstance(conv_weights, Tensor) and conv_weights.dim() == 2:
        check_size(FN, "conv_state", conv_state, 1, conv_weights.shape[1] - 1,
                   "conv_weights.shape[1] - 1 (width - 1)")
    check_tensor(FN, "ssm_state", ssm_state, ndim=4, dtypes=FLOAT_DTYPES, device=device)
    for dim, size, rule in ((1, hv, "Hv"), (2, v_dim, "head_v_dim"), (3, k_dim, "head_k_dim")):
        check_size(FN, "ssm_state", ssm_state, dim, size, rule + " ([cache, Hv, V, K])")


def _check_batch(qsl, state_indices, has_initial_state, device, batch, tokens,
                 decode_only) -> None:
    """The per-request metadata of ``batch`` requests over ``tokens`` tokens."""
    check_cu_seqlens(FN, "non_spec_query_start_loc", qsl, batch, device)
    check_index(FN, "non_spec_state_indices_tensor", state_indices, 1, device)
    check_size(FN, "non_spec_state_indices_tensor", state_indices, 0, batch,
               "num_prefills + num_decodes")
    if has_initial_state is not None:
        check_tensor(FN, "has_initial_state", has_initial_state, ndim=1, dtypes=(torch.bool,),
                     device=device)
        check_size(FN, "has_initial_state", has_initial_state, 0, batch,
                   "num_prefills + num_decodes")
    if decode_only and tokens != batch:
        fail(FN, "num_decodes", "does not match the tokens of a decode-only call",
             f"num_actual_tokens = {tokens} (one token a request)", batch)


def gdn_workspace_bytes(tokens: int, hk: int, hv: int, k_dim: int, v_dim: int,
                        dtype: torch.dtype) -> int:
    """Bytes of ``workspace`` a call of ``tokens`` tokens stages its conv input in: ``tokens x
    (2 Hk K + Hv V)`` elements of the projections' ``dtype`` (per-rank heads); 0 for no token.

    >>> gdn_workspace_bytes(3, 1, 2, 4, 4, torch.bfloat16)
    96
    """
    return max(0, tokens) * (2 * hk * k_dim + hv * v_dim) * dtype.itemsize


def _staging(workspace, tokens: int, width: int, dtype: torch.dtype, device) -> Tensor | None:
    """``[tokens, width]`` of ``dtype`` at the start of ``workspace`` when it is usable (a 1-D
    contiguous uint8 tensor on ``device`` with room for it), else None (the call allocates)."""
    nbytes = tokens * width * dtype.itemsize
    usable = (isinstance(workspace, Tensor) and workspace.dim() == 1
              and workspace.dtype == torch.uint8 and workspace.is_contiguous()
              and workspace.device == device and workspace.numel() >= nbytes)
    return workspace[:nbytes].view(dtype).view(tokens, width) if usable and nbytes else None


def _stage_states(conv_state: Tensor, ssm_state: Tensor, slots: Tensor) -> tuple[Tensor, ...]:
    """The addressed slots of both pools, copied (the ssm states as float32): ``(conv [b, width
    - 1, dim], ssm [b, Hv, V, K], compact slot per request (-1 where its slot is outside the
    pools), which requests address them)``. The op takes one slot index for both pools."""
    cache = min(ssm_state.shape[0], conv_state.shape[0])
    inside = (slots >= 0) & (slots < cache)
    rows = slots.clamp(0, max(cache - 1, 0)).long()
    compact = torch.where(inside, torch.arange(slots.shape[0], dtype=slots.dtype,
                                               device=slots.device), -1)
    if cache == 0:                      # no slot to read: every request runs from zeros
        return (conv_state.new_zeros((slots.shape[0], *conv_state.shape[1:])),
                ssm_state.new_zeros((slots.shape[0], *ssm_state.shape[1:]), dtype=torch.float32),
                compact, inside)
    return (conv_state.index_select(0, rows), ssm_state.index_select(0, rows).float(),
            compact, inside)


def _unstage_states(conv_state, ssm_state, slots, conv, ssm, inside) -> None:
    """Write the staged slots back into the caller's pools (rounded to their dtypes)."""
    rows = inside.nonzero().squeeze(1)
    dest = slots[rows].long()
    conv_state.index_copy_(0, dest, conv[rows])
    ssm_state.index_copy_(0, dest, ssm[rows].to(ssm_state.dtype))


def gdn_attention_(core_attn_out, z, projected_states_qkvz, projected_states_ba, num_k_heads,
                   num_v_heads, head_k_dim, head_v_dim, conv_state, ssm_state, conv_weights,
                   conv_bias, activation, A_log, dt_bias, num_prefills, num_decodes,
                   num_spec_decodes, has_initial_state, non_spec_query_start_loc,
                   non_spec_token_indx, non_spec_state_indices_tensor, spec_query_start_loc,
                   spec_token_indx, spec_state_indices_tensor, num_accepted_tokens,
                   num_actual_tokens, tp_size, reorder_input, workspace=None,
                   write=True) -> None:
    """The raw op's body (contract: the module docstring); ``write=False`` runs every check
    (the fake) and writes nothing of its own."""
    batch = _check_counts(num_prefills, num_decodes, num_spec_decodes, num_actual_tokens,
                          (spec_query_start_loc, spec_token_indx, spec_state_indices_tensor,
                           num_accepted_tokens, non_spec_token_indx))
    hk, hv = _heads(num_k_heads, num_v_heads, tp_size)
    tokens, qkvz = int(num_actual_tokens), projected_states_qkvz
    k_dim, v_dim = _check_projections(qkvz, projected_states_ba, hk, hv, head_k_dim,
                                      head_v_dim, tokens)
    _check_outputs(core_attn_out, z, qkvz, hv, v_dim, tokens)
    _check_states(conv_state, ssm_state, conv_weights, qkvz.device, hk, hv, k_dim, v_dim)
    reorder = check_flag(FN, "reorder_input", reorder_input)
    if batch == 0:
        if tokens:
            fail(FN, "num_actual_tokens", "is not 0 for a call without requests",
                 "0 when num_prefills + num_decodes == 0", tokens)
        return
    _check_batch(non_spec_query_start_loc, non_spec_state_indices_tensor, has_initial_state,
                 qkvz.device, batch, tokens, num_prefills == 0)
    q, k, v, z_part, b, a = split_projections(qkvz[:tokens], projected_states_ba[:tokens], hk,
                                              hv, k_dim, v_dim, reorder)
    parts = [q.flatten(1), k.flatten(1), v.flatten(1)]
    width = 2 * hk * k_dim + hv * v_dim
    buf = _staging(workspace, tokens, width, qkvz.dtype, qkvz.device) if write else None
    mixed_qkv = torch.cat(parts, dim=1) if buf is None else torch.cat(parts, dim=1, out=buf)
    initial = (torch.ones(batch, dtype=torch.bool, device=qkvz.device)
               if has_initial_state is None else has_initial_state)
    conv, ssm, slots = conv_state, ssm_state, non_spec_state_indices_tensor
    if ssm_state.dtype != torch.float32 and write:     # the op's states are float32
        conv, ssm, slots, inside = _stage_states(conv_state, ssm_state, slots)
    elif ssm_state.dtype != torch.float32:             # the fake: a float32 stand-in
        ssm = torch.empty_like(ssm_state, dtype=torch.float32)
    o = torch.ops.xpu_ops.gdn_attention(
        mixed_qkv, a, b, conv_weights, conv_bias, A_log, dt_bias, conv.transpose(1, 2),
        ssm.transpose(-1, -2), non_spec_query_start_loc, slots, initial, hk, k_dim, activation,
        num_prefills == 0)
    if write:
        core_attn_out[:tokens].copy_(o)
        z[:tokens].copy_(z_part)
        if ssm is not ssm_state:
            _unstage_states(conv_state, ssm_state, non_spec_state_indices_tensor, conv, ssm,
                            inside)


_OPTIONAL = ("conv_bias", "has_initial_state", "non_spec_query_start_loc",
             "non_spec_token_indx", "non_spec_state_indices_tensor") + _SPEC_ARGS[:4]


def gdn_attention(core_attn_out, z, projected_states_qkvz, projected_states_ba, num_k_heads,
                  num_v_heads, head_k_dim, head_v_dim, conv_state, ssm_state, conv_weights,
                  conv_bias, activation, A_log, dt_bias, num_prefills, num_decodes,
                  num_spec_decodes, has_initial_state, non_spec_query_start_loc,
                  non_spec_token_indx, non_spec_state_indices_tensor, spec_query_start_loc,
                  spec_token_indx, spec_state_indices_tensor, num_accepted_tokens,
                  num_actual_tokens, tp_size, reorder_input) -> None:
    """sgl-kernel-xpu's ``sgl_kernel.gdn_attention``: one gated-delta-net layer (conv, gating,
    delta rule) for the first ``num_actual_tokens`` tokens, on ``xpu_ops.gdn_attention``.

    Args (sgl-kernel-xpu's names and layouts; Hk, Hv per rank = ``num_*_heads / tp_size``):
        core_attn_out, z: ``[rows >= num_actual_tokens, Hv, V]`` in the projections' dtype
            (written in place: the layer's output and the projections' ``z`` part).
        projected_states_qkvz: ``[rows, 2 Hk K + 2 Hv V]`` fp16|bf16|fp32 (``q | k | v | z``,
            by part with ``reorder_input``, else per key-head group).
        projected_states_ba: ``[rows, 2 Hv]`` (``b | a`` likewise).
        conv_state: ``[cache, width - 1, 2 Hk K + Hv V]``, any strides (updated in place).
        ssm_state: ``[cache, Hv, V, K]`` float32, float16 or bfloat16 (updated in place; a
            16-bit pool's addressed slots run in float32 and are rounded back).
        conv_weights ``[dim, width]``, conv_bias ``[dim]`` or None, activation ``"silu"`` |
            ``"swish"``, A_log and dt_bias ``[Hv]``: as ``xpu_ops.gdn_attention``.
        num_prefills, num_decodes: the requests (decode only: one token each).
        num_spec_decodes: 0; the ``spec_*`` tensors, ``num_accepted_tokens`` and
            ``non_spec_token_indx``: None (speculative decoding is not served).
        has_initial_state: bool ``[b]`` or None (every request continues from its state).
        non_spec_query_start_loc: int32 ``[b + 1]`` prefix sums of the requests' tokens.
        non_spec_state_indices_tensor: int32 ``[b]`` pool slots (-1: from zeros, no write).
        tp_size: divides both head counts. reorder_input: the projections' layout.
    Returns:
        None (sgl-kernel-xpu's contract: results are written in place). The call's scratch
        comes from ``_gdn_ws_cache`` (grow-only, per device; the module docstring).
    Raises:
        TypeError/ValueError (also RuntimeError), naming the argument; nothing is written then.
    Source: sgl-kernel-xpu ``python/sgl_kernel/gdn_attn.py`` and ``src/torch_extension_sycl.cc``
    (signature, schema); sglang ``hardware_backend/xpu/attention/xpu_gdn_backend.py`` (the call).
    """
    tensors = dict(core_attn_out=core_attn_out, z=z, projected_states_qkvz=projected_states_qkvz,
                   projected_states_ba=projected_states_ba, conv_state=conv_state,
                   ssm_state=ssm_state, conv_weights=conv_weights, conv_bias=conv_bias,
                   A_log=A_log, dt_bias=dt_bias, has_initial_state=has_initial_state,
                   non_spec_query_start_loc=non_spec_query_start_loc,
                   non_spec_token_indx=non_spec_token_indx,
                   non_spec_state_indices_tensor=non_spec_state_indices_tensor,
                   spec_query_start_loc=spec_query_start_loc, spec_token_indx=spec_token_indx,
                   spec_state_indices_tensor=spec_state_indices_tensor,
                   num_accepted_tokens=num_accepted_tokens)
    check_tensor_args(FN, optional=_OPTIONAL, **tensors)
    if not isinstance(activation, str):
        fail(FN, "activation", "is not a str", "'silu' or 'swish'", type(activation).__name__,
             exc=TypeError)
    ints = [int_scalar(FN, arg, value) for arg, value in (
        ("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads), ("head_k_dim", head_k_dim),
        ("head_v_dim", head_v_dim), ("num_prefills", num_prefills), ("num_decodes", num_decodes),
        ("num_spec_decodes", num_spec_decodes), ("num_actual_tokens", num_actual_tokens),
        ("tp_size", tp_size))]
    hk, hv = _heads(ints[0], ints[1], ints[8])
    device = projected_states_qkvz.device
    workspace = _workspace(gdn_workspace_bytes(ints[7], hk, hv, ints[2], ints[3],
                                               projected_states_qkvz.dtype), device)
    torch.ops.sgl_kernel.gdn_attention(
        core_attn_out, z, projected_states_qkvz, projected_states_ba, *ints[:4], conv_state,
        ssm_state, conv_weights, conv_bias, activation, A_log, dt_bias, *ints[4:7],
        has_initial_state, non_spec_query_start_loc, non_spec_token_indx,
        non_spec_state_indices_tensor, spec_query_start_loc, spec_token_indx,
        spec_state_indices_tensor, num_accepted_tokens, ints[7], ints[8],
        check_flag(FN, "reorder_input", reorder_input), workspace)
    if workspace is not None:
        _gdn_ws_cache[device] = workspace     # kept only once a call has accepted it


#: Growth factor of a regrown cached workspace (sgl-kernel-xpu's wrapper: 1.25).
WORKSPACE_HEADROOM = 1.25
#: The wrapper's workspace per device (sgl-kernel-xpu's ``sgl_kernel.gdn_attn._gdn_ws_cache``):
#: a flat uint8 buffer that only grows, shared by every call through ``gdn_attention``.
_gdn_ws_cache: dict[torch.device, Tensor] = {}


def _workspace(nbytes: int, device: torch.device) -> Tensor | None:
    """The cached buffer when it holds ``nbytes``, else a new one ``WORKSPACE_HEADROOM`` times
    larger (cached by the caller after the call); None for no byte or while tracing (the
    compiler plans a graph's memory)."""
    if nbytes <= 0 or torch.compiler.is_compiling():
        return None
    cur = _gdn_ws_cache.get(device)
    if cur is not None and cur.numel() >= nbytes:
        return cur
    return torch.empty(int(nbytes * WORKSPACE_HEADROOM), dtype=torch.uint8, device=device)


__all__ = ["gdn_attention", "gdn_attention_", "gdn_workspace_bytes", "split_projections"]
