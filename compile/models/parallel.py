"""Tensor-parallel layers of the zoo: column- and row-parallel linears, the vocabulary-parallel
embedding and the logits gather, each holding only its rank's shard of the weight.

Megatron-LM's layout (arXiv 1909.08053), as sglang's and vLLM's ``linear.py`` and
``vocab_parallel_embedding.py`` use it: a column-parallel linear keeps the rows of ``W [out, in]``
of its output shard (no communication: the next layer consumes the shard); a row-parallel
linear keeps the columns of its input shard and sums the partial products over the group (one
all-reduce, the bias added once after it); the embedding keeps a contiguous range of the
vocabulary, looks up the ids inside it, zeroes the others and all-reduces; the LM head's logits
of each vocabulary shard are all-gathered. Collectives come from
``compile.backend.parallel_state`` (functional collectives, traced without graph breaks).

Every layer is built from the full layer's tensors (``from_full``), so a checkpoint loads
through the zoo's usual path and is sharded afterwards (``compile.models.tensor_parallel``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compile.backend.parallel_state import ParallelGroup, all_gather, all_reduce


def divide(n: int, parts: int, what: str) -> int:
    """``n // parts``, or ``ValueError`` naming ``what`` when ``parts`` does not divide ``n``."""
    if n % parts:
        raise ValueError(f"tensor_parallel: {what} is not divisible by the tensor-parallel "
                         f"size; expected {what} % {parts} == 0, got {n}. Pick a tp size that "
                         f"divides it.")
    return n // parts


def shard_rows(w: Optional[Tensor], sizes: Sequence[int], starts: Sequence[int],
               counts: Sequence[int]) -> Optional[Tensor]:
    """Rows of ``w`` split into consecutive blocks of ``sizes`` (dim 0), keeping block ``i``'s
    rows ``starts[i] .. starts[i] + counts[i] - 1``, concatenated (a new tensor; None stays).

    >>> w = torch.arange(6.0).view(6, 1)                 # q rows 0-3, k rows 4-5
    >>> shard_rows(w, [4, 2], [2, 1], [2, 1]).flatten().tolist()
    [2.0, 3.0, 5.0]
    """
    if w is None:
        return None
    blocks = w.split(list(sizes), dim=0)
    return torch.cat([b[s:s + c] for b, s, c in zip(blocks, starts, counts)]).clone()


class ColumnParallelLinear(nn.Module):
    """``y_shard = x @ W_shard^T + b_shard``: the output features of this rank, no collective.

    Args:
        weight: ``[out_shard, in]`` rows of this rank (already sliced). bias: ``[out_shard]``.
    Forward:
        ``x [T, in] -> [T, out_shard]``.
    """

    def __init__(self, weight: Tensor, bias: Optional[Tensor]):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_full(cls, full: nn.Linear, sizes: Sequence[int], starts: Sequence[int],
                  counts: Sequence[int]) -> "ColumnParallelLinear":
        """This rank's shard of ``full``, whose output rows are the blocks ``sizes`` (one for a
        plain linear; q/k/v or gate/up for fused ones), keeping ``counts[i]`` rows of block
        ``i`` from ``starts[i]`` (see ``shard_rows``)."""
        return cls(shard_rows(full.weight.data, sizes, starts, counts),
                   shard_rows(None if full.bias is None else full.bias.data, sizes, starts,
                              counts))

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, in] -> [T, out_shard]``."""
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_shard @ W_shard^T) + b``: this rank's input features, summed.

    Args:
        weight: ``[out, in_shard]`` columns of this rank. bias: ``[out]`` (added once, after
            the reduction). group: the tensor-parallel group.
    Forward:
        ``x [T, in_shard] -> [T, out]``, equal on every rank.
    """

    def __init__(self, weight: Tensor, bias: Optional[Tensor], group: ParallelGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    @classmethod
    def from_full(cls, full: nn.Linear, start: int, count: int,
                  group: ParallelGroup) -> "RowParallelLinear":
        """Input columns ``start .. start + count - 1`` of ``full``."""
        w = full.weight.data[:, start:start + count].clone()
        return cls(w, None if full.bias is None else full.bias.data.clone(), group)

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, in_shard] -> [T, out]``."""
        y = all_reduce(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding of vocabulary rows ``start .. start + rows - 1`` on this rank; ids outside
    them look up zeros, and the all-reduce adds the owning rank's row.

    The vocabulary is padded to ``size * rows`` (``rows = ceil(vocab / size)``); padding rows
    are zeros and their logits are dropped by ``ParallelLogitsProcessor``.

    Args:
        weight: ``[rows, hidden]`` this rank's rows. start: the first vocabulary id of them.
        group: the tensor-parallel group.
    Forward:
        ``input_ids [T]`` int64 -> ``[T, hidden]`` in the weight's dtype.
    """

    def __init__(self, weight: Tensor, start: int, group: ParallelGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    @classmethod
    def from_full(cls, full: Tensor, group: ParallelGroup) -> "VocabParallelEmbedding":
        """This rank's rows of the full ``[vocab, hidden]`` table."""
        return cls(vocab_shard(full, group), group.rank * _rows(full.shape[0], group), group)

    def forward(self, input_ids: Tensor) -> Tensor:
        """``input_ids [T] -> [T, hidden]``."""
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])          # [T] bool
        h = F.embedding(torch.where(inside, local, 0), self.weight)     # [T, hidden]
        return all_reduce(h * inside.unsqueeze(-1).to(h.dtype), self.group)


class ParallelLogitsProcessor(nn.Module):
    """``logits = all_gather(h @ W_shard^T)[:, :vocab_size]`` float32: the LM head over a
    vocabulary-sharded weight (``decoder.LogitsProcessor``'s tensor-parallel twin).

    Args:
        vocab_size: the unpadded vocabulary. group: the tensor-parallel group.
    Forward:
        ``h [n, hidden]``, ``weight [rows, hidden]`` (this rank's shard) -> float32
        ``[n, vocab_size]``, equal on every rank.
    """

    def __init__(self, vocab_size: int, group: ParallelGroup):
        super().__init__()
        self.vocab_size, self.group = vocab_size, group

    def forward(self, h: Tensor, weight: Tensor) -> Tensor:
        """``h [n, hidden]`` -> ``[n, vocab_size]`` float32."""
        logits = all_gather(F.linear(h, weight), -1, self.group)   # [n, size * rows]
        return logits[:, :self.vocab_size].float()


def _rows(vocab: int, group: ParallelGroup) -> int:
    return -(-vocab // group.size)


def vocab_shard(full: Tensor, group: ParallelGroup) -> Tensor:
    """Rows ``rank * rows .. (rank + 1) * rows - 1`` of ``full [vocab, hidden]``
    (``rows = ceil(vocab / size)``), zero-padded past the vocabulary; a new tensor.

    >>> table = torch.arange(1.0, 6.0).view(5, 1)        # vocab 5 over 2 ranks: 3 rows each
    >>> vocab_shard(table, ParallelGroup(1, 2, group=object())).flatten().tolist()
    [4.0, 5.0, 0.0]
    """
    rows = _rows(full.shape[0], group)
    out = full.new_zeros((rows, *full.shape[1:]))
    part = full[group.rank * rows:(group.rank + 1) * rows]
    out[:part.shape[0]] = part
    return out


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "ParallelLogitsProcessor", "divide", "shard_rows", "vocab_shard"]
