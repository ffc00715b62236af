"""``ForwardMode`` and ``ForwardBatch``: what one model step runs on (sglang's names and meaning).

The engine builds one ``ForwardBatch`` per step; ``XPUAttentionBackend.init_forward_metadata``
turns it into attention metadata once, on the host, before the model runs.

Token layout per mode (``b = batch_size``):

- EXTEND / MIXED / DRAFT_EXTEND_V2: ``extend_seq_lens[r]`` new tokens per request, packed; keys
  are the ``extend_prefix_lens[r]`` cached tokens plus the new ones (``seq_lens = prefix +
  extend``). An EXTEND batch whose ``spec_info`` is a draft input is a draft extend as well.
- DECODE: one new token per request (``topk`` per request for a draft step with ``topk > 1``);
  ``seq_lens`` counts the cached tokens *including* the new one.
- TARGET_VERIFY: ``spec_info.num_tokens_per_req`` tokens per request (``draft_token_num``
  unless the spec input says otherwise); ``seq_lens`` counts the cached prefix only (drafts
  excluded), as sglang.
- IDLE: no tokens.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional

import torch
from torch import Tensor


class ForwardMode(enum.IntEnum):
    """The kind of step a batch runs: sglang 0.5.23's ``ForwardMode`` subset, same names, values
    and predicates (``tests/compile/backend/test_base_backend.py`` checks them against the
    wheel's truth table)."""

    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND_V2 = enum.auto()

    def is_extend(self, include_draft_extend_v2: bool = False) -> bool:
        """Modes with several new tokens per request: EXTEND, MIXED, TARGET_VERIFY (sglang
        counts verify here), and DRAFT_EXTEND_V2 when ``include_draft_extend_v2``."""
        return (self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)
                or (include_draft_extend_v2 and self == ForwardMode.DRAFT_EXTEND_V2))

    def is_prefill(self, include_draft_extend_v2: bool = False) -> bool:
        """sglang's other name for ``is_extend``."""
        return self.is_extend(include_draft_extend_v2=include_draft_extend_v2)

    def is_context_parallel_extend(self, include_draft_extend_v2: bool = False) -> bool:
        """Modes a context-parallel prefill splits: EXTEND, MIXED (and DRAFT_EXTEND_V2 when
        ``include_draft_extend_v2``)."""
        return self.is_extend_or_draft_extend_or_mixed(
            include_draft_extend_v2=include_draft_extend_v2)

    def is_extend_without_speculative(self) -> bool:
        """``is_extend()`` but not TARGET_VERIFY."""
        return self.is_extend() and not self.is_target_verify()

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

    def is_draft_extend_v2(self) -> bool:
        """True for DRAFT_EXTEND_V2 only (the mode alone; an EXTEND batch with a draft input
        is a draft extend too: ``ForwardBatch.is_draft_extend``)."""
        return self == ForwardMode.DRAFT_EXTEND_V2

    def is_decode_or_idle(self) -> bool:
        """True for DECODE and IDLE."""
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_extend_or_draft_extend_or_mixed(self, include_draft_extend_v2: bool = False) -> bool:
        """EXTEND and MIXED, and DRAFT_EXTEND_V2 when ``include_draft_extend_v2`` (never
        TARGET_VERIFY)."""
        return (self in (ForwardMode.EXTEND, ForwardMode.MIXED)
                or (include_draft_extend_v2 and self == ForwardMode.DRAFT_EXTEND_V2))

    def is_cuda_graph(self) -> bool:
        """Modes that sglang's decode graph runner captures: DECODE, TARGET_VERIFY, IDLE."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE)

    def is_cpu_graph(self) -> bool:
        """Modes that sglang's CPU graph runner captures: DECODE."""
        return self == ForwardMode.DECODE


class SpecInputType(enum.Enum):
    """Which side of a speculative round a ``SpecInfo`` feeds (sglang's names)."""

    EAGLE_DRAFT = enum.auto()
    EAGLE_VERIFY = enum.auto()


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
        num_tokens_per_req: query tokens per request of this step (sglang 0.5.23): the width of
            a TARGET_VERIFY batch, which may differ from ``draft_token_num`` (DSpark's draft
            block). -1: ``draft_token_num`` for a verify input, unset for a draft input.
        spec_input_type: ``EAGLE_VERIFY`` or ``EAGLE_DRAFT``; None: a verify input when
            ``draft_token_num > 0`` (only sglang's verify input carries one), else a draft input.
    """

    topk: int = 1
    draft_token_num: int = 0
    custom_mask: Optional[Tensor] = None
    spec_steps: int = 0
    num_tokens_per_req: int = -1
    spec_input_type: Optional[SpecInputType] = None

    def __post_init__(self) -> None:
        if self.spec_input_type is None:
            self.spec_input_type = (SpecInputType.EAGLE_VERIFY if self.draft_token_num > 0
                                    else SpecInputType.EAGLE_DRAFT)
        if self.num_tokens_per_req < 0 and self.is_verify_input():
            self.num_tokens_per_req = self.draft_token_num

    def is_draft_input(self) -> bool:
        """An input of the draft model (draft decode, draft extend)."""
        return self.spec_input_type == SpecInputType.EAGLE_DRAFT

    def is_verify_input(self) -> bool:
        """An input of the target model's verify step."""
        return self.spec_input_type == SpecInputType.EAGLE_VERIFY


def is_draft_extend(forward_batch) -> bool:
    """Whether ``forward_batch`` (this project's or sglang's ``ForwardBatch``) is a draft-model
    extend: mode DRAFT_EXTEND_V2, or EXTEND with a draft ``spec_info`` (sglang 0.5.23's XPU
    backend treats both alike)."""
    mode, spec = forward_batch.forward_mode, forward_batch.spec_info
    return mode.is_draft_extend_v2() or (
        mode == ForwardMode.EXTEND and spec is not None and spec.is_draft_input())


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
            request in EXTEND/MIXED/DRAFT_EXTEND_V2.
        encoder_lens / encoder_lens_cpu: [b] encoder tokens per request (encoder-decoder); they
            occupy the first ``encoder_lens[r]`` columns of ``req_to_token`` (any length),
            decoder tokens follow; ``seq_lens`` counts decoder tokens only.
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

    def is_draft_extend(self) -> bool:
        """``is_draft_extend(self)``."""
        return is_draft_extend(self)

    @property
    def device(self) -> torch.device:
        """Device of the batch's tensors (that of ``seq_lens``)."""
        return self.seq_lens.device


__all__ = ["ForwardMode", "ForwardBatch", "SpecInfo", "SpecInputType", "is_draft_extend"]
