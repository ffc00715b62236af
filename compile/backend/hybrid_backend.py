"""``HybridLinearAttnBackend``: paged full-attention layers plus linear-attention (gated delta
net) layers in one step (sglang's ``HybridLinearAttnBackend`` role, for Qwen3-Next and Qwen3.5).

The full-attention layers run on ``XPUAttentionBackend`` (this class is one: the KV pool, its
metadata and its graph hooks are inherited unchanged); the linear-attention layers
(``LinearAttention``) run on the per-request ``LinearStatePool``
(``model_runner.state_pool``). One metadata build per step covers both: ``build_metadata``
for the paged layers and ``build_linear_metadata`` for the state slots (``LinearMetadata``).

Graphs: the linear metadata lives in three fixed buffers beside the paged ones
(``graph_metadata_buffers``) and is written inside the captured step
(``init_forward_metadata_in_graph``: each request's slot from ``req_to_slot``, padded requests,
whose ``seq_lens`` are the fill value 1, on the padding slot 0), so a replay costs the host
nothing more than the paged layers' step.

Modes: DECODE, EXTEND and MIXED (with or without a cached prefix: its state is the slot's),
TARGET_VERIFY with topk 1 (states after every draft kept; ``update_mamba_state_after_mtp_verify``
rolls back to the accepted ones) and IDLE. Draft decode and draft extend of a hybrid model, and
verify trees (topk > 1), raise ``NotImplementedError``.
Source: sglang 0.5.23 ``layers/attention/hybrid_linear_attn_backend.py`` (the two backends,
``update_mamba_state_after_mtp_verify``) and ``mem_cache/memory_pool.py`` (``MambaPool``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from compile.backend import gdn_attention
from compile.backend.attention_backend import XPUAttentionBackend
from compile.backend.attention_metadata import cu_seqlens
from compile.batch import ForwardBatch

_BUFFERS = ("linear.cache_indices", "linear.query_start_loc", "linear.has_initial_state")


@dataclasses.dataclass
class LinearMetadata:
    """The state-slot metadata of one step (every linear layer reads it).

    Attributes:
        cache_indices: [b] int32 state slot of each request (0: a padded request).
        query_start_loc: [b + 1] int32 start of each request's tokens in the packed batch.
        has_initial_state: [b] bool, the request continues from its slot's state (a cached
            prefix); False starts from zeros (extend steps; always True for decode and verify).
        draft_token_num: tokens per request of DECODE (1) and TARGET_VERIFY (D) steps; 0 for
            extend steps (any lengths).
        in_graph: the values are written inside the captured step
            (``HybridLinearAttnBackend.init_forward_metadata_in_graph``).
        verify: a TARGET_VERIFY step (its states after each draft are in the verify buffers).
    """

    cache_indices: Tensor
    query_start_loc: Tensor
    has_initial_state: Tensor
    draft_token_num: int = 1
    in_graph: bool = False
    verify: bool = False


def state_indices(req_to_slot: Tensor, req_pool_indices: Tensor, seq_lens: Optional[Tensor] = None,
                  pad_seq_len: int = 1) -> Tensor:
    """[b] int32 state slots of the rows ``req_pool_indices``; with ``seq_lens``, rows whose
    length is ``pad_seq_len`` (a captured step's padded requests) get the padding slot 0.
    Device ops only (what a graph records)."""
    slots = req_to_slot[req_pool_indices]
    if seq_lens is not None:
        slots = torch.where(seq_lens == pad_seq_len, torch.zeros_like(slots), slots)
    return slots.to(torch.int32)


class HybridLinearAttnBackend(XPUAttentionBackend):
    """``XPUAttentionBackend`` for the paged layers plus the linear-attention layers' state.

    Args:
        model_runner: as ``XPUAttentionBackend``'s, with ``state_pool`` (a
            ``compile.batch.state_pool.LinearStatePool``).
        **kwargs: ``XPUAttentionBackend``'s.
    Attributes:
        state_pool: the ``LinearStatePool``.
        linear_metadata: this step's ``LinearMetadata`` (None before the first step).
    Raises:
        ValueError: ``model_runner`` has no ``state_pool``.
    """

    def __init__(self, model_runner, **kwargs):
        super().__init__(model_runner, **kwargs)
        pool = getattr(model_runner, "state_pool", None)
        if pool is None:
            raise ValueError("HybridLinearAttnBackend: model_runner has no state_pool; expected "
                             "the LinearStatePool of the model's linear-attention layers, got "
                             "None. Build the pool from compile.backend.linear_layout(model).")
        self.state_pool = pool
        self.linear_metadata: Optional[LinearMetadata] = None

    # ----------------------------------------------------------------- plan (host)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """The paged layers' metadata and the state slots' (host, once per step)."""
        super().init_forward_metadata(forward_batch)
        self.linear_metadata = self.build_linear_metadata(forward_batch)

    def build_linear_metadata(self, fb: ForwardBatch) -> LinearMetadata:
        """``LinearMetadata`` of ``fb`` (no padded requests: an eager or piecewise step).

        Raises:
            NotImplementedError: draft decode, draft extend, or a verify tree (topk > 1).
        """
        b, dev = fb.batch_size, self.device
        d = self._tokens_per_request(fb)
        if fb.forward_mode.is_target_verify():
            self.state_pool.spec_buffers(d, b)
        slots = state_indices(self.state_pool.req_to_slot, fb.req_pool_indices)
        if d == 0:  # extend / mixed: any lengths, maybe from a cached prefix
            if fb.extend_prefix_lens is None:
                raise ValueError("HybridLinearAttnBackend: an extend batch without "
                                 "extend_prefix_lens; expected [b] cached tokens per request.")
            return LinearMetadata(slots, cu_seqlens(fb.extend_seq_lens.to(torch.int32)),
                                  fb.extend_prefix_lens > 0, draft_token_num=0)
        qsl = torch.arange(b + 1, dtype=torch.int32, device=dev) * d
        return LinearMetadata(slots, qsl, torch.ones(b, dtype=torch.bool, device=dev), d,
                              verify=fb.forward_mode.is_target_verify())

    def _tokens_per_request(self, fb: ForwardBatch) -> int:
        """1 for DECODE and IDLE, D for TARGET_VERIFY, 0 for extend steps."""
        mode, spec = fb.forward_mode, fb.spec_info
        if mode.is_target_verify():
            if self._topk(fb) > 1:
                raise NotImplementedError("HybridLinearAttnBackend: target verify with topk > 1 "
                                          "(a draft tree) is not supported for linear-attention "
                                          "layers; expected topk 1 (a chain).")
            return spec.num_tokens_per_req if spec.num_tokens_per_req > 0 else spec.draft_token_num
        if (mode.is_decode() and spec is not None) or fb.is_draft_extend():
            raise NotImplementedError(f"HybridLinearAttnBackend: draft steps ({mode.name} with a "
                                      "draft input) of a model with linear-attention layers are "
                                      "not supported; expected DECODE, EXTEND, MIXED or "
                                      "TARGET_VERIFY.")
        return 1 if mode.is_decode() or mode.is_idle() else 0

    # ----------------------------------------------------------------- graphs

    def graph_metadata_buffers(self, max_bs: int, max_num_tokens: int) -> dict[str, Tensor]:
        """The paged layers' buffers plus the state-slot metadata's (``linear.*``)."""
        buffers = super().graph_metadata_buffers(max_bs, max_num_tokens)
        i32 = dict(dtype=torch.int32, device=self.device)
        buffers.update({"linear.cache_indices": torch.zeros(max_bs, **i32),
                        "linear.query_start_loc": torch.zeros(max_bs + 1, **i32),
                        "linear.has_initial_state": torch.ones(max_bs, dtype=torch.bool,
                                                               device=self.device)})
        return buffers

    def fill_graph_metadata(self, forward_batch, buffers: dict[str, Tensor], bound=None, *,
                            in_graph: bool = False):
        """The paged layers' captured-step metadata (``XPUAttentionBackend``'s), and the state
        slots' as views of the ``linear.*`` buffers, written inside the captured step."""
        meta = super().fill_graph_metadata(forward_batch, buffers, bound, in_graph=in_graph)
        b, d = forward_batch.batch_size, self._tokens_per_request(forward_batch)
        if d == 0:
            raise NotImplementedError("HybridLinearAttnBackend: captured extend steps are not "
                                      "supported; expected DECODE or TARGET_VERIFY.")
        idx, qsl, init = (buffers[name] for name in _BUFFERS)
        if forward_batch.forward_mode.is_target_verify():  # sized for every bucket at once
            self.state_pool.spec_buffers(d, idx.shape[0])
        self.linear_metadata = LinearMetadata(idx[:b], qsl[:b + 1], init[:b], d, in_graph=True,
                                              verify=forward_batch.forward_mode.is_target_verify())
        return meta

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """The paged layers' in-graph work, then this step's state slots and query starts
        into the ``linear.*`` buffers (padded requests on slot 0)."""
        super().init_forward_metadata_in_graph(forward_batch)
        meta = self.linear_metadata
        if meta is None or not meta.in_graph:
            return
        fill = self.get_cuda_graph_seq_len_fill_value()
        meta.cache_indices.copy_(state_indices(self.state_pool.req_to_slot,
                                               forward_batch.req_pool_indices,
                                               forward_batch.seq_lens, fill))
        b = meta.cache_indices.shape[0]
        torch.mul(torch.arange(b + 1, dtype=torch.int32, device=self.device),
                  meta.draft_token_num, out=meta.query_start_loc)

    # ----------------------------------------------------------------- run (per layer)

    def forward_linear(self, layer, mixed_qkv: Tensor, a: Tensor, b: Tensor,
                       forward_batch: ForwardBatch) -> Tensor:
        """``LinearAttention``'s step: ``[T, Hv, V]`` (see ``compile.backend.gdn_attention``).

        Raises:
            RuntimeError: no linear metadata (``init_forward_metadata`` did not run).
        """
        meta = self.linear_metadata
        if meta is None:
            raise RuntimeError("HybridLinearAttnBackend.forward_linear: no metadata; expected "
                               "init_forward_metadata(forward_batch) before the model runs.")
        mode = forward_batch.forward_mode
        if mode.is_idle():
            return gdn_attention.idle(layer, mixed_qkv)
        conv, ssm = self.state_pool.layer_states(layer.layer_id)
        if mode.is_target_verify():
            spec, i = self.state_pool.spec, self.state_pool.layer_index(layer.layer_id)
            return gdn_attention.verify(layer, mixed_qkv, a, b, conv, ssm, meta,
                                        spec.conv_inputs[i], spec.intermediate_ssm[i])
        if mode.is_decode():
            return gdn_attention.decode(layer, mixed_qkv, a, b, conv, ssm, meta)
        return gdn_attention.extend(layer, mixed_qkv, a, b, conv, ssm, meta)

    def update_mamba_state_after_mtp_verify(self, last_correct_step_indices: Tensor,
                                            mamba_track_indices=None, mamba_steps_to_track=None,
                                            model=None) -> None:
        """After a TARGET_VERIFY step: each request's states become those after its accepted
        drafts (sglang's name and arguments; the tracking ones must be None).

        Args:
            last_correct_step_indices: [b] int, index of each request's last accepted draft
                (accepted tokens - 1), for the verify step's first ``b`` requests.
        Raises:
            NotImplementedError: radix-cache state tracking (``mamba_track_indices``).
            RuntimeError: the last step was not a TARGET_VERIFY step.
        """
        if mamba_track_indices is not None:
            raise NotImplementedError("HybridLinearAttnBackend: mamba_track_indices (radix "
                                      "state tracking) is not supported; expected None.")
        meta = self.linear_metadata
        if meta is None or not meta.verify:
            raise RuntimeError("HybridLinearAttnBackend.update_mamba_state_after_mtp_verify: "
                               "the last step was not a TARGET_VERIFY step; expected one first.")
        n = last_correct_step_indices.shape[0]
        self.state_pool.commit_verified(meta.cache_indices[:n], last_correct_step_indices + 1)


__all__ = ["HybridLinearAttnBackend", "LinearMetadata", "state_indices"]
