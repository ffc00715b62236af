"""An attention-only model for graph tests of the speculative modes, its float64 oracle, and
the random batches of each mode.

``AttentionProbe`` maps token id ``t`` to row ``t`` of fixed random q/k/v tables per layer (on
an MLA harness: q and the latent key, whose first ``dv`` entries are the value), so a step's
inputs are fresh random vectors the test knows exactly; its output is every layer's
attention side by side. A ``GraphRunner`` runs it like a model (its step buffers, metadata
refill, capture and replay), and the oracle (``tests/compile/oracle.py``) recomputes each
query row from the logical K/V: cached prefix plus the tokens the row may see.

Every batch builder returns ``Step``: new requests with random prefixes over shuffled pages
(NaN in every unused cache slot), host token ids, and per query row the tokens it sees.
``run_schedule`` runs batches of changing sizes through a runner and eagerly.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from compile.backend import PagedAttention
from compile.batch import ForwardBatch, ForwardMode, SpecInfo
from tests.compile.oracle import Harness, Req, assert_close, attention_oracle, random_tree

SIZES = (3, 4, 1, 2, 3)  # requests per step; buckets 4 (warm-up), 4 (capture), 1, 2, 4 (replay)
BUCKETS = (1, 2, 4)
MAX_PREFIX = 70


class AttentionProbe(nn.Module):
    """``forward(input_ids [T], positions [T], forward_batch) -> [T, L * Hq * Dv]``, on
    ``h.device``.

    Args:
        h: the oracle harness (dims, dtype, generator, device).
        layers: the attention layers (``PagedAttention``), run in order.
        vocab: table rows (token ids must be below it).
        sinks: [Hq] float32 attention-sink logits every layer passes, or None.
    """

    def __init__(self, h: Harness, layers: Sequence[PagedAttention], vocab: int = 512,
                 sinks: Optional[Tensor] = None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        n, dv = len(layers), layers[0].v_head_dim
        self.register_buffer("q", h.rand(n, vocab, h.hq * h.d).to(h.dtype))
        self.register_buffer("k", h.rand(n, vocab, h.hkv, h.d).to(h.dtype))
        self.mla_rank = dv if h.mla else 0  # MLA: the value is the key's latent part
        self.register_buffer("v", self.k[..., :dv].clone() if h.mla
                             else h.rand(n, vocab, h.hkv, dv).to(h.dtype))
        self.anchor = nn.Parameter(torch.zeros(1))  # runners read the device off a parameter
        self.to(h.device)
        self.sinks = None if sinks is None else sinks.to(h.device)

    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch) -> Tensor:
        outs = []
        for i, layer in enumerate(self.layers):
            q, k = self.q[i][input_ids], self.k[i][input_ids]
            if self.mla_rank:  # absorbed MLA: latent and rope key parts, no separate value
                r = self.mla_rank
                outs.append(layer(q, k[..., :r], None, forward_batch, k_rope=k[..., r:],
                                  sinks=self.sinks))
            else:
                outs.append(layer(q, k, self.v[i][input_ids], forward_batch, sinks=self.sinks))
        return torch.cat(outs, dim=-1)


@dataclasses.dataclass
class Step:
    """One random batch: its requests, batch, host ``ids``/``positions`` [T], the token ids
    ``seen[t]`` query row ``t`` sees after its request's prefix (tree order, its own token
    last) and ``row_request[t]``, the request of row ``t``."""

    reqs: list[Req]
    fb: ForwardBatch
    ids: Tensor
    positions: Tensor
    seen: list[Tensor]
    row_request: list[int]


def tree_oracle(h: Harness, probe: AttentionProbe, step: Step,
                ids: Optional[Tensor] = None, seen: Optional[Sequence[Tensor]] = None
                ) -> Tensor:
    """Expected ``[T, L * Hq * Dv]`` float64 (host) of ``step`` (or of queries ``ids`` seeing
    ``seen``, same requests): each row over its request's cached prefix and the probe's K/V of
    its ``seen`` tokens, the query at the last position."""
    ids, seen = (step.ids, step.seen) if ids is None else (ids, seen)
    sinks = None if probe.sinks is None else probe.sinks.cpu()
    q_table, k_table, v_table = probe.q.cpu(), probe.k.cpu(), probe.v.cpu()
    rows = []
    for t, r in enumerate(step.row_request):
        per_layer = []
        for i, layer in enumerate(probe.layers):
            lid, w = layer.kv_cache_layer_id, layer.sliding_window_size
            req = step.reqs[r]
            keys = torch.cat([req.k[lid], h.quantize(k_table[i][seen[t]].double())])
            vals = torch.cat([req.v[lid], h.quantize(v_table[i][seen[t]].double())])
            q = q_table[i][ids[t]].double().view(1, h.hq, h.d)
            o = attention_oracle(q, keys, vals, scale=layer.scaling, softcap=layer.logit_cap,
                                 window_left=w if w >= 0 else -1, sinks=sinks,
                                 chunk=(h.chunk or 0) if layer.use_irope else 0)
            per_layer.append(o.reshape(1, -1))
        rows.append(torch.cat(per_layer, dim=-1))
    return torch.cat(rows)


def write_tokens(h: Harness, probe: AttentionProbe, slots: Tensor, ids: Tensor) -> None:
    """Cache the probe's K/V of tokens ``ids`` at ``slots`` in every layer (earlier draft steps'
    tokens, written without the backend)."""
    ids = ids.to(h.device)
    for i, layer in enumerate(probe.layers):
        h.write_direct(layer.kv_cache_layer_id, slots, probe.k[i][ids], probe.v[i][ids])


def flatten_sglang(masks: Sequence[Tensor], prefixes: Sequence[int]) -> Tensor:
    """sglang's flattened custom mask: per request ``[D, prefix + D]`` rows, prefix visible."""
    return torch.cat([torch.cat([torch.ones(m.shape[0], p, dtype=torch.bool), m], 1).reshape(-1)
                      for m, p in zip(masks, prefixes)])


