"""Process groups of tensor and decode context parallelism, and their traceable collectives.

A ``ParallelGroup`` names one ``torch.distributed`` process group with this process's rank in
it (gloo on the CPU, NCCL on CUDA, XCCL on XPU: whatever ``init_process_group`` chose). The
collectives are ``torch.distributed._functional_collectives`` (the ones torch.compile's
documentation and vLLM use): they return new tensors, Dynamo traces them into the graph with no
break, and Inductor schedules them. A group of size 1 is the identity and puts nothing in the
graph, so a single-process model costs exactly what it cost before.

``ParallelConfig`` is what the engine and the attention backend are given: the tensor-parallel
group (heads and MLP columns split across its ranks) and the decode-context-parallel group (the
KV cache split by token across its ranks, ``compile.backend.dcp_attention``).

Source: Megatron-LM (arXiv 1909.08053) for the tensor-parallel layout; sglang's
``parallel_state.py`` names (``tp_size``, ``tp_rank``, ``dcp_size``, ``dcp_rank``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class ParallelGroup:
    """One process group and this process's place in it.

    Attributes:
        rank: this process's rank in the group, ``0 <= rank < size``.
        size: processes in the group (1: no parallelism, every collective is the identity).
        group: the ``torch.distributed.ProcessGroup`` (None only when ``size == 1``).
    """

    rank: int = 0
    size: int = 1
    group: Optional[Any] = None

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.size) or (self.size > 1 and self.group is None):
            raise ValueError(f"ParallelGroup: rank/size/group are inconsistent; expected "
                             f"0 <= rank < size and a process group when size > 1, got "
                             f"rank={self.rank}, size={self.size}, group={self.group!r}.")

    @classmethod
    def of(cls, group) -> "ParallelGroup":
        """The ``ParallelGroup`` of an initialised ``torch.distributed`` process group."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)


def all_reduce(x: Tensor, group: ParallelGroup) -> Tensor:
    """Sum of ``x`` over the group's ranks (a new tensor; ``x`` itself when ``size == 1``).

    >>> x = torch.ones(2)
    >>> all_reduce(x, ParallelGroup()) is x
    True
    """
    if group.size == 1:
        return x
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group.group))


def all_gather(x: Tensor, dim: int, group: ParallelGroup) -> Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order (``x`` when ``size == 1``)."""
    if group.size == 1:
        return x
    dim = dim % x.dim()  # all_gather_tensor takes no negative dims
    return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), dim, group.group))


def tp_heads(num_heads: int, num_kv_heads: int, tp: ParallelGroup) -> tuple[int, int, int]:
    """``(Hq, Hkv, first KV head)`` of this rank when ``tp`` splits the heads.

    Query heads split evenly (``num_heads % tp.size == 0``). KV heads split evenly when
    ``num_kv_heads >= tp.size``; with fewer KV heads than ranks each rank keeps one, replicated
    over ``tp.size // num_kv_heads`` ranks (sglang's and vLLM's rule), so query head ``h`` still
    reads KV head ``h // (num_heads // num_kv_heads)``.

    Raises:
        ValueError: a head count the rule cannot split, naming it.

    >>> one = lambda rank: ParallelGroup(rank, 4, group=object())   # 4 ranks (a stand-in group)
    >>> [tp_heads(32, 8, one(r)) for r in range(4)]                  # 8 KV heads: 2 each
    [(8, 2, 0), (8, 2, 2), (8, 2, 4), (8, 2, 6)]
    >>> [tp_heads(8, 2, one(r)) for r in range(4)]                   # 2 KV heads: replicated
    [(2, 1, 0), (2, 1, 0), (2, 1, 1), (2, 1, 1)]
    """
    size, rank = tp.size, tp.rank
    if num_heads % size or (num_kv_heads % size if num_kv_heads >= size else size % num_kv_heads):
        raise ValueError(f"tp_heads: num_heads={num_heads} / num_kv_heads={num_kv_heads} "
                         f"cannot be split over {size} ranks; expected num_heads % tp == 0 and "
                         f"num_kv_heads % tp == 0 (or tp % num_kv_heads == 0), got tp={size}. "
                         "Pick a tp size that divides the heads.")
    if num_kv_heads >= size:
        kv = num_kv_heads // size
        return num_heads // size, kv, rank * kv
    return num_heads // size, 1, rank // (size // num_kv_heads)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism ``tp`` and decode context parallelism ``dcp`` of one process.

    Ranks are laid out ``world_rank = dcp.rank * tp.size + tp.rank`` (``init_parallel``): the
    ranks of one DCP group hold the same heads and split the tokens of every request.
    """

    tp: ParallelGroup = ParallelGroup()
    dcp: ParallelGroup = ParallelGroup()


def init_parallel(tp_size: int = 1, dcp_size: int = 1, backend: Optional[str] = None
                  ) -> ParallelConfig:
    """Join the default process group (``torchrun``'s environment) and build the TP and DCP
    groups; every process of the world calls it with the same sizes.

    Args:
        tp_size, dcp_size: group sizes; ``tp_size * dcp_size`` must equal the world size.
        backend: ``torch.distributed`` backend (default: gloo on the CPU, else the device's).
    Returns:
        This process's ``ParallelConfig``; ``ParallelConfig()`` when both sizes are 1 and no
        process group was started (plain single-process runs need no ``torchrun``).
    Raises:
        ValueError: the sizes do not multiply to the world size.
    """
    if tp_size * dcp_size == 1 and not dist.is_initialized():
        return ParallelConfig()
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp_size * dcp_size != world:
        raise ValueError(f"init_parallel: tp_size * dcp_size must be the world size; expected "
                         f"{tp_size} * {dcp_size} == {world}, got {tp_size * dcp_size}. Launch "
                         f"with torchrun --nproc-per-node {tp_size * dcp_size}.")
    tp = dcp = None
    for d in range(dcp_size):  # every process creates every group, in the same order
        g = dist.new_group([d * tp_size + t for t in range(tp_size)])
        tp = g if d == rank // tp_size else tp
    for t in range(tp_size):
        g = dist.new_group([d * tp_size + t for d in range(dcp_size)])
        dcp = g if t == rank % tp_size else dcp
    return ParallelConfig(tp=ParallelGroup(rank % tp_size, tp_size, tp),
                          dcp=ParallelGroup(rank // tp_size, dcp_size, dcp))


@contextlib.contextmanager
def process_group_scope():
    """Leave the default process group when the block ends without an error: every rank waits
    at a barrier (so none tears down while a peer still reads from it), then destroys the group
    and joins its threads. Without this a rank that finishes first can exit while gloo's
    background thread still runs, and the C++ runtime aborts the process (SIGABRT). A block that
    raises leaves the group as it is: the process is failing anyway, and a barrier could wait for
    a peer that never comes. A barrier that fails (a disaggregation peer that is gone, which the
    block reported) is skipped. No-op when no process group was started."""
    yield
    if dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError:  # a peer is gone: nobody left to wait for
            pass
        dist.destroy_process_group()


__all__ = ["ParallelGroup", "ParallelConfig", "tp_heads", "all_reduce", "all_gather",
           "init_parallel", "process_group_scope"]
