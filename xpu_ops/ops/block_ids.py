"""``build_bidirectional_block_ids``: the host-side builder of ``bidirectional_block_ids``.

sglang 0.5.23's Gemma-3 model (``gemma3_mm.py``) calls it from ``sgl_kernel.flash_attn`` with
each sequence's length and its image spans; the result is the per-token id tensor that
``flash_attn_with_kvcache(bidirectional_block_ids=...)`` takes. Plain Python over the spans
(a handful per batch), run once per step before the model, never inside a graph.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._checks import fail

NAME = "build_bidirectional_block_ids"


def build_bidirectional_block_ids(seq_lens: Sequence[int],
                                  block_spans: Sequence[Sequence[tuple[int, int]]],
                                  device=None) -> Optional[torch.Tensor]:
    """Per-token block ids of packed sequences: span k (in order over the batch) gets id k.

    Args:
        seq_lens: tokens of each sequence (ints); the tokens are packed in this order.
        block_spans: per sequence, ``(first, last)`` token indices (inclusive, within the
            sequence) of each bidirectional block (an image).
        device: where the result lives.
    Returns:
        int32 ``[sum(seq_lens)]``, -1 outside every span; None when there is no span at all
        (callers then keep the plain causal path).
    Raises:
        ValueError: ``block_spans`` and ``seq_lens`` differ in length, or a span is reversed
            or reaches outside its sequence.
    Source: sgl-kernel-xpu's ``build_bidirectional_block_ids`` (PR 495) contract.

    >>> import xpu_ops
    >>> xpu_ops.build_bidirectional_block_ids([5, 3], [[(1, 2)], [(0, 2)]]).tolist()
    [-1, 0, 0, -1, -1, 1, 1, 1]
    >>> xpu_ops.build_bidirectional_block_ids([4], [[]]) is None
    True
    """
    if len(block_spans) != len(seq_lens):
        fail(NAME, "block_spans", "has a different length than seq_lens",
             f"one list of spans per sequence ({len(seq_lens)})", len(block_spans))
    ids, block = [], 0
    for r, (n, spans) in enumerate(zip(seq_lens, block_spans)):
        row = [-1] * int(n)
        for first, last in spans:
            if not 0 <= first <= last < n:
                fail(NAME, "block_spans", f"has a span outside sequence {r} or reversed",
                     f"0 <= first <= last < seq_lens[{r}] = {n}", (first, last))
            row[first:last + 1] = [block] * (last - first + 1)
            block += 1
        ids += row
    if block == 0:
        return None
    return torch.tensor(ids, dtype=torch.int32, device=device)
