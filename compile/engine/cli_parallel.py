"""``--tp`` / ``--dcp`` of ``python -m compile generate``: one process per rank under ``torchrun``.

    torchrun --nproc-per-node 2 -m compile generate --tp 2 --device cpu --model tiny --verify
    torchrun --nproc-per-node 2 -m compile generate --dcp 2 --device cpu --model tiny --verify
    torchrun --nproc-per-node 2 -m compile generate --model tiny --tp 2 --device cuda --mode graphs

Every rank loads the full checkpoint, shards it (``compile.models.tensor_parallel``), and runs
the same engine schedule; the logits are equal on every rank (all-reduced or gathered), so greedy
and seeded sampling pick the same tokens everywhere. Only rank 0 prints, and ``--verify``
(``transformers``' own ``generate``) runs on rank 0 alone. The process group is gloo on the CPU
and the device's collective library on GPUs (NCCL on CUDA, XCCL on XPU), each rank on device
``LOCAL_RANK``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Iterator

import torch

from compile.backend.parallel_state import ParallelConfig, init_parallel
from compile.engine.cli_args import positive_int
from compile.models.tensor_parallel import tensor_parallel


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--tp`` and ``--dcp`` to a ``generate`` parser."""
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="tensor-parallel ranks (heads and MLP split); launch with torchrun "
                             "--nproc-per-node tp*dcp")
    parser.add_argument("--dcp", type=positive_int, default=1,
                        help="decode-context-parallel ranks (KV cache split by token)")


def start_parallel(args, device: torch.device) -> tuple[ParallelConfig, torch.device]:
    """Join the ``torchrun`` process group for ``--tp``/``--dcp``; returns this rank's
    ``ParallelConfig`` and its device (``cuda:LOCAL_RANK`` / ``xpu:LOCAL_RANK`` on GPUs).

    Exits with an argument error (status 2) when the world size is not ``tp * dcp``.
    """
    need = args.tp * args.dcp
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if need != world:
        args.error(f"argument --tp/--dcp: tp * dcp must equal the number of processes; "
                   f"expected {need} (torchrun --nproc-per-node {need}), got {world}")
    if args.dcp > 1 and args.mode in ("graphs", "full_and_piecewise"):
        args.error(f"argument --dcp: DCP steps are not captured as whole-step graphs; expected "
                   f"--mode eager, compile or piecewise, got --mode {args.mode}")
    if need == 1:
        return ParallelConfig(), device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type in ("cuda", "xpu"):
        device = torch.device(device.type, local)
        getattr(torch, device.type).set_device(device)
    backend = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl"}[device.type]
    return init_parallel(args.tp, args.dcp, backend=backend), device


def shard_model(args, model):
    """``tensor_parallel(model, args.parallel.tp)`` for ``generate``: a model that ``--tp``
    cannot split (heads or intermediate size not divisible, MLA or expert layers) exits with a
    one-line argument error (status 2) instead of a traceback."""
    try:
        return tensor_parallel(model, args.parallel.tp)
    except (ValueError, NotImplementedError) as e:
        args.error(f"argument --tp: {e}")


@contextlib.contextmanager
def unsupported_by_dcp(args) -> Iterator[None]:
    """Inside the block, under ``--dcp`` > 1, a ``NotImplementedError`` (a KV pool or attention
    kind that decode context parallelism does not split: hybrid SWA, MLA, sliding-window or
    chunked-local layers) exits with a one-line ``--dcp`` error (status 2)."""
    try:
        yield
    except NotImplementedError as e:
        if args.dcp == 1:
            raise
        args.error(f"argument --dcp: {e}")


def is_rank_zero() -> bool:
    """True in single-process runs and on world rank 0."""
    return int(os.environ.get("RANK", "0")) == 0


def say(message: str) -> None:
    """Tell the user what is happening now (loading, compiling, verifying): one line on stderr,
    from rank 0 only, flushed at once so it shows before the slow part starts."""
    if is_rank_zero():
        print(f"[generate] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def quiet_unless_rank_zero() -> Iterator[None]:
    """Inside the block, ranks other than 0 write nothing to stdout."""
    if is_rank_zero():
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        yield


__all__ = ["add_parallel_arguments", "start_parallel", "shard_model", "unsupported_by_dcp",
           "is_rank_zero", "quiet_unless_rank_zero", "say"]
