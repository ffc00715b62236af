"""MLA: absorbed decode (flash_mla_decode), absorbed extend/verify/draft extend/draft decode
(flash_mla_prefill; flash_attn_with_kvcache with qv where a layer has a softcap), and MHA
prefill over chunked prefix caches returning (out, lse [tokens, H])."""

import math
from types import SimpleNamespace

import pytest
import torch

from compile.backend import PagedAttention, XPUAttentionBackend
from compile.batch import (ForwardBatch, ForwardMode, MLATokenToKVPool, PageAllocator,
                           ReqToTokenPool, SpecInfo)
from compile.engine.model_runner import ModelRunnerInfo
from tests.compile.oracle import assert_close, attention_oracle

H, R, RP = 4, 32, 16          # heads, latent rank, rope dim


class MLAWorld:
    def __init__(self, page_size, seed, deterministic=False):
        self.gen = torch.Generator().manual_seed(seed)
        self.ps = page_size
        num_pages = 2 + 1024 // page_size
        self.req_pool = ReqToTokenPool(16, 256, "cpu")
        self.alloc = PageAllocator(num_pages, page_size, "cpu", generator=self.gen)
        self.pool = MLATokenToKVPool(num_pages * page_size, page_size, torch.float32, R, RP, 1,
                                     "cpu")
        buf = self.pool.kv_buffer[0]
        buf.fill_(math.nan)
        buf[:page_size] = torch.randn(page_size, 1, R + RP, generator=self.gen)
        runner = ModelRunnerInfo(
            model_config=SimpleNamespace(context_len=256, num_attention_heads=H), tp_size=1,
            device=torch.device("cpu"), page_size=page_size, req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.pool, kv_cache_dtype=torch.float32,
            server_args=SimpleNamespace(speculative_eagle_topk=1,
                                        speculative_num_draft_tokens=3,
                                        enable_deterministic_inference=deterministic))
        self.backend = XPUAttentionBackend(runner)
        self.layer = PagedAttention(H, R + RP, (R + RP) ** -0.5, 1, 0, v_head_dim=R)
        self.rows = {}

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64)

    def request(self, prefix):
        row = self.req_pool.alloc(1)[0]
        slots = self.alloc.alloc_extend(self.req_pool, row, 0, prefix)
        lat = self.rand(prefix, 1, R + RP)
        self.pool.kv_buffer[0][slots] = lat.float()
        self.rows[row] = lat
        return row

    def append(self, rows, n):
        loc = torch.cat([self.alloc.alloc_extend(self.req_pool, r, self.rows[r].shape[0], n)
                         for r in rows])
        return loc

    def expected(self, rows, n, q_nope, q_rope):
        outs = []
        for i, r in enumerate(rows):
            lat = self.rows[r]
            q = torch.cat([q_nope[i * n:(i + 1) * n], q_rope[i * n:(i + 1) * n]], -1)
            w = self.layer.sliding_window_size
            o = attention_oracle(q, lat, lat[..., :R], scale=self.layer.scaling,
                                 window_left=w if w >= 0 else -1)
            outs.append(o.reshape(n, -1))
        return torch.cat(outs)


