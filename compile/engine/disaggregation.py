"""Prefill/decode disaggregation: a prefill engine hands finished prompts to a decode engine.

As sglang's ``--disaggregation-mode prefill|decode``: one process group of prefill ranks runs
EXTEND steps only; when a request's prompt is fully cached and its first token sampled, its
state (``compile.engine.kv_transfer`` handlers: KV of every cached layer, the sliding-window
layers' live window, linear-attention states) is sent to the paired decode rank over
``torch.distributed`` point-to-point (gloo on the CPU, NCCL on CUDA, XCCL on XPU) and its pages
are freed at once (the state was gathered into send buffers). The decode engine allocates a
row and its own pages, receives into token-ordered buffers and writes them with the pool's
store ops, so the two sides' page sizes and modes (graphs included) are independent.

Wire format per request, all ``isend``/``irecv`` on the pair (FIFO): a header
``int64 [HEADER_LEN]`` (``KIND_REQUEST`` or ``KIND_END``, rid, prompt length, first token,
max_new_tokens, number of stop ids, number of payload tensors, payload bytes, temperature
as float64 bits, finished flag), then ``int64 [prompt_len + n_stop]`` (prompt ids, stop ids),
then each handler's tensors. The decode side checks the tensor count and bytes against
its own handlers before receiving (a mismatch fails the request; on gloo its payload is
drained into byte buffers and the stream goes on, elsewhere the stream closes). Sends are
waited lazily (the next prefill step overlaps them); a failed wait (peer gone, the group's
timeout) marks the request failed with the error.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from compile.engine.kv_transfer import state_handlers
from compile.engine.request import Req
from compile.engine.sampling import SamplingParams, sample

ROLES = ("prefill", "decode")
HEADER_LEN = 10
KIND_END, KIND_REQUEST = 0, 1
FAILED = "failed"
TRANSFERRED = "transferred"


def paired_rank(rank: int, world_size: int) -> int:
    """The other role's rank paired with ``rank``: the first half of the world prefills, the
    second half decodes, rank ``i`` pairs with ``i + world_size // 2``."""
    half = world_size // 2
    return rank + half if rank < half else rank - half


def role_of(rank: int, world_size: int) -> str:
    """``prefill`` for the first half of the ranks, ``decode`` for the second."""
    return "prefill" if rank < world_size // 2 else "decode"


def check_role(role, peer) -> None:
    """``ValueError`` unless ``role`` is None or one of ``ROLES``, with an initialised default
    process group and ``peer`` another rank of it (None: ``paired_rank``, which needs an even
    world of 2 or more ranks); ``TypeError`` for a ``peer`` that is no int (a bool included)."""
    if role is None:
        return
    if role not in ROLES:
        raise ValueError(f"Engine: disaggregation is {role!r}; expected None, 'prefill' or "
                         "'decode'.")
    if not dist.is_initialized():
        raise ValueError(f"Engine: disaggregation={role!r} needs torch.distributed; expected an "
                         "initialised default process group, got none. Call "
                         "torch.distributed.init_process_group first (or run under torchrun).")
    if peer is not None and (isinstance(peer, bool) or not isinstance(peer, int)):
        raise TypeError(f"Engine: disaggregation_peer has type {type(peer).__name__}; expected "
                        f"an int rank, got {peer!r}.")
    rank, world = dist.get_rank(), dist.get_world_size()
    if peer is None and (world < 2 or world % 2):
        raise ValueError(f"Engine: disaggregation={role!r} pairs rank i with rank i + world / 2 "
                         f"when disaggregation_peer is None; expected an even world of 2 or more "
                         f"ranks, got {world}. Start prefill and decode ranks in equal numbers "
                         "or name the peer.")
    if peer is not None and not (0 <= peer < world and peer != rank):
        raise ValueError(f"Engine: disaggregation_peer is not another rank of the group; "
                         f"expected an int in [0, {world}) other than this rank ({rank}), got "
                         f"{peer}.")


def make_role(engine, role: Optional[str], peer: Optional[int]):
    """The role object an ``Engine`` built with ``disaggregation=role`` drives (None: none).
    Waits use the process group's timeout (``init_process_group(timeout=...)``)."""
    if role is None:
        return None
    peer = paired_rank(dist.get_rank(), dist.get_world_size()) if peer is None else peer
    cls = PrefillRole if role == "prefill" else DecodeRole
    return cls(engine, peer)


