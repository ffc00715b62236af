"""``--disaggregation`` of ``python -m compile generate``: prefill and decode in two processes.

    python -m compile generate --model tiny --device cpu --disaggregation both --verify
    python -m compile generate --device cuda --disaggregation both --mode eager \\
        --decode-mode graphs --page-size 16 --decode-page-size 1      # one GPU: gloo staging
    torchrun --nnodes 2 --node-rank 0 ... -m compile generate --disaggregation prefill
    torchrun --nnodes 2 --node-rank 1 ... -m compile generate --disaggregation decode

The first half of the world's ranks prefill, the second half decode (rank ``i`` pairs with
``i + world / 2``; ``compile.engine.disaggregation``). ``both`` starts the two roles as ranks 0
and 1 of a 2-process group (two ``python -m compile`` child processes with a torchrun-style
environment, as torchrun starts them); with one
GPU both use it and the transfer runs over gloo through the host (NCCL does not pair two
ranks on one device). Rank 0 (prefill) gets the decode side's outputs, decode step log and
per-request transfer log back at the end, prints the report and runs ``--verify``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from compile.backend.parallel_state import ParallelConfig
from compile.engine.cli_args import page_size, positive_int
from compile.engine.disaggregation import ROLES, role_of
from compile.engine.forwards import MODES, make_forward


def add_disaggregation_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--disaggregation``, ``--decode-page-size``, ``--decode-mode``,
    ``--transfer-backend`` and ``--transfer-timeout`` to a ``generate`` parser."""
    parser.add_argument("--disaggregation", choices=("prefill", "decode", "both"),
                        default=argparse.SUPPRESS,
                        help="run prefill and decode in separate processes (both: spawn the "
                             "two; prefill/decode: this rank's role under torchrun)")
    parser.add_argument("--decode-page-size", type=page_size, default=argparse.SUPPRESS,
                        help="page size of the decode engine (default --page-size)")
    parser.add_argument("--decode-mode", choices=MODES, default=argparse.SUPPRESS,
                        help="--mode of the decode engine (default --mode)")
    parser.add_argument("--transfer-backend", choices=("auto", "gloo"), default="auto",
                        help="auto: gloo on the CPU, NCCL/XCCL on GPUs; gloo: through the host")
    parser.add_argument("--transfer-timeout", type=positive_int, default=600,
                        help="seconds a transfer may wait for the peer (the process group's)")


def check_disaggregation_arguments(args) -> None:
    """Argument errors found before any process starts: ``--decode-page-size``,
    ``--decode-mode`` or a ``--transfer-*`` value other than the default without
    ``--disaggregation`` (they would be ignored), ``--tp``/``--dcp`` beside
    ``--disaggregation both`` (found before its two processes spawn)."""
    if args.disaggregation is None:
        for flag, value, what in (
                ("--decode-page-size", args.decode_page_size, "the decode engine"),
                ("--decode-mode", args.decode_mode, "the decode engine"),
                ("--transfer-backend", None if args.transfer_backend == "auto"
                 else args.transfer_backend, "the transfer"),
                ("--transfer-timeout", None if args.transfer_timeout == 600
                 else args.transfer_timeout, "the transfer")):
            if value is not None:
                args.error(f"argument {flag}: sets {what} of a disaggregated run; "
                           f"expected --disaggregation prefill|decode|both beside it, got "
                           f"{flag} {value} alone")
    elif args.disaggregation == "both" and args.tp * args.dcp > 1:
        args.error("argument --disaggregation: expected --tp 1 --dcp 1 beside it, got "
                   f"--tp {args.tp} --dcp {args.dcp}")


