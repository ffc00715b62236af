"""``ForwardMode`` and ``ForwardBatch``: what one model step runs on (sglang's names and meaning).

The engine builds one ``ForwardBatch`` per step; ``XPUAttentionBackend.init_forward_metadata``
turns it into attention metadata once, on the host, before the model runs.

Token layout per mode (``b = batch_size``):

- EXTEND / MIXED / DRAFT_EXTEND: ``extend_seq_lens[r]`` new tokens per request, packed; keys are
  the ``extend_prefix_lens[r]`` cached tokens plus the new ones (``seq_lens = prefix + extend``).
- DECODE: one new token per request (``topk`` per request for a draft step with ``topk > 1``);
  ``seq_lens`` counts the cached tokens *including* the new one.
- TARGET_VERIFY: ``spec_info.draft_token_num`` draft tokens per request; ``seq_lens`` counts the
  cached prefix only (drafts excluded), as sglang.
- IDLE: no tokens.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional

import torch
from torch import Tensor


class ForwardMode(enum.IntEnum):
    """The kind of step a batch runs (sglang's ``ForwardMode`` subset)."""

    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND = enum.auto()

    def is_extend(self) -> bool:
        """Modes with several new tokens per request (sglang counts TARGET_VERIFY here too)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND,
                        ForwardMode.TARGET_VERIFY)

    def is_decode(self) -> bool:
        """True for DECODE only."""
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        """True for MIXED only."""
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        """True for IDLE only."""
        return self == ForwardMode.IDLE

    def is_target_verify(self) -> bool:
        """True for TARGET_VERIFY only."""
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        """True for DRAFT_EXTEND only."""
        return self == ForwardMode.DRAFT_EXTEND

    def is_decode_or_idle(self) -> bool:
        """True for DECODE and IDLE."""
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_extend_or_draft_extend_or_mixed(self) -> bool:
        """True for EXTEND, DRAFT_EXTEND and MIXED (not TARGET_VERIFY)."""
        return self in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND, ForwardMode.MIXED)

    def is_cuda_graph(self) -> bool:
        """Modes that graph runners capture (sglang: decode, target verify, idle)."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE)


@dataclasses.dataclass
class SpecInfo:
    """Speculative-decoding inputs the backend reads (sglang's EagleVerifyInput/EagleDraftInput).

    Attributes:
        topk: branches per request (1 = a chain of drafts).
        draft_token_num: D, draft tokens per request in TARGET_VERIFY.
        custom_mask: TARGET_VERIFY with ``topk > 1``: which drafts each draft sees, either
            ``[b, D, D]`` bool (row i may see draft j) or sglang's flattened bool layout (per
            request a row-major ``[D, seq_len + D]`` block, concatenated).
        spec_steps: draft steps per round (informational).
    """

    topk: int = 1
    draft_token_num: int = 0
    custom_mask: Optional[Tensor] = None
    spec_steps: int = 0


@dataclasses.dataclass
class ForwardBatch:
    """One model step's batch (sglang field names). Device tensors unless named ``*_cpu``.

    Attributes:
        forward_mode: ForwardMode.
        batch_size: b, number of requests.
        req_pool_indices: [b] int64 rows of ``req_to_token``.
        seq_lens: [b] int32|int64 tokens per request in the cache after this step (TARGET_VERIFY:
            the prefix only); ``seq_lens_cpu`` the same on the host.
        out_cache_loc: [total_q] int64 token slots the new K/V go to (draft decode: the whole
            ``[b * topk * num_steps]`` round, laid out ``(b, topk, step)``).
        positions: [total_q] int64 token positions (for the model's rotary embedding).
        extend_seq_lens / extend_prefix_lens (+ ``_cpu`` lists): new and cached tokens per
            request in EXTEND/MIXED/DRAFT_EXTEND.
        encoder_lens / encoder_lens_cpu: [b] encoder tokens per request (encoder-decoder); they
            occupy the first ``encoder_lens[r]`` columns of ``req_to_token`` (a multiple of
            page_size), decoder tokens follow; ``seq_lens`` counts decoder tokens only.
        encoder_out_cache_loc: [sum encoder_lens] int64 slots for the encoder's K/V.
        spec_info: SpecInfo or None.
        attn_attend_prefix_cache, prefix_chunk_idx, prefix_chunk_cu_seq_lens,
        prefix_chunk_max_seq_lens, mha_return_lse: MLA MHA prefill over chunked prefix caches
            (sglang): None disables the MHA path; True attends chunk ``prefix_chunk_idx`` of the
            prefix (``prefix_chunk_cu_seq_lens[idx]`` [b + 1] int32); False attends the new
            tokens causally.
        attn_backend, token_to_kv_pool, req_to_token_pool: set by the engine/model runner.
        _attn_output: optional [total_q, Hq * Dv] buffer the backend writes into.
    """

    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: Tensor
    seq_lens: Tensor
    out_cache_loc: Tensor
    seq_lens_cpu: Optional[Tensor] = None
    seq_lens_sum: Optional[int] = None
    positions: Optional[Tensor] = None
    extend_seq_lens: Optional[Tensor] = None
    extend_prefix_lens: Optional[Tensor] = None
    extend_seq_lens_cpu: Optional[list[int]] = None
    extend_prefix_lens_cpu: Optional[list[int]] = None
    extend_num_tokens: Optional[int] = None
    encoder_lens: Optional[Tensor] = None
    encoder_lens_cpu: Optional[list[int]] = None
    encoder_out_cache_loc: Optional[Tensor] = None
    spec_info: Optional[SpecInfo] = None
    attn_attend_prefix_cache: Optional[bool] = None
    prefix_chunk_idx: Optional[int] = None
    prefix_chunk_cu_seq_lens: Optional[Tensor] = None
    prefix_chunk_max_seq_lens: Optional[list[int]] = None
    mha_return_lse: Optional[bool] = None
    attn_backend: Any = None
    token_to_kv_pool: Any = None
    req_to_token_pool: Any = None
    _attn_output: Optional[Tensor] = None

    def __post_init__(self) -> None:
        if self.seq_lens_cpu is None:
            self.seq_lens_cpu = self.seq_lens.cpu()
        if self.seq_lens_sum is None:
            self.seq_lens_sum = int(self.seq_lens_cpu.sum())
        if self.extend_seq_lens is not None and self.extend_seq_lens_cpu is None:
            self.extend_seq_lens_cpu = self.extend_seq_lens.cpu().tolist()
        if self.extend_prefix_lens is not None and self.extend_prefix_lens_cpu is None:
            self.extend_prefix_lens_cpu = self.extend_prefix_lens.cpu().tolist()
        if self.extend_seq_lens_cpu is not None and self.extend_num_tokens is None:
            self.extend_num_tokens = sum(self.extend_seq_lens_cpu)
        if self.encoder_lens is not None and self.encoder_lens_cpu is None:
            self.encoder_lens_cpu = self.encoder_lens.cpu().tolist()

    @property
    def device(self) -> torch.device:
        """Device of the batch's tensors (that of ``seq_lens``)."""
        return self.seq_lens.device


__all__ = ["ForwardMode", "ForwardBatch", "SpecInfo"]
