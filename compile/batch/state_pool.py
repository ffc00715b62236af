"""Per-request state of linear-attention layers (gated delta net): sglang's ``MambaPool`` role.

A linear-attention layer keeps no per-token cache: each request owns one *state slot*, which
holds, per linear layer, the causal-conv window (the last ``width - 1`` inputs of the conv,
``conv [num_slots, conv_dim, width - 1]``) and the recurrent state
(``ssm [num_slots, Hv, K, V]`` float32). ``req_to_slot[row]`` maps a ``req_to_token`` row to its
slot (sglang's ``req_index_to_mamba_index_mapping``). Slot 0 is reserved as padding, like KV
page 0: padded rows of a captured step point at it, so their state updates land in harmless
memory.

Speculative decoding keeps, per request of a TARGET_VERIFY step (its row in the batch, as
sglang's verify scratch), the states after each draft token (``LinearSpecBuffers``): the
recurrent state after every draft and the conv inputs of the drafts, so a rejected draft rolls
back to the state after the last accepted token (``LinearStatePool.commit_verified``).

Pools know nothing of layers: ``LinearStateLayout`` (built by
``compile.backend.linear_layer.linear_layout(model)``) gives the shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class LinearStateLayout:
    """State shapes of a model's linear-attention layers (units: features, heads).

    Attributes:
        layer_ids: global ids of the linear-attention layers, ascending (index ``i`` of the
            pool's buffers is layer ``layer_ids[i]``).
        conv_dim: channels of the causal conv (``2 * Hk * K + Hv * V`` for gated delta net).
        conv_width: the conv's kernel width (the state keeps ``conv_width - 1`` inputs).
        num_v_heads: Hv. head_k_dim: K. head_v_dim: V.
    """

    layer_ids: tuple[int, ...]
    conv_dim: int
    conv_width: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    def state_bytes(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype = torch.float32
                    ) -> int:
        """Bytes one request's state takes over all linear layers (conv window + recurrent
        state), independent of its length."""
        conv = self.conv_dim * (self.conv_width - 1) * conv_dtype.itemsize
        ssm = self.num_v_heads * self.head_k_dim * self.head_v_dim * ssm_dtype.itemsize
        return len(self.layer_ids) * (conv + ssm)


@dataclasses.dataclass
class LinearSpecBuffers:
    """States of one TARGET_VERIFY step of ``draft_token_num`` D tokens per request, by the
    request's row in the batch.

    Attributes:
        intermediate_ssm: [L, rows, D, Hv, K, V] float32, the recurrent state after each draft
            token (``fused_recurrent_gated_delta_rule``'s ``intermediate_states``).
        conv_inputs: [L, rows, conv_dim, width - 1 + D], the conv window before the step
            followed by the D drafts' conv inputs (the window after ``n`` accepted tokens is
            columns ``n .. n + width - 2``).
    """

    intermediate_ssm: Tensor
    conv_inputs: Tensor

    @property
    def draft_token_num(self) -> int:
        """D."""
        return self.intermediate_ssm.shape[2]

    @property
    def rows(self) -> int:
        """Requests a verify step may hold."""
        return self.intermediate_ssm.shape[1]


class LinearStatePool:
    """Conv and recurrent state slots of every linear-attention layer, one slot per request.

    Args:
        layout: ``LinearStateLayout`` of the model.
        num_slots: usable slots (concurrent requests); slot 0 is added on top as padding.
        num_rows: ``req_to_token`` rows (``req_to_slot`` has one entry per row).
        conv_dtype: dtype of the conv windows (the model's). device: where the buffers live.
        ssm_dtype: dtype of the recurrent states (float32, as the ops require).
    Attributes:
        conv: [L, num_slots + 1, conv_dim, width - 1]. ssm: [L, num_slots + 1, Hv, K, V].
        req_to_slot: [num_rows] int32, the slot of each row (0 while the row is free).
        spec: ``LinearSpecBuffers`` of the last ``spec_buffers(D)`` call, or None.
    """

    def __init__(self, layout: LinearStateLayout, num_slots: int, num_rows: int,
                 conv_dtype: torch.dtype, device, ssm_dtype: torch.dtype = torch.float32):
        if not isinstance(layout, LinearStateLayout):
            raise TypeError(f"LinearStatePool: layout has type {type(layout).__name__}; "
                            "expected a LinearStateLayout. Pass "
                            "compile.backend.linear_layer.linear_layout(model).")
        if num_slots < 1 or num_rows < 1:
            raise ValueError(f"LinearStatePool: num_slots and num_rows must be >= 1; got "
                             f"{num_slots} and {num_rows}.")
        self.layout, self.device = layout, torch.device(device)
        self.num_slots, self.conv_dtype, self.ssm_dtype = num_slots, conv_dtype, ssm_dtype
        n, lay = len(layout.layer_ids), layout
        self.conv = torch.zeros((n, num_slots + 1, lay.conv_dim, lay.conv_width - 1),
                                dtype=conv_dtype, device=self.device)
        self.ssm = torch.zeros((n, num_slots + 1, lay.num_v_heads, lay.head_k_dim,
                                lay.head_v_dim), dtype=ssm_dtype, device=self.device)
        self.req_to_slot = torch.zeros(num_rows, dtype=torch.int32, device=self.device)
        self._index = {lid: i for i, lid in enumerate(layout.layer_ids)}
        self.free_slots = list(range(1, num_slots + 1))
        self.spec: Optional[LinearSpecBuffers] = None

    def layer_index(self, layer_id: int) -> int:
        """Index of global layer ``layer_id`` in the buffers.

        Raises:
            KeyError: ``layer_id`` is not a linear-attention layer of the layout.
        """
        try:
            return self._index[layer_id]
        except KeyError:
            raise KeyError(f"LinearStatePool: layer {layer_id} has no state; expected one of "
                           f"the linear-attention layers {self.layout.layer_ids}.") from None

    def layer_states(self, layer_id: int) -> tuple[Tensor, Tensor]:
        """``(conv [num_slots + 1, conv_dim, width - 1], ssm [num_slots + 1, Hv, K, V])`` of
        layer ``layer_id`` (views)."""
        i = self.layer_index(layer_id)
        return self.conv[i], self.ssm[i]

    def available_size(self) -> int:
        """Free slots."""
        return len(self.free_slots)

    def alloc(self, rows: Sequence[int]) -> list[int]:
        """Give each ``req_to_token`` row in ``rows`` a fresh slot (states zeroed); returns them.

        Raises:
            RuntimeError: fewer free slots than rows (nothing is allocated then).
        """
        rows = list(rows)
        if len(rows) > len(self.free_slots):
            raise RuntimeError(f"LinearStatePool.alloc: out of state slots; asked for "
                               f"{len(rows)}, {len(self.free_slots)} free. Free finished "
                               "requests first or build the pool with more slots.")
        slots, self.free_slots = self.free_slots[:len(rows)], self.free_slots[len(rows):]
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)
        self.conv[:, index] = 0
        self.ssm[:, index] = 0
        self.req_to_slot[torch.tensor(rows, dtype=torch.int64, device=self.device)] = index.to(
            torch.int32)
        return slots

    def free(self, rows: Sequence[int]) -> None:
        """Return the slots of ``rows`` to the free list (their rows map to slot 0 again)."""
        index = torch.tensor(list(rows), dtype=torch.int64, device=self.device)
        slots = self.req_to_slot[index].tolist()
        self.req_to_slot[index] = 0
        self.free_slots.extend(int(s) for s in slots if s > 0)

    def fork(self, src_row: int, dst_row: int) -> int:
        """Give ``dst_row`` a new slot holding a copy of ``src_row``'s states (a request that
        continues from another's prefix, sglang's ``copy_from``); returns the new slot.

        Raises:
            RuntimeError: no free slot, or ``src_row`` holds none.
        """
        src = int(self.req_to_slot[src_row])
        if src == 0:
            raise RuntimeError(f"LinearStatePool.fork: row {src_row} holds no state slot; "
                               "expected an allocated row to copy from.")
        dst = self.alloc([dst_row])[0]
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]
        return dst

    def spec_buffers(self, draft_token_num: int, rows: int) -> LinearSpecBuffers:
        """The verify buffers for ``draft_token_num`` D and at least ``rows`` requests (and
        ``num_slots + 1``), made when D changes or more rows are needed, else the same tensors
        (a captured verify step keeps reading them: capture the largest bucket's rows first,
        which ``HybridLinearAttnBackend`` does by asking for its graph buffers' requests)."""
        spec = self.spec
        if spec is None or spec.draft_token_num != draft_token_num or spec.rows < rows:
            n, lay = len(self.layout.layer_ids), self.layout
            rows = max(rows, self.num_slots + 1, 0 if spec is None else spec.rows)
            ssm = torch.zeros((n, rows, draft_token_num, lay.num_v_heads, lay.head_k_dim,
                               lay.head_v_dim), dtype=self.ssm_dtype, device=self.device)
            conv = torch.zeros((n, rows, lay.conv_dim, lay.conv_width - 1 + draft_token_num),
                               dtype=self.conv_dtype, device=self.device)
            self.spec = spec = LinearSpecBuffers(ssm, conv)
        return spec

    def commit_verified(self, slots: Tensor, accepted: Tensor) -> None:
        """Roll every verified request back to its state after its accepted tokens.

        Args:
            slots: [b] int state slots of the verify step's first ``b`` requests (its
                ``cache_indices``; row ``r`` of the verify buffers is request ``r``).
            accepted: [b] int tokens accepted per request, 1 .. D (the verified token the
                target sampled after them is not fed yet).
        Device ops only: no host sync.

        Raises:
            RuntimeError: no verify buffers (no TARGET_VERIFY step ran).
        """
        spec = self.spec
        if spec is None:
            raise RuntimeError("LinearStatePool.commit_verified: no verify buffers; expected a "
                               "TARGET_VERIFY step before the commit.")
        s, n = slots.long(), accepted.long()
        b, w = s.shape[0], self.layout.conv_width - 1
        rows = torch.arange(b, device=s.device)
        self.ssm[:, s] = spec.intermediate_ssm[:, rows, n - 1]
        cols = n[:, None] + torch.arange(w, device=n.device)              # [b, w - 1]
        inputs = spec.conv_inputs[:, :b]                                    # [L, b, C, w-1+D]
        index = cols[None, :, None, :].expand(inputs.shape[0], -1, inputs.shape[2], -1)
        self.conv[:, s] = torch.gather(inputs, 3, index)

    def state_bytes_per_request(self) -> int:
        """Bytes of one slot over all layers (``LinearStateLayout.state_bytes``)."""
        return self.layout.state_bytes(self.conv_dtype, self.ssm_dtype)


__all__ = ["LinearStateLayout", "LinearSpecBuffers", "LinearStatePool"]
