"""An attention-only model for graph tests of the speculative modes, and its float64 oracle.

``AttentionProbe`` maps token id ``t`` to row ``t`` of fixed random q/k/v tables per layer (on
an MLA harness: q and the latent key, whose first ``dv`` entries are the value), so a step's
inputs are fresh random vectors the test knows exactly; its output is every layer's
attention side by side. A ``GraphRunner`` runs it like a model (its step buffers, metadata
refill, emulated capture and replay), and the oracle (``tests/compile/oracle.py``) recomputes
each query row from the logical K/V: cached prefix plus the draft tokens the row may see.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from compile.backend import PagedAttention
from tests.compile.oracle import Harness, attention_oracle


class AttentionProbe(nn.Module):
    """``forward(input_ids [T], positions [T], forward_batch) -> [T, L * Hq * Dv]``.

    Args:
        h: the oracle harness (dims, dtype, generator).
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
        self.sinks = sinks
        self.anchor = nn.Parameter(torch.zeros(1))  # runners read the device off a parameter

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


def tree_oracle(h: Harness, probe: AttentionProbe, reqs, ids: Tensor, seen: Sequence[Tensor],
                row_request: Sequence[int]) -> Tensor:
    """Expected ``[T, L * Hq * Dv]`` float64 of a speculative step.

    Query row ``t`` (token ``ids[t]`` of request ``row_request[t]``) sees that request's cached
    prefix, then the tokens ``seen[t]`` (ids, in tree order: ancestors first, its own token
    last), whose K/V are the probe's rows for them.
    """
    rows = []
    for t, r in enumerate(row_request):
        per_layer = []
        for i, layer in enumerate(probe.layers):
            lid, w = layer.kv_cache_layer_id, layer.sliding_window_size
            keys = torch.cat([reqs[r].k[lid], h.quantize(probe.k[i][seen[t]].double())])
            vals = torch.cat([reqs[r].v[lid], h.quantize(probe.v[i][seen[t]].double())])
            o = attention_oracle(probe.q[i][ids[t]].double().view(1, h.hq, h.d), keys, vals,
                                 scale=layer.scaling, softcap=layer.logit_cap,
                                 window_left=w if w >= 0 else -1, sinks=probe.sinks,
                                 chunk=(h.chunk or 0) if layer.use_irope else 0)
            per_layer.append(o.reshape(1, -1))
        rows.append(torch.cat(per_layer, dim=-1))
    return torch.cat(rows)


def write_tokens(h: Harness, probe: AttentionProbe, slots: Tensor, ids: Tensor) -> None:
    """Cache the probe's K/V of tokens ``ids`` at ``slots`` in every layer (earlier draft steps'
    tokens, written without the backend)."""
    for i, layer in enumerate(probe.layers):
        h.write_direct(layer.kv_cache_layer_id, slots, probe.k[i][ids], probe.v[i][ids])


def random_tree(gen: torch.Generator, d: int) -> Tensor:
    """Tree mask ``[D, D]`` bool: draft i sees its ancestors and itself (parent[i] < i)."""
    mask = torch.zeros(d, d, dtype=torch.bool)
    mask[0, 0] = True
    for i in range(1, d):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        mask[i] = mask[parent]
        mask[i, i] = True
    return mask


__all__ = ["AttentionProbe", "tree_oracle", "write_tokens", "random_tree"]