def _why(err: Exception) -> str:
    """One line of an exception, at most 300 characters."""
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def _sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (GPU timings); nothing on the CPU."""
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


class _Arrival:
    """A posted ``irecv`` that can be asked whether it completed without blocking. gloo's
    receive work reports ``is_completed()`` False until it is waited (torch 2.13), so on the
    host wire a daemon thread waits it; ``wait`` then re-raises that wait's error. Without
    this a decode rank on gloo takes no request while others run (decode batches of 1)."""

    def __init__(self, work, threaded: bool):
        self.work, self.error = work, None
        self.done = threading.Event() if threaded else None
        if threaded:
            threading.Thread(target=self._wait, daemon=True).start()

    def _wait(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as e:  # raised in the engine's thread by wait()
            self.error = e
        finally:
            self.done.set()

    def is_completed(self) -> bool:
        return self.done.is_set() if self.done is not None else self.work.is_completed()

    def wait(self) -> None:
        """Block until the receive completed; ``RuntimeError`` if it failed."""
        if self.done is None:
            self.work.wait()
            return
        self.done.wait()
        if self.error is not None:
            raise self.error


class _Role:
    def __init__(self, engine, peer: int):
        self.engine, self.peer = engine, peer
        # gloo moves host tensors: device state is staged through the CPU (two processes on
        # one GPU, where NCCL refuses to pair them, transfer this way)
        self.wire = torch.device("cpu") if dist.get_backend() == "gloo" else engine.device
        self.handlers = state_handlers(engine)
        self.errors: dict[int, str] = {}  # rid -> why it failed
        self.broken: Optional[str] = None  # set once the peer is unusable

    def _payload_size(self, prompt_len: int) -> tuple[int, int]:
        """``(tensors, bytes)`` of a request's payload: bytes, not elements, so a KV dtype
        that differs between the sides (float32 and bfloat16 rows) is caught."""
        bufs = [b for h in self.handlers for b in h.buffers(prompt_len)]
        return len(bufs), sum(b.numel() * b.element_size() for b in bufs)

    def _fail(self, req, why: str) -> None:
        self.errors[req.rid] = why
        req.finish_reason = FAILED


class PrefillRole(_Role):
    """Prefill side: after the step that caches a prompt, sample its first token, pack its
    state, ``isend`` it and free its pages; sends are waited at later steps."""

    def __init__(self, engine, peer: int):
        super().__init__(engine, peer)
        self.in_flight: list[tuple[object, list[Tensor], list]] = []  # (req, buffers, works)
        self.closed = False
        self.pack_seconds = 0.0  # gathering requests' state into send buffers

    def finish_prefill(self, reqs: list, logits: Tensor) -> list:
        """Sample the first token of each of ``reqs`` (their prompts now cached), send them and
        release them; returns them (all finished on this side)."""
        self.poll()
        if not reqs:
            return []
        temps = torch.tensor([r.sampling.temperature for r in reqs], device=logits.device)
        tokens = sample(logits, temps, self.engine.generator).tolist()
        for req, tok in zip(reqs, tokens):
            req.output_ids.append(tok)
            done = (tok in req.sampling.stop_token_ids
                    or len(req.output_ids) >= req.sampling.max_new_tokens)
            self._send(req, done)
            self.engine.release(req, req.finish_reason or TRANSFERRED)
        return list(reqs)

    def _send(self, req, done: bool) -> None:
        if self.broken is not None:
            self._fail(req, self.broken)
            return
        s = req.sampling
        n_tensors, nbytes = self._payload_size(len(req.prompt_ids))
        temp_bits = torch.tensor([float(s.temperature)], dtype=torch.float64).view(torch.int64)
        header = torch.tensor([KIND_REQUEST, req.rid, len(req.prompt_ids), req.output_ids[0],
                               s.max_new_tokens, len(s.stop_token_ids), n_tensors, nbytes,
                               int(temp_bits), int(done)], dtype=torch.int64)
        ids = torch.tensor(list(req.prompt_ids) + list(s.stop_token_ids), dtype=torch.int64)
        t0 = time.perf_counter()
        payload = [t.to(self.wire).contiguous() for h in self.handlers for t in h.pack(req)]
        _sync(self.engine.device)
        self.pack_seconds += time.perf_counter() - t0
        bufs = [header.to(self.wire), ids.to(self.wire)] + payload
        try:
            works = [dist.isend(b, self.peer) for b in bufs]
        except RuntimeError as e:
            self._broken(req, e)
            return
        self.in_flight.append((req, bufs, works))

    def _broken(self, req, err: Exception) -> None:
        """The pair is unusable: fail ``req`` (None: the end-of-stream marker) and every
        request sent later."""
        what = "the end-of-stream marker" if req is None else f"request {req.rid}"
        self.broken = f"disaggregation: sending {what} to decode rank {self.peer} failed " \
                      f"({_why(err)})"
        if req is not None:
            self._fail(req, self.broken)

    def poll(self, wait_all: bool = False) -> None:
        """Wait the sends that are done (all with ``wait_all``); a failed one fails its request
        and every later one (the pair is broken)."""
        keep = []
        for req, bufs, works in self.in_flight:
            if self.broken is not None:  # a send before this one failed: no use waiting
                if req is not None:
                    self._fail(req, self.broken)
                continue
            if not wait_all and not all(w.is_completed() for w in works):
                keep.append((req, bufs, works))
                continue
            try:
                for w in works:
                    w.wait()
            except RuntimeError as e:
                self._broken(req, e)
        self.in_flight = keep

    def close(self) -> None:
        """Tell the decode side no more requests come and wait every send."""
        if not self.closed and self.broken is None:
            end = torch.zeros(HEADER_LEN, dtype=torch.int64)
            try:
                end = end.to(self.wire)
                self.in_flight.append((None, [end], [dist.isend(end, self.peer)]))
            except RuntimeError as e:
                self.broken = f"disaggregation: closing the stream failed ({e})"
        self.closed = True
        self.poll(wait_all=True)

    def has_work(self) -> bool:
        """Never keeps ``Engine.generate`` going: sends finish in ``close``."""
        return False


class DecodeRole(_Role):
    """Decode side: receive requests (header first, then the payload), allocate a row and
    pages, write the state and add each to ``engine.running`` with its first token. A header
    that arrives while the pool is full waits (``pending``) until running requests finish."""

    def __init__(self, engine, peer: int):
        super().__init__(engine, peer)
        self.header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.wire)
        self.header_work = None  # the next header's irecv, posted after the last payload
        self.pending: Optional[list[int]] = None  # a received header waiting for room
        self.open = True
        self.received: list = []  # every request received, in order (failed ones too)
        # per request received: (rid, prompt tokens, payload bytes, seconds from posting the
        # payload's receives to its state written into the pools)
        self.transfer_log: list[tuple[int, int, int, float]] = []

    def has_work(self) -> bool:
        """True while the prefill side may still send."""
        return self.open

    def poll(self) -> None:
        """Take in every request whose header arrived (block for one while nothing runs)."""
        while self.open:
            if self.pending is None:
                try:
                    if self.header_work is None:  # posted only now: receives match in order
                        self.header_work = _Arrival(dist.irecv(self.header, self.peer),
                                                    threaded=self.wire.type == "cpu")
                    if self.engine.running and not self.header_work.is_completed():
                        return
                    self.header_work.wait()
                except RuntimeError as e:  # posting fails too once the peer is gone
                    return self._close(f"disaggregation: waiting for prefill rank {self.peer} "
                                       f"failed ({_why(e)})")
                self.pending, self.header_work = self.header.tolist(), None
                if self.pending[0] == KIND_END:
                    self.open = False
                    return
            if not self._fits(self.pending) and self.engine.running:
                return  # decode until running requests free their pages
            h, self.pending = self.pending, None
            self._take(h)

    def _close(self, why: str) -> None:
        self.open, self.broken = False, why

    def _fits(self, h: list[int]) -> bool:
        return self.engine.has_room(h[2] + h[4])  # prompt + max_new_tokens

    def _recv(self, bufs: list[Tensor]) -> None:
        for w in [dist.irecv(b, self.peer) for b in bufs]:
            w.wait()

    def _take(self, h: list[int]) -> None:
        """Receive the request of header ``h``: ids, then (if it fits) its state."""
        req = self._read_request(h)
        if req is None:
            return
        n, n_tensors, nbytes = len(req.prompt_ids), h[6], h[7]
        if (n_tensors, nbytes) != self._payload_size(n):
            why = self._mismatch(req, n_tensors, nbytes)
            if self.wire.type != "cpu":  # NCCL/XCCL receives must match sizes: stop here
                return self._close(why)
            return self._drain_bytes(n_tensors, nbytes, req.rid)
        bufs = [torch.empty(b.shape, dtype=b.dtype, device=self.wire)
                for hd in self.handlers for b in hd.buffers(n)]
        if not self._fits(h):  # nothing runs and it still does not fit: drain and fail it
            self._fail(req, f"disaggregation: request {req.rid} needs more pages, rows or "
                       "context than the decode engine has; expected max_running, "
                       "max_context_len and max_total_tokens at least the prefill engine's.")
            return self._drain(bufs, req.rid)
        self.engine.admit_prefilled(req)
        t0 = time.perf_counter()
        try:
            self._recv(bufs)
        except RuntimeError as e:
            why = (f"disaggregation: receiving request {req.rid} from prefill rank {self.peer} "
                   f"failed ({_why(e)})")
            self._fail(req, why)
            self.engine.release(req, FAILED)
            return self._close(why)
        self._write(req, bufs)
        _sync(self.engine.device)
        self.transfer_log.append((req.rid, n, sum(b.numel() * b.element_size() for b in bufs),
                                  time.perf_counter() - t0))
        if h[9]:  # finished on the prefill side: its first token was the last
            first = req.output_ids[0]
            self.engine.release(req, "stop" if first in req.sampling.stop_token_ids
                                 else "length")

    def _read_request(self, h: list[int]):
        """The ``Req`` of header ``h`` with its prompt, sampling and first token (its ids
        received), or None when receiving them failed (the stream is closed then)."""
        _, rid, n, first, max_new, n_stop, _, _, temp_bits, _ = h
        ids = torch.empty(n + n_stop, dtype=torch.int64, device=self.wire)
        try:
            self._recv([ids])
        except RuntimeError as e:
            self.errors[rid] = (f"disaggregation: receiving request {rid} from prefill rank "
                                f"{self.peer} failed ({_why(e)})")
            self._close(self.errors[rid])
            return None
        temp = torch.tensor([temp_bits], dtype=torch.int64).view(torch.float64).item()
        ids = ids.tolist()
        req = Req(rid, ids[:n], SamplingParams(max_new_tokens=max_new, temperature=temp,
                                               stop_token_ids=tuple(ids[n:])), output_ids=[first])
        self.received.append(req)
        return req

    def _drain(self, bufs: list[Tensor], rid: int) -> None:
        try:
            self._recv(bufs)
        except RuntimeError as e:
            self._close(f"disaggregation: receiving request {rid} failed ({_why(e)})")

    def _drain_bytes(self, n_tensors: int, nbytes: int, rid: int) -> None:
        """Receive and drop a payload of ``n_tensors`` tensors, ``nbytes`` in all, whose shapes
        this engine does not know: gloo takes a message into any buffer at least its size, so
        each goes, one at a time, into one byte buffer."""
        buf = torch.empty(nbytes, dtype=torch.uint8)
        for _ in range(n_tensors):
            self._drain([buf], rid)
            if not self.open:
                return

    def _write(self, req, bufs: list[Tensor]) -> None:
        at = 0
        for hd in self.handlers:
            k = len(hd.buffers(0))
            hd.unpack(req, [b.to(self.engine.device) for b in bufs[at:at + k]])
            at += k

    def _mismatch(self, req, n_tensors: int, nbytes: int) -> str:
        want = self._payload_size(len(req.prompt_ids))
        why = (f"disaggregation: request {req.rid}'s state does not match this engine's pools; "
               f"expected {want[0]} tensors of {want[1]} bytes, got {n_tensors} of {nbytes}. "
               "Run the same model (and KV dtype) on both sides.")
        self._fail(req, why)
        return why

    def outputs(self) -> dict[int, list[int]]:
        """Generated ids (first token included) of every request received, by rid."""
        return {r.rid: r.output_ids for r in self.received}


__all__ = ["ROLES", "PrefillRole", "DecodeRole", "paired_rank", "role_of",
           "check_role", "make_role", "HEADER_LEN", "FAILED", "TRANSFERRED"]
