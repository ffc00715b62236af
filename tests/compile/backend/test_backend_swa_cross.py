"""Hybrid sliding-window pool (translated tables and writes, evicted pages) and encoder-decoder
cross attention, against the float64 oracle."""

import math

import pytest
import torch
from torch import nn

from compile.batch import ForwardMode
from tests.compile.oracle import Harness, Req, assert_close, attention_oracle
from tests.markers import requires_gpu_graphs


def _evict_out_of_window(h, req, window):
    """Unmap (and poison in the SWA pool) pages no future query can see."""
    first_visible = req.length(1) - window + 1
    ps = h.ps
    for page_start in range(0, max(first_visible, 0) - ps + 1, ps):
        full_slot = int(h.req_pool.req_to_token[req.row, page_start])
        slots = torch.arange(full_slot, full_slot + ps)
        swa = h.pool.full_to_swa_index_mapping[slots]
        for buf in (h.pool.swa_kv_pool.k_buffer[0], h.pool.swa_kv_pool.v_buffer[0]):
            buf[swa] = math.nan
        h.pool.full_to_swa_index_mapping[slots] = 0


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_hybrid_swa_pool(page_size, mode):
    h = Harness(page_size, seed=90 + page_size, swa_layers=(1,), num_layers=2, window=8)
    reqs = [h.add_request(p, layers=(0, 1)) for p in (40, 3, 70, 0)]
    for r in reqs:
        _evict_out_of_window(h, r, 8)
    new = [5, 9, 1, 4] if mode == ForwardMode.EXTEND else [1] * 4
    full, swa = h.layer(0), h.layer(1, sliding_window_size=8 - 1)   # HF window W = 8
    outs, qs = h.step(mode, reqs, new, [full, swa])
    assert_close(outs[0], h.expected(reqs, new, full, qs[0]))
    assert_close(outs[1], h.expected(reqs, new, swa, qs[1]))
    # The SWA layer's new K landed in the SWA pool at the translated slots.
    last = int(h.req_pool.req_to_token[reqs[0].row, reqs[0].length(1) - 1])
    swa_slot = int(h.pool.translate_loc_from_full_to_swa(torch.tensor([last]))[0])
    torch.testing.assert_close(h.pool.swa_kv_pool.k_buffer[0][swa_slot].double(),
                               reqs[0].k[1][-1])


def _encdec_request(h, enc_len, dec_prefix):
    req = Req(row=h.req_pool.alloc(1)[0], k={}, v={})
    enc_slots = h.alloc_slots(req, 0, enc_len)
    dec_slots = h.alloc_slots(req, enc_len, dec_prefix)
    k, v = h.rand(dec_prefix, h.hkv, h.d), h.rand(dec_prefix, h.hkv, h.d)
    h.write_direct(0, dec_slots, k, v)
    req.k[0], req.v[0] = k, v
    return req, enc_slots


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("enc_lens", [[16, 32, 64], [10, 0, 37]], ids=["aligned", "any"])
def test_encoder_decoder_cross_attention(page_size, enc_lens):
    # "any": decoder tokens start mid-page (sharing the encoder's last page), or at column 0.
    h = Harness(page_size, seed=95 + sum(enc_lens), num_layers=2)
    dec_prefix, new = [0, 5, 21], [3, 2, 1]
    made = [_encdec_request(h, e, d) for e, d in zip(enc_lens, dec_prefix)]
    reqs = [m[0] for m in made]
    enc_loc = torch.cat([m[1] for m in made])
    self_attn, cross = h.layer(0), h.layer(1, is_cross_attention=True)
    for mode, n_new, write_enc in ((ForwardMode.EXTEND, new, True),
                                   (ForwardMode.DECODE, [1, 1, 1], False)):
        loc = torch.cat([h.alloc_slots(r, e + r.length(0), n)
                         for r, e, n in zip(reqs, enc_lens, n_new)])
        seq = [r.length(0) + n for r, n in zip(reqs, n_new)]
        fb = h.batch(mode, reqs, n_new, loc, seq,
                     encoder_lens=torch.tensor(enc_lens), encoder_out_cache_loc=enc_loc)
        h.backend.init_forward_metadata(fb)
        t = sum(n_new)
        q = h.rand(t, h.hq * h.d).float()
        k, v = h.rand(t, h.hkv, h.d), h.rand(t, h.hkv, h.d)
        h.poisoned_output(fb, t, self_attn)
        out = self_attn(q, k.float(), v.float(), fb).double()
        h._append(reqs, n_new, 0, k, v, 1.0)
        assert_close(out, h.expected(reqs, n_new, self_attn, q.double()))
        ek, ev = None, None
        if write_enc:
            ek, ev = h.rand(sum(enc_lens), h.hkv, h.d), h.rand(sum(enc_lens), h.hkv, h.d)
            off = 0
            for r, e in zip(reqs, enc_lens):
                r.k[1], r.v[1] = ek[off:off + e], ev[off:off + e]
                off += e
        qc = h.rand(t, h.hq * h.d).float()
        h.poisoned_output(fb, t, cross)
        out = cross(qc, None if ek is None else ek.float(), None if ev is None else ev.float(),
                    fb).double()
        rows, off = [], 0
        for r, n in zip(reqs, n_new):
            o = attention_oracle(qc[off:off + n].double().view(n, h.hq, h.d), r.k[1], r.v[1],
                                 scale=cross.scaling, causal=False)
            rows.append(o.reshape(n, -1))
            off += n
        assert_close(out, torch.cat(rows))


