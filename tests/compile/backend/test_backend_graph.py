"""Graph hooks: bind metadata to fixed buffers at one batch, refill with new lengths that cross
page and chunk boundaries, and check outputs equal a fresh eager build and the oracle while no
metadata address changes. A small graph runner is emulated: its own static ``req_pool_indices``,
``seq_lens`` and ``out_cache_loc`` and the backend's metadata buffers, padded rows filled with
``get_cuda_graph_seq_len_fill_value``.
"""

import pytest
import torch

from compile.batch import ForwardBatch, ForwardMode, SpecInfo
from tests.compile.oracle import Harness, assert_close

MAX_BS = 4


class StaticInputs:
    """The graph runner's static input buffers and metadata buffers."""

    def __init__(self, h, max_tokens):
        self.metadata = h.backend.graph_metadata_buffers(MAX_BS, max_tokens)
        self.bound = None
        self.req_pool_indices = torch.zeros(MAX_BS, dtype=torch.int64)
        self.seq_lens = torch.ones(MAX_BS, dtype=torch.int64)
        self.out_cache_loc = torch.zeros(max_tokens, dtype=torch.int64)

    def batch(self, h, mode, rows, seq_lens, loc, bs, spec=None):
        fill = h.backend.get_cuda_graph_seq_len_fill_value()
        n = len(rows)
        self.req_pool_indices.fill_(15)                 # an empty request row: padding
        self.seq_lens.fill_(fill)
        self.out_cache_loc.zero_()                      # padding rows write the padding slot
        self.req_pool_indices[:n] = torch.tensor(rows)
        self.seq_lens[:n] = torch.tensor(seq_lens)
        self.out_cache_loc[:loc.numel()] = loc
        tokens = loc.numel() // n * bs
        fb = ForwardBatch(forward_mode=mode, batch_size=bs,
                          req_pool_indices=self.req_pool_indices[:bs],
                          seq_lens=self.seq_lens[:bs], out_cache_loc=self.out_cache_loc[:tokens],
                          spec_info=spec)
        fb.attn_backend = h.backend
        return fb


def _harness(seed, **kw):
    return Harness(16, seed=seed, chunk=32, window=8, swa_layers=(1,), num_layers=3,
                   context_len=256, **kw)


def _layers(h):
    return [h.layer(0), h.layer(1, sliding_window_size=8), h.layer(2, use_irope=True)]


def _run_layers(h, fb, layers, reqs, n_new, bs):
    """Run each layer on random q/k/v for bs rows (real rows first); return real outputs."""
    n = len(reqs)
    outs = []
    for layer in layers:
        q = h.rand(bs * n_new, h.hq * h.d).float()
        k, v = h.rand(bs * n_new, h.hkv, h.d), h.rand(bs * n_new, h.hkv, h.d)
        out = layer(q, k.float(), v.float(), fb)[:n * n_new].double()
        h._append(reqs, [n_new] * n, layer.layer_id, k[:n * n_new], v[:n * n_new], 1.0)
        outs.append((out, q[:n * n_new].double(), k, v, q))
    return outs


def _addresses(backend):
    return {name: t.data_ptr() for name, t in backend.forward_metadata.tensors()}


def _step(h, static, layers, prefixes, n_new, mode, bs, spec=None):
    reqs = [h.add_request(p, layers=(0, 1, 2)) for p in prefixes]
    loc = torch.cat([h.alloc_slots(r, p, n_new) for r, p in zip(reqs, prefixes)])
    seq = [p + (n_new if mode == ForwardMode.DECODE else 0) for p in prefixes]
    fb = static.batch(h, mode, [r.row for r in reqs], seq, loc, bs, spec)
    static.bound = h.backend.fill_graph_metadata(fb, static.metadata, static.bound)
    assert h.backend.forward_metadata is static.bound
    outs = _run_layers(h, fb, layers, reqs, n_new, bs)
    for layer, (out, q, *_) in zip(layers, outs):
        assert_close(out, h.expected(reqs, [n_new] * len(reqs), layer, q))
    return fb, outs


@pytest.mark.parametrize("mode,n_new", [(ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 3)])
def test_bind_then_refill_matches_eager(mode, n_new):
    h = _harness(80, topk=1, draft_tokens=n_new if n_new > 1 else 0)
    spec = SpecInfo(topk=1, draft_token_num=n_new) if mode == ForwardMode.TARGET_VERIFY else None
    static, layers = StaticInputs(h, MAX_BS * n_new), _layers(h)
    _step(h, static, layers, [10, 3, 20, 5], n_new, mode, 4, spec)
    bound = _addresses(h.backend)
    # Refill: 3 real rows + 1 padded, lengths crossing page (16) and chunk (32) boundaries.
    fb, outs = _step(h, static, layers, [31, 63, 15], n_new, mode, 4, spec)
    assert _addresses(h.backend) == bound
    graph_meta = h.backend.forward_metadata
    # A fresh eager build over the same batch gives the same outputs (cache already written).
    h.backend.init_forward_metadata(fb)
    assert h.backend.forward_metadata is not graph_meta
    for layer, (out, q, k, v, q_all) in zip(layers, outs):
        eager = layer(q_all, None, None, fb)[:out.shape[0]].double()
        torch.testing.assert_close(eager, out, atol=1e-5, rtol=1e-5)


def test_graph_fill_value_and_unsupported():
    h = _harness(81, topk=2, draft_tokens=3)
    assert h.backend.get_cuda_graph_seq_len_fill_value() == 1
    static = StaticInputs(h, MAX_BS * 3)
    req = h.add_request(4, layers=(0, 1, 2))
    loc = h.alloc_slots(req, 4, 3)
    fb = static.batch(h, ForwardMode.EXTEND, [req.row], [7], loc, 1)
    with pytest.raises(NotImplementedError, match="mode EXTEND is not supported"):
        h.backend.fill_graph_metadata(fb, static.metadata)
    fb.forward_mode = ForwardMode.DECODE
    small = h.backend.graph_metadata_buffers(MAX_BS // 2, MAX_BS // 2)
    fb.batch_size = MAX_BS
    with pytest.raises(RuntimeError, match="batch size 4 exceeds the graph buffers"):
        h.backend.fill_graph_metadata(fb, small)


def test_sglang_graph_hooks_bind_at_capture_and_refill_at_replay():
    """sglang's runner calls: ``init_cuda_graph_state`` then ``init_forward_metadata_out_graph``
    with ``in_capture`` True (bind) and False (refill in place, same addresses)."""
    h = _harness(82)
    backend, static = h.backend, StaticInputs(h, MAX_BS)
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_out_graph(None)
    backend.init_cuda_graph_state(MAX_BS, MAX_BS)
    reqs = [h.add_request(p, layers=(0, 1, 2)) for p in (9, 30)]
    loc = torch.cat([h.alloc_slots(r, p, 1) for r, p in zip(reqs, (9, 30))])
    fb = static.batch(h, ForwardMode.DECODE, [r.row for r in reqs], [10, 31], loc, 2)
    with pytest.raises(RuntimeError, match="without a capture"):
        backend.init_forward_metadata_out_graph(fb)
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    captured = backend.forward_metadata
    assert _addresses(backend) == {n: t.data_ptr() for n, t in captured.tensors()}
    static.seq_lens[:2] = torch.tensor([17, 3])
    backend.init_forward_metadata_out_graph(fb)
    assert backend.forward_metadata is captured
    assert captured.main.cache_seqlens.tolist() == [17, 3]
    backend.init_forward_metadata_in_graph(fb)  # records nothing: all of it is host-side
    assert backend.forward_metadata is captured
