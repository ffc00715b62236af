"""Reference ``causal_conv1d_fn`` / ``causal_conv1d_update``: each request's conv state and
tokens joined into one extended sequence, convolved with ``unfold`` in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import provider_table


def request_spans(cu_seqlens: torch.Tensor, total: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of every request's rows, clamped into ``[0, total]`` (an end before
    its start is an empty request). Reads the prefix sums on the host."""
    cu = [min(max(int(c), 0), total) for c in cu_seqlens.tolist()]
    return [(s, max(s, e)) for s, e in zip(cu[:-1], cu[1:])]


def state_slot(slot: int, num_slots: int) -> int:
    """``slot`` when it addresses ``[0, num_slots)``, else -1 (no state)."""
    return slot if 0 <= slot < num_slots else -1


def _convolve(ext: torch.Tensor, weight, bias, activation) -> torch.Tensor:
    """``ext [..., dim, width - 1 + L]`` float32 -> ``[..., L, dim]`` float32 outputs."""
    width = weight.shape[1]
    if ext.shape[-1] < width:                              # no token
        return ext.new_zeros((*ext.shape[:-2], 0, ext.shape[-2]))
    windows = ext.unfold(-1, width, 1)                     # [..., dim, L, width]
    y = (windows * weight.float()[:, None, :]).sum(-1)     # [..., dim, L]
    if bias is not None:
        y = y + bias.float()[:, None]
    if activation is not None:
        y = F.silu(y)
    return y.transpose(-1, -2)


def _tail(ext: torch.Tensor, width: int) -> torch.Tensor:
    """The last ``width - 1`` columns of ``ext`` (the new conv state)."""
    return ext[..., ext.shape[-1] - (width - 1):]


@provider_table.register("causal_conv1d_fn", "reference")
def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices,
                     has_initial_state, activation):
    """Reference ``causal_conv1d_fn`` (contract: ``xpu_ops/ops/causal_conv1d.py``).

    One request at a time (spans and slots read on the host); every state is read before any
    is written. Rows no request covers are 0.
    """
    total, dim = x.shape
    width = weight.shape[1]
    out = x.new_zeros((total, dim))
    slots = [state_slot(s, conv_states.shape[0]) for s in cache_indices.tolist()]
    initial = has_initial_state.tolist()
    new_states = []
    for r, (start, end) in enumerate(request_spans(query_start_loc, total)):
        slot = slots[r]
        if slot >= 0 and initial[r]:
            prev = conv_states[slot].float()
        else:
            prev = x.new_zeros((dim, width - 1), dtype=torch.float32)
        ext = torch.cat([prev, x[start:end].float().T], dim=1)
        out[start:end] = _convolve(ext, weight, bias, activation).to(x.dtype)
        if slot >= 0:
            new_states.append((slot, _tail(ext, width)))
    for slot, state in new_states:
        conv_states[slot] = state.to(conv_states.dtype)
    return out


@provider_table.register("causal_conv1d_update", "reference")
def causal_conv1d_update(x, conv_state, weight, bias, activation, conv_state_indices):
    """Reference ``causal_conv1d_update`` (contract: ``xpu_ops/ops/causal_conv1d.py``).

    All requests at once: states gathered (zeros for a slot outside the pool), joined with the
    ``s`` new tokens, convolved; the valid slots get the last ``width - 1`` columns.
    """
    xs = x if x.dim() == 3 else x[:, None, :]              # [b, s, dim]
    batch, width = xs.shape[0], weight.shape[1]
    num_slots = conv_state.shape[0]
    if conv_state_indices is None:
        slots = torch.arange(batch, device=x.device)
    else:
        slots = conv_state_indices.long()
    valid = (slots >= 0) & (slots < num_slots)
    safe = torch.where(valid, slots, 0)
    prev = conv_state[safe].float() if num_slots else xs.new_zeros(
        (batch, xs.shape[2], width - 1), dtype=torch.float32)
    prev = torch.where(valid[:, None, None], prev, 0.0)
    ext = torch.cat([prev, xs.float().transpose(1, 2)], dim=2)     # [b, dim, width - 1 + s]
    out = _convolve(ext, weight, bias, activation).to(x.dtype)     # [b, s, dim]
    rows = valid.nonzero()[:, 0]
    conv_state[slots[rows]] = _tail(ext, width)[rows].to(conv_state.dtype)
    return out.reshape(x.shape).contiguous()