def test_encoder_graph_steps_need_an_encoder_decoder_backend():
    h = Harness(16, seed=96)
    req, enc = _encdec_request(h, 10, 0)
    loc = h.alloc_slots(req, 10, 1)
    fb = h.batch(ForwardMode.DECODE, [req], [1], loc, [1], encoder_lens=torch.tensor([10]),
                 encoder_out_cache_loc=enc)
    assert h.backend.build_metadata(fb).main.page_size == 1   # eager: a token-slot table
    with pytest.raises(NotImplementedError, match="is_encoder_decoder True, got False"):
        h.backend.build_metadata(fb, graph=True)


class EncDecProbe(nn.Module):
    """A decoder self-attention layer and a cross-attention layer over fixed random tables:
    ``forward(ids, positions, fb) -> [T, 2 * Hq * D]``."""

    def __init__(self, h: Harness):
        super().__init__()
        self.self_attn, self.cross = h.layer(0), h.layer(1, is_cross_attention=True)
        for name in ("q", "q_cross", "k", "v"):
            heads = h.hq if name.startswith("q") else h.hkv
            self.register_buffer(name, h.rand(64, heads * h.d).float())
        self.anchor = nn.Parameter(torch.zeros(1))   # runners read the device off a parameter

    def forward(self, ids, positions, fb):
        k = self.k[ids].view(-1, self.self_attn.tp_k_head_num, self.self_attn.head_dim)
        v = self.v[ids].view_as(k)
        return torch.cat([self.self_attn(self.q[ids], k, v, fb),
                          self.cross(self.q_cross[ids], None, None, fb)], dim=-1)


def encoder_decoder_graph_steps(page_size: int, device="cpu") -> None:
    """Encoder-decoder DECODE steps replayed in whole-step graphs (emulated on the CPU),
    encoder lengths that are and are not page multiples in one batch: each step, replayed and
    eager, equals the float64 oracle, and the metadata buffers keep their addresses (beyond
    sglang 0.5.23, which runs encoder-decoder models without graphs)."""
    from compile.backend import XPUAttentionBackend
    from compile.graphs import GraphRunner
    h = Harness(page_size, seed=97 + page_size, num_layers=2, device=device)
    h.runner.model_config.is_encoder_decoder = True
    h.backend = XPUAttentionBackend(h.runner)
    probe = EncDecProbe(h).to(h.device)
    enc_lens, dec_prefix = [10, 0, 37, 16], [5, 1, 21, 0]
    made = [_encdec_request(h, e, d) for e, d in zip(enc_lens, dec_prefix)]
    reqs = [m[0] for m in made]
    for r, (_, enc), e in zip(reqs, made, enc_lens):
        ek, ev = h.rand(e, h.hkv, h.d), h.rand(e, h.hkv, h.d)
        h.write_direct(1, enc, ek, ev)
        r.k[1], r.v[1] = h.quantize(ek), h.quantize(ev)
    runner = GraphRunner(probe, batch_sizes=(2, 4), emulate_graphs=h.device.type == "cpu",
                         debug=True)
    addresses = None
    for rows in ([0, 1, 2], [0, 1], [0, 1, 2, 3], [2, 3], [1, 2, 3], [0, 3]):
        sel = [reqs[i] for i in rows]
        loc = torch.cat([h.alloc_slots(r, enc_lens[i] + r.length(0), 1)
                         for i, r in zip(rows, sel)])
        fb = h.batch(ForwardMode.DECODE, sel, [1] * len(rows), loc,
                     [r.length(0) + 1 for r in sel],
                     encoder_lens=torch.tensor([enc_lens[i] for i in rows], device=h.device))
        fb.token_to_kv_pool, fb.req_to_token_pool = h.pool, h.req_pool
        ids = torch.randint(0, 64, (len(rows),), generator=h.gen)
        pos = torch.tensor([enc_lens[i] + r.length(0) for i, r in zip(rows, sel)])
        assert runner.can_run(fb)
        with torch.no_grad():
            out = runner(ids.to(h.device), pos.to(h.device), fb).cpu().double()
            h.backend.init_forward_metadata(fb)
            eager = probe(ids.to(h.device), pos.to(h.device), fb).cpu().double()
        for j, r in enumerate(sel):
            for table, logical in ((probe.k, r.k), (probe.v, r.v)):
                new = h.quantize(table[ids[j]].cpu().double().view(1, h.hkv, h.d))
                logical[0] = torch.cat([logical[0], new])
        expected = []
        for j, r in enumerate(sel):
            parts = [attention_oracle(table[ids[j]].cpu().double().view(1, h.hq, h.d), r.k[lid],
                                      r.v[lid], scale=h.d ** -0.5, causal=lid == 0)
                     for lid, table in ((0, probe.q), (1, probe.q_cross))]
            expected.append(torch.cat([p.reshape(1, -1) for p in parts], dim=-1))
        assert_close(out, torch.cat(expected))
        assert_close(eager, torch.cat(expected))
        ptrs = {n: t.data_ptr() for n, t in runner.buffers.metadata.items()}
        assert ptrs == (addresses := addresses or ptrs)
    assert (runner.captures, runner.replays) == (2, 2)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_encoder_decoder_decode_in_graphs_equals_oracle(page_size):
    encoder_decoder_graph_steps(page_size)


@requires_gpu_graphs
def test_encoder_decoder_decode_in_device_graphs_equals_oracle():
    from compile.graphs import device as dev
    encoder_decoder_graph_steps(16, dev.as_device())