def launch_both(argv: list[str], device_type: str) -> int:
    """Run ``python -m compile`` with ``argv`` (holding ``--disaggregation both``) as a prefill
    rank 0 and a decode rank 1, each a child process with a torchrun-style environment (each
    rank on its own GPU when there are two or more, else both on the one, the transfer then
    through the host over gloo); returns 0 when both exit cleanly, else the first failing
    status (the other rank is then stopped)."""
    gpus = getattr(torch, device_type).device_count() if device_type != "cpu" else 0
    port, procs = free_port(), []
    try:
        for rank, role in enumerate(ROLES):
            procs.append(subprocess.Popen([sys.executable, "-m", "compile",
                                           *role_argv(argv, role, gpus)],
                                          env=_rank_env(rank, port, gpus)))
        return _wait(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def role_argv(argv: list[str], role: str, gpus: int) -> list[str]:
    """``argv`` with ``--disaggregation both`` (or ``=both``) turned into ``role``, plus
    ``--transfer-backend gloo`` when both ranks share one GPU (NCCL refuses two ranks on one
    device)."""
    args = [role if a == "both" and i and argv[i - 1] == "--disaggregation" else a
            for i, a in enumerate(argv)]
    args = [a.replace("--disaggregation=both", f"--disaggregation={role}") for a in args]
    return args + (["--transfer-backend", "gloo"] if gpus == 1 else [])


def _rank_env(rank: int, port: int, gpus: int) -> dict[str, str]:
    """This environment plus torchrun's variables for ``rank`` of 2, and the folder holding
    the ``compile`` package first on ``PYTHONPATH`` (the child imports this same copy)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank if gpus > 1 else 0), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _wait(procs: list[subprocess.Popen]) -> int:
    """Wait for every process; the first non-zero exit stops the others and is returned (1 for
    a process ended by a signal)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = next((c for c in codes if c not in (None, 0)), None)
        if failed is not None:
            rank = codes.index(failed)
            how = f"status {failed}" if failed > 0 else f"signal {-failed}"
            print(f"[generate] the {ROLES[rank]} rank exited with {how}; stopping the other",
                  file=sys.stderr, flush=True)
            return failed if failed > 0 else 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_disaggregation(args, device: torch.device) -> tuple[ParallelConfig, torch.device]:
    """Join the process group for ``--disaggregation prefill|decode``; returns a one-process
    ``ParallelConfig`` and this rank's device. Exits with an argument error (status 2) for an
    odd world, a role that is not this rank's, or ``--tp``/``--dcp`` beside it."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world < 2 or world % 2:
        args.error(f"argument --disaggregation: expected an even number of processes (prefill "
                   f"ranks then as many decode ranks; or --disaggregation both), got {world}")
    if role_of(rank, world) != args.disaggregation:
        args.error(f"argument --disaggregation: rank {rank} of {world} has the "
                   f"{role_of(rank, world)} role (the first half prefill); expected "
                   f"--disaggregation {role_of(rank, world)}, got {args.disaggregation} "
                   "(several torchrun nodes: start each with --master-addr HOST --master-port "
                   "PORT, where --node-rank sets the ranks; c10d ranks nodes as they join)")
    if args.tp * args.dcp > 1:
        args.error("argument --disaggregation: expected --tp 1 --dcp 1 beside it, got "
                   f"--tp {args.tp} --dcp {args.dcp}")
    if device.type in ("cuda", "xpu"):
        device = torch.device(device.type, int(os.environ.get("LOCAL_RANK", "0")))
        getattr(torch, device.type).set_device(device)
    backend = ("gloo" if device.type == "cpu" or args.transfer_backend == "gloo" else
               {"cuda": "nccl", "xpu": "xccl"}[device.type])
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.transfer_timeout))
    return ParallelConfig(), device


def run_disaggregated(model, args, prompt_ids, stops):
    """This rank's half of ``generate``: ``(outputs per prompt, stats, forward)``. Each
    prefill/decode pair serves its share of the prompts (``pair_prompts``); a prefill rank gets
    its pair's outputs and decode stats back from its decode rank, and rank 0 then gathers every
    pair's outputs (its stats stay its own pair's)."""
    from compile.engine import Engine, SamplingParams

    prefill = args.disaggregation == "prefill"
    ps = args.page_size if prefill else (args.decode_page_size or args.page_size)
    mode = args.mode if prefill else (args.decode_mode or args.mode)
    forward = make_forward(model, mode, inductor=not args.no_inductor)
    longest = max(len(p) for p in prompt_ids) + args.max_new_tokens
    total = sum(len(p) + args.max_new_tokens for p in prompt_ids)
    engine = Engine(model, forward=forward, page_size=ps, max_running=len(prompt_ids),
                    max_context_len=longest, max_total_tokens=total + ps * len(prompt_ids),
                    chunked_prefill_size=args.chunked_prefill_size,
                    disaggregation=args.disaggregation)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, stop_token_ids=stops)
    mine = pair_prompts(len(prompt_ids), dist.get_rank(), dist.get_world_size())
    failed: set[int] = set()  # request ids that failed on either side of the pair
    if prefill:
        first = engine.generate([prompt_ids[i] for i in mine], sampling)  # first tokens
        engine.disagg.close()
    else:
        engine.generate([])
    try:
        if prefill:
            outputs, failed = _collect(engine, len(mine), args.max_new_tokens)
        else:
            outputs = _reply(engine, len(mine), args.max_new_tokens)
    except RuntimeError as e:  # the peer is gone: its side of the results is lost
        peer = engine.disagg.peer
        print(f"[generate] the {ROLES[1 - ROLES.index(args.disaggregation)]} rank {peer} is "
              f"gone ({' '.join(str(e).split())[:200]}); its results are lost",
              file=sys.stderr, flush=True)
        outputs, failed = (first if prefill else []), set(range(len(mine)))
    for rid, why in sorted(engine.disagg.errors.items()):
        print(f"[generate] request {mine[rid]} failed: {why}", file=sys.stderr, flush=True)
    # the prefill rank answers for its pair (the decode rank's reasons are on its stderr); a
    # decode rank only when its prefill rank is gone
    n_failed = len(failed | set(engine.disagg.errors)) if prefill else len(failed)
    args.failed_requests = (n_failed, len(mine))
    outputs = outputs if prefill else []
    try:
        return _gather(outputs, mine, len(prompt_ids)), engine.stats, forward
    except RuntimeError as e:  # several pairs and a rank is gone: rank 0 keeps its own pair's
        print(f"[generate] gathering every pair's outputs on rank 0 failed: a rank is gone "
              f"({' '.join(str(e).split())[:200]})", file=sys.stderr, flush=True)
        args.failed_requests = (len(prompt_ids), len(prompt_ids))
        return _placed(len(prompt_ids), [(mine, outputs)]), engine.stats, forward


def pair_prompts(n: int, rank: int, world: int) -> list[int]:
    """Indices of the prompts (of ``n``) that ``rank``'s prefill/decode pair serves: pair ``p``
    (prefill rank ``p``, decode rank ``p + world / 2``) takes prompts ``p, p + pairs, ...``."""
    pairs = world // 2
    return list(range(rank % pairs, n, pairs))


def _gather(outputs: list[list[int]], mine: list[int], n: int) -> list[list[int]]:
    """Rank 0: the outputs of all ``n`` prompts, every prefill rank's ``outputs`` of its
    prompts ``mine`` gathered (one pair: nothing to gather); other ranks: their own."""
    if dist.get_world_size() == 2:
        return outputs
    got = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((mine, outputs), got, dst=0)
    if got is None:
        return outputs
    return _placed(n, got)


def _placed(n: int, parts) -> list[list[int]]:
    """The outputs of ``n`` prompts from ``(prompt indices, their outputs)`` pairs; a prompt no
    pair answers gets ``[]`` (decode ranks send no outputs)."""
    full: list[list[int]] = [[] for _ in range(n)]
    for indices, outs in parts:
        for i, ids in zip(indices, outs):
            full[i] = ids
    return full


def _reply(engine, n: int, max_new: int) -> list[list[int]]:
    """Decode rank: send outputs, decode step log and transfer log to the prefill rank."""
    role, got = engine.disagg, engine.disagg.outputs()
    outputs = [got.get(i, []) for i in range(n)]
    out = torch.full((n, max_new), -1, dtype=torch.int64)
    for i, ids in enumerate(outputs):
        out[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    st = engine.stats
    steps = torch.tensor([[b, s, float(i in st.compiled_decode_steps)]
                          for i, (b, s) in enumerate(st.decode_step_log)], dtype=torch.float64)
    log = torch.tensor([list(t) for t in role.transfer_log], dtype=torch.float64)
    sizes = torch.tensor([len(st.decode_step_log), len(role.transfer_log), len(role.errors)],
                         dtype=torch.int64)
    failed = torch.tensor(sorted(role.errors), dtype=torch.int64)
    for t in (sizes, out, steps.reshape(-1, 3), log.reshape(-1, 4), failed):
        if t.numel():
            dist.send(t.to(role.wire), role.peer)
    return outputs


def _collect(engine, n: int, max_new: int) -> tuple[list[list[int]], set[int]]:
    """Prefill rank: receive ``_reply``'s tensors; fold the decode stats into
    ``engine.stats`` and print the transfer summary. Returns the outputs and the ids of the
    requests the decode rank failed."""
    role = engine.disagg
    sizes = torch.empty(3, dtype=torch.int64, device=role.wire)
    dist.recv(sizes, role.peer)
    n_steps, n_log, n_failed = sizes.tolist()
    out = torch.empty((n, max_new), dtype=torch.int64, device=role.wire)
    if out.numel():  # a pair with no prompt sends none
        dist.recv(out, role.peer)
    steps = torch.empty((n_steps, 3), dtype=torch.float64, device=role.wire)
    log = torch.empty((n_log, 4), dtype=torch.float64, device=role.wire)
    failed = torch.empty(n_failed, dtype=torch.int64, device=role.wire)
    for t in (steps, log, failed):
        if t.numel():
            dist.recv(t, role.peer)
    st = engine.stats
    for i, (b, s, compiled) in enumerate(steps.tolist()):
        st.decode_step_log.append((int(b), s))
        st.decode_tokens, st.decode_seconds = st.decode_tokens + int(b), st.decode_seconds + s
        if compiled:
            st.compiled_decode_steps.add(i)
    print(transfer_summary(log.tolist(), st.prefill_seconds, n, role.pack_seconds),
          flush=True)
    return [[t for t in row if t >= 0] for row in out.tolist()], set(failed.tolist())


def transfer_summary(log: list, prefill_seconds: float, n: int,
                     pack_seconds: Optional[float] = None) -> str:
    """One line: requests transferred, bytes, mean transfer ms per request (decode side:
    receive and write) against mean prefill ms per request."""
    if not log:
        return "transfer: no request transferred"
    sent = sum(row[2] for row in log)
    per = 1e3 * sum(row[3] for row in log) / len(log)
    pack = "" if pack_seconds is None else f", pack {1e3 * pack_seconds / len(log):.2f} ms"
    return (f"transfer: {len(log)} requests, {sent / 2**20:.2f} MiB, {per:.2f} ms per request "
            f"(receive + write){pack}; prefill {1e3 * prefill_seconds / max(n, 1):.2f} ms per "
            "request")


__all__ = ["check_disaggregation_arguments", "add_disaggregation_arguments", "launch_both",
           "role_argv", "free_port", "pair_prompts", "start_disaggregation", "run_disaggregated",
           "transfer_summary"]