def _run(w, mode, prefixes, n, spec=None, split_q=False, **fields):
    rows = [w.request(p) for p in prefixes]
    loc = w.append(rows, n)
    b = len(rows)
    # TARGET_VERIFY and draft decode count the cached prefix only (the backend adds the drafts).
    drafts_excluded = mode == ForwardMode.TARGET_VERIFY or (mode.is_decode() and spec is not None)
    seq = [p + (0 if drafts_excluded else n) for p in prefixes]
    fb = ForwardBatch(forward_mode=mode, batch_size=b, req_pool_indices=torch.tensor(rows),
                      seq_lens=torch.tensor(seq), out_cache_loc=loc, spec_info=spec)
    if mode.is_extend_or_draft_extend_or_mixed(include_draft_extend_v2=True):
        fb.extend_seq_lens = torch.full((b,), n, dtype=torch.int32)
        fb.extend_seq_lens_cpu = [n] * b
    fb.attn_backend = w.backend
    for name, value in fields.items():
        setattr(fb, name, value)
    w.backend.init_forward_metadata(fb)
    t = b * n
    q_nope, q_rope = w.rand(t, H, R), w.rand(t, H, RP)
    k_nope, k_rope = w.rand(t, 1, R), w.rand(t, 1, RP)
    fb._attn_output = torch.full((t, H * R), math.nan)
    if split_q:
        out = w.layer(q_nope.float().reshape(t, -1), k_nope.float(), None, fb,
                      q_rope=q_rope.float(), k_rope=k_rope.float())
    else:
        q = torch.cat([q_nope, q_rope], -1).float().reshape(t, -1)
        out = w.layer(q, k_nope.float(), None, fb, k_rope=k_rope.float())
    for i, r in enumerate(rows):
        w.rows[r] = torch.cat([w.rows[r], torch.cat([k_nope, k_rope], -1)[i * n:(i + 1) * n]])
    assert_close(out, w.expected(rows, n, q_nope, q_rope))
    return fb


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_mla_absorbed_decode_uses_flash_mla(page_size, monkeypatch):
    import xpu_ops
    calls = []
    real = xpu_ops.flash_mla_decode
    monkeypatch.setattr(xpu_ops, "flash_mla_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    w = MLAWorld(page_size, seed=100 + page_size)
    _run(w, ForwardMode.DECODE, [0, 17, 70], 1, split_q=page_size == 16)
    assert calls


def _spy(monkeypatch, name):
    import xpu_ops
    calls, real = [], getattr(xpu_ops, name)

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(xpu_ops, name, spy)
    return calls


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_mla_absorbed_extend_and_verify_use_flash_mla_prefill(page_size, monkeypatch):
    calls = _spy(monkeypatch, "flash_mla_prefill")
    w = MLAWorld(page_size, seed=110 + page_size)
    _run(w, ForwardMode.EXTEND, [0, 20, 64], 5)
    _run(w, ForwardMode.TARGET_VERIFY, [9, 16], 3, spec=SpecInfo(topk=1, draft_token_num=3))
    # Draft extends stay absorbed even where the batch asks for the MHA prefill path.
    _run(w, ForwardMode.EXTEND, [12, 0], 2, spec=SpecInfo(topk=1), split_q=True,
         attn_attend_prefix_cache=False)
    _run(w, ForwardMode.DRAFT_EXTEND_V2, [7, 31], 4, attn_attend_prefix_cache=False)
    _run(w, ForwardMode.DECODE, [3, 40], 1, spec=SpecInfo(topk=1))        # a draft decode step
    assert [c["causal"] for c in calls] == [True] * 5
    assert [c["num_kv_splits"] for c in calls] == [-1] * 5


def test_mla_mha_prefill_chunked_prefix_returns_lse():
    w = MLAWorld(16, seed=120)
    dqk, dv = 24, 16
    mha = PagedAttention(H, dqk, dqk ** -0.5, H, 0, v_head_dim=dv)
    rows = [w.request(p) for p in (0, 0)]
    n = [4, 6]
    loc = torch.cat([w.alloc.alloc_extend(w.req_pool, r, 0, k) for r, k in zip(rows, n)])
    fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=2,
                      req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(n),
                      out_cache_loc=loc, extend_seq_lens=torch.tensor(n, dtype=torch.int32))
    fb.attn_backend = w.backend
    w.backend.init_forward_metadata(fb)
    q = w.rand(10, H, dqk)
    kp, vp = w.rand(5, H, dqk), w.rand(5, H, dv)
    fb.attn_attend_prefix_cache, fb.prefix_chunk_idx = True, 0
    fb.prefix_chunk_cu_seq_lens = torch.tensor([[0, 5, 5]], dtype=torch.int32)
    fb.prefix_chunk_max_seq_lens = [5]
    out, lse = mha(q.float().reshape(10, -1), kp.float(), vp.float(), fb, save_kv_cache=False)
    assert out.shape == (10, H, dv) and lse.shape == (10, H) and lse.is_contiguous()
    exp = attention_oracle(q[:4], kp, vp, scale=mha.scaling, causal=False)
    assert_close(out[:4], exp)
    assert torch.all(out[4:] == 0) and torch.all(torch.isneginf(lse[4:]))
    s = torch.einsum("qhd,khd->qhk", q[:4], kp) * mha.scaling
    torch.testing.assert_close(lse[:4].double(), torch.logsumexp(s, -1), atol=1e-4, rtol=0)
    # New tokens, causal, with and without LSE.
    kn, vn = w.rand(10, H, dqk), w.rand(10, H, dv)
    fb.attn_attend_prefix_cache, fb.mha_return_lse = False, True
    out2, lse2 = mha(q.float().reshape(10, -1), kn.float(), vn.float(), fb, save_kv_cache=False)
    assert lse2.shape == (10, H)
    exp2 = torch.cat([attention_oracle(q[:4], kn[:4], vn[:4], scale=mha.scaling),
                      attention_oracle(q[4:], kn[4:], vn[4:], scale=mha.scaling)])
    assert_close(out2, exp2)
    fb.mha_return_lse = False
    out3 = mha(q.float().reshape(10, -1), kn.float(), vn.float(), fb, save_kv_cache=False)
    assert_close(out3, exp2.reshape(10, -1))


def test_mla_deterministic_inference_pins_one_kv_split(monkeypatch):
    decode, prefill = _spy(monkeypatch, "flash_mla_decode"), _spy(monkeypatch, "flash_mla_prefill")
    w = MLAWorld(16, seed=130, deterministic=True)
    _run(w, ForwardMode.DECODE, [5, 40], 1)
    _run(w, ForwardMode.EXTEND, [0, 21], 3)
    assert [c["num_kv_splits"] for c in decode + prefill] == [1, 1]


@pytest.mark.parametrize("seed", range(3))
def test_mla_random_batches(seed):
    import random
    rng = random.Random(seed)
    w = MLAWorld(rng.choice([1, 16, 64]), seed=140 + seed)
    for mode in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2):
        prefixes = [rng.randint(0, 50) for _ in range(rng.randint(1, 3))]
        n = rng.randint(1, 8)
        spec = SpecInfo(topk=1, draft_token_num=n) if mode == ForwardMode.TARGET_VERIFY else None
        _run(w, mode, prefixes, n, spec=spec, split_q=bool(rng.getrandbits(1)))


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_mla_sliding_window_layer_keeps_its_window(mode):
    # The latent ops take no window: a windowed MLA layer stays on the windowed paged call.
    w = MLAWorld(16, seed=150)
    w.layer = PagedAttention(H, R + RP, (R + RP) ** -0.5, 1, 0, v_head_dim=R,
                             sliding_window_size=6)
    _run(w, mode, [30, 3, 17], 4 if mode == ForwardMode.EXTEND else 1)