def _ids(h: Harness, n: int, vocab: int = 512) -> Tensor:
    return torch.randperm(vocab, generator=h.gen)[:n]


def _requests(h: Harness, probe: AttentionProbe, b: int) -> tuple[list[Req], list[int]]:
    """``b`` new requests with random prefixes cached in every layer of ``probe`` (in a batch
    of 3 or more the last prefix is empty: a tree over no cached tokens)."""
    lids = sorted({layer.kv_cache_layer_id for layer in probe.layers})
    prefixes = torch.randint(0, MAX_PREFIX, (b,), generator=h.gen).tolist()
    if b >= 3:
        prefixes[-1] = 0
    return [h.add_request(p, layers=lids) for p in prefixes], prefixes


def _batch(h: Harness, mode, reqs, new_lens, loc, seq_lens, spec=None) -> ForwardBatch:
    fb = h.batch(mode, reqs, new_lens, loc, seq_lens, spec_info=spec)
    fb.token_to_kv_pool, fb.req_to_token_pool = h.pool, h.req_pool
    return fb


def _per_request(b: int, n: int) -> list[int]:
    return [r for r in range(b) for _ in range(n)]


def decode_batch(h: Harness, probe: AttentionProbe, b: int) -> Step:
    """A plain DECODE batch."""
    reqs, prefixes = _requests(h, probe, b)
    loc = torch.cat([h.alloc_slots(r, p, 1) for r, p in zip(reqs, prefixes)])
    fb = _batch(h, ForwardMode.DECODE, reqs, [1] * b, loc, [p + 1 for p in prefixes])
    ids = _ids(h, b)
    return Step(reqs, fb, ids, torch.tensor(prefixes), [ids[t:t + 1] for t in range(b)],
                list(range(b)))


