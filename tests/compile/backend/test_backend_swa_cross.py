"""Hybrid sliding-window pool (translated tables and writes, evicted pages) and encoder-decoder
cross attention, against the float64 oracle."""

import math

import pytest
import torch

from compile.batch import ForwardMode
from tests.compile.oracle import Harness, Req, assert_close, attention_oracle


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


def test_unaligned_encoder_lengths_have_no_graph_buffers():
    h = Harness(16, seed=96)
    req, enc = _encdec_request(h, 10, 0)
    loc = h.alloc_slots(req, 10, 1)
    fb = h.batch(ForwardMode.DECODE, [req], [1], loc, [1], encoder_lens=torch.tensor([10]),
                 encoder_out_cache_loc=enc)
    h.backend.build_metadata(fb)                              # eager: a token-slot table
    with pytest.raises(NotImplementedError, match="token-slot table"):
        h.backend.build_metadata(fb, graph=True)