def verify_batch(h: Harness, probe: AttentionProbe, b: int, d: int, *, tree: bool = True,
                 flat: bool = False, draft_token_num: int = 0) -> Step:
    """A TARGET_VERIFY batch of ``d`` drafts per request: random trees (topk 2; ``flat``: in
    sglang's flattened mask layout) or, ``tree`` False, a chain (topk 1, causal).
    ``draft_token_num`` > 0 (a chain): the spec input's ``draft_token_num``, with the width
    ``d`` in ``num_tokens_per_req`` (sglang 0.5.23's per-request verify width)."""
    reqs, prefixes = _requests(h, probe, b)
    loc = torch.cat([h.alloc_slots(r, p, d) for r, p in zip(reqs, prefixes)])
    if tree:
        trees = [random_tree(h.gen, d) for _ in reqs]
        mask = (flatten_sglang(trees, prefixes) if flat else torch.stack(trees)).to(h.device)
    else:
        trees, mask = [torch.ones(d, d, dtype=torch.bool).tril()] * b, None
    spec = SpecInfo(topk=2 if tree else 1, draft_token_num=draft_token_num or d,
                    custom_mask=mask, num_tokens_per_req=d if draft_token_num else -1)
    fb = _batch(h, ForwardMode.TARGET_VERIFY, reqs, [d] * b, loc, prefixes, spec)
    ids = _ids(h, b * d)
    pos = torch.cat([p + torch.arange(d) for p in prefixes])
    return Step(reqs, fb, ids, pos, [ids[row] for row in torch.block_diag(*trees)],
                _per_request(b, d))


def draft_batch(h: Harness, probe: AttentionProbe, b: int, topk: int, steps: int,
                step: int) -> Step:
    """A draft DECODE batch at draft step ``step`` of a round of ``steps``: ``topk`` branches
    per request, each over its earlier ``step`` drafts (cached here) and its query token."""
    reqs, prefixes = _requests(h, probe, b)
    scratch = h.add_request(0)  # the round's draft slots, laid out (b, topk, steps)
    loc = h.alloc_slots(scratch, 0, b * topk * steps).view(b, topk, steps)
    h.req_pool.free(scratch.row)
    all_ids = _ids(h, b * topk * (step + 1)).view(b, topk, step + 1)
    write_tokens(h, probe, loc[..., :step].reshape(-1), all_ids[..., :step].reshape(-1))
    fb = _batch(h, ForwardMode.DECODE, reqs, [topk] * b, loc.reshape(-1), prefixes,
                SpecInfo(topk=topk))
    pos = torch.tensor([p + step for p in prefixes for _ in range(topk)])
    return Step(reqs, fb, all_ids[..., step].reshape(-1), pos,
                list(all_ids.reshape(b * topk, -1)), _per_request(b, topk))


def draft_extend_batch(h: Harness, probe: AttentionProbe, b: int, d: int,
                       mode: ForwardMode = ForwardMode.DRAFT_EXTEND_V2) -> Step:
    """A draft extend (``mode`` DRAFT_EXTEND_V2, or EXTEND with a draft input): ``d`` causal
    new tokens per request."""
    reqs, prefixes = _requests(h, probe, b)
    loc = torch.cat([h.alloc_slots(r, p, d) for r, p in zip(reqs, prefixes)])
    spec = SpecInfo(topk=1, num_tokens_per_req=d)
    assert spec.is_draft_input()
    fb = _batch(h, mode, reqs, [d] * b, loc, [p + d for p in prefixes], spec)
    ids = _ids(h, b * d)
    pos = torch.cat([p + torch.arange(d) for p in prefixes])
    return Step(reqs, fb, ids, pos, [ids[t - t % d:t + 1] for t in range(b * d)],
                _per_request(b, d))


def round_batch(h: Harness, probe: AttentionProbe, b: int, topk: int, steps: int) -> Step:
    """A draft round's DECODE batch (``ids`` ``[b * topk, steps - 1]``: forward ``i``'s query
    tokens in column ``i``; ``seen`` the same rows): the round's slots follow the prefix in
    ``req_to_token`` for a chain (topk 1), else its own slots laid out ``(b, topk, steps)``."""
    reqs, prefixes = _requests(h, probe, b)
    if topk == 1:
        loc = torch.stack([h.alloc_slots(r, p, steps) for r, p in zip(reqs, prefixes)])
    else:
        scratch = h.add_request(0)
        loc = h.alloc_slots(scratch, 0, b * topk * steps).view(b, topk, steps)
        h.req_pool.free(scratch.row)
    fb = _batch(h, ForwardMode.DECODE, reqs, [topk] * b, loc.reshape(-1), prefixes,
                SpecInfo(topk=topk, spec_steps=steps))
    ids = _ids(h, b * topk * (steps - 1)).view(b * topk, steps - 1)
    pos = torch.tensor([prefixes[r] for r in _per_request(b, topk)])
    return Step(reqs, fb, ids, pos, list(ids), _per_request(b, topk))


def _addresses(meta) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in meta.tensors()}


def run_schedule(h: Harness, probe: AttentionProbe, runner, make: Callable[[int], Step],
                 sizes: Sequence[int] = SIZES) -> None:
    """Each batch ``make(b)`` through ``runner`` and eagerly: both equal the oracle, NaN-free;
    every descriptor's metadata addresses stay those of its first step; bucket 4 captures and
    replays once."""
    addresses, counts = {}, (runner.captures, runner.replays)
    for b in sizes:
        step = make(b)
        expected = tree_oracle(h, probe, step)
        ids, pos = step.ids.to(h.device), step.positions.to(h.device)
        assert runner.can_run(step.fb)
        with torch.no_grad():
            out = runner(ids, pos, step.fb)
            (desc, bound), = [(d, m) for d, m in runner.buffers.bound.items()
                              if m is h.backend.forward_metadata]
            assert_close(out.cpu(), expected)
            assert addresses.setdefault(desc, _addresses(bound)) == _addresses(bound)
            h.backend.init_forward_metadata(step.fb)
            assert_close(probe(ids, pos, step.fb).cpu(), expected)
        h.req_pool.free([r.row for r in step.reqs])
    assert (runner.captures - counts[0], runner.replays - counts[1]) == (1, 1)
    assert sorted(d.bucket for d in addresses) == list(BUCKETS)


def run_round(h: Harness, probe: AttentionProbe, runner, multi, b: int) -> None:
    """One draft round of ``b`` new requests through ``runner``: forward ``i`` with
    ``multi.attn_backends[i]`` attends each branch's drafts 0..i (forward i writes column i),
    then the same round eagerly. Every forward equals the oracle."""
    step = round_batch(h, probe, b, multi.topk, multi.speculative_num_steps)
    fb, n = step.fb, multi.speculative_num_steps - 1
    expected = [tree_oracle(h, probe, step, step.ids[:, i], [s[:i + 1] for s in step.seen])
                for i in range(n)]
    ids = [step.ids[:, i].contiguous().to(h.device) for i in range(n)]
    pos = [(step.positions + i).to(h.device) for i in range(n)]
    assert runner.can_run(fb)
    with torch.no_grad():
        for i, backend in enumerate(multi.attn_backends):
            fb.attn_backend = backend
            assert_close(runner(ids[i], pos[i], fb).cpu(), expected[i])
        multi.init_forward_metadata(fb)
        for i, backend in enumerate(multi.attn_backends):
            fb.attn_backend = backend
            assert_close(probe(ids[i], pos[i], fb).cpu(), expected[i])
    h.req_pool.free([r.row for r in step.reqs])


__all__ = ["SIZES", "BUCKETS", "AttentionProbe", "Step", "tree_oracle", "write_tokens",
           "random_tree", "flatten_sglang", "decode_batch", "verify_batch", "draft_batch",
           "draft_extend_batch", "round_batch", "run_schedule", "run_round"]
