"""Vertical-slash sparse attention (``xpu_ops/ops/sparse_attn.py``): ``sparse_attn_func`` against
a float64 oracle that builds each row's key set from the layout's definition; the index builders
on a hand-worked case and on the coverage property (every kept slash diagonal and vertical
column is visible); argument errors eager and fake; fake shapes; a fullgraph trace."""

from __future__ import annotations

import math

import pytest
import torch

import xpu_ops
from xpu_ops.testing import sample_inputs, sparse_attn_inputs

from ..markers import GPU_DEVICE
from .utils import OUT_TOL, fake_like, runnable_providers, sample_indices

OP = torch.ops.xpu_ops.sparse_attn_func
CONVERT = torch.ops.xpu_ops.convert_vertical_slash_indexes
F64 = torch.float64


def visible_keys(bc, bo, cc, ci, b, h, row, seqlen_k, block_size_N):
    """The keys query block ``row`` sees: first ``bc`` blocks and ``cc`` columns (counts within
    capacity), inside ``[0, seqlen_k)``."""
    keys = set()
    for t in range(min(max(int(bc[b, h, row]), 0), bo.shape[3])):
        start = int(bo[b, h, row, t])
        keys.update(j for j in range(start, start + block_size_N) if 0 <= j < seqlen_k)
    for t in range(min(max(int(cc[b, h, row]), 0), ci.shape[3])):
        if 0 <= int(ci[b, h, row, t]) < seqlen_k:
            keys.add(int(ci[b, h, row, t]))
    return keys


def oracle(q, k, v, bc, bo, cc, ci, *, softmax_scale, causal, softcap, block_size_M,
           block_size_N):
    """float64 loops: ``(out [b, Sq, Hq, Dv], lse [b, Hq, Sq])``; no visible key: 0 and -inf."""
    b_, sq, hq, _ = q.shape
    sk, group = k.shape[1], hq // k.shape[2]
    out = torch.zeros(b_, sq, hq, v.shape[3], dtype=F64)
    lse = torch.full((b_, hq, sq), -math.inf, dtype=F64)
    for b in range(b_):
        for h in range(hq):
            for i in range(sq):
                keys = sorted(j for j in visible_keys(bc, bo, cc, ci, b, h, i // block_size_M,
                                                      sk, block_size_N)
                              if not causal or j <= i + sk - sq)
                if not keys:
                    continue
                s = softmax_scale * (k[b, keys, h // group].to(F64) @ q[b, i, h].to(F64))
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                lse[b, h, i] = torch.logsumexp(s, 0)
                out[b, i, h] = torch.softmax(s, 0) @ v[b, keys, h // group].to(F64)
    return out, lse


@pytest.mark.parametrize("provider", runnable_providers("sparse_attn_func"))
@pytest.mark.parametrize("index", sample_indices(OP))
def test_matches_oracle(provider, index):
    args, kw = list(sample_inputs(OP, "cpu", seed=300 + index))[index]
    with xpu_ops.use_provider(provider):
        lse = OP(*args, **kw)
    out = args[7]
    out64, lse64 = oracle(*args[:7], **kw)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), out64, **OUT_TOL[out.dtype])
    torch.testing.assert_close(lse.double(), lse64, atol=2e-5, rtol=2e-5)


def test_wrapper_default_scale_gqa_strided_and_empty_rows():
    gen = torch.Generator().manual_seed(4)
    q, k, v, bc, bo, cc, ci, _ = sparse_attn_inputs(gen, 2, 6, 10, 4, 2, 16, 2, 3, 4, 4,
                                                    torch.float32, "cpu")
    bc[0, 1, 0], cc[0, 1, 0] = 0, 0                       # head 1, row 0 of request 0: no key
    q_strided = torch.randn(2, 6, 8, 16, generator=gen)[:, :, ::2]
    out, lse = xpu_ops.sparse_attn_func(q_strided, k, v, bc, bo, cc, ci, causal=True,
                                        return_softmax_lse=True, block_size_M=4, block_size_N=4)
    out64, lse64 = oracle(q_strided, k, v, bc, bo, cc, ci, softmax_scale=16 ** -0.5, causal=True,
                          softcap=0.0, block_size_M=4, block_size_N=4)
    torch.testing.assert_close(out.double(), out64, **OUT_TOL[torch.float32])
    assert torch.equal(out[0, :4, 1], torch.zeros(4, 16)) and torch.isneginf(lse[0, 1, :4]).all()


def test_convert_hand_worked_cases():
    """q_len = kv_len = 4, block_size_M = block_size_N = 2, verticals (1, 3), slash 0
    (the main diagonal). Causal: row 0 (queries 0-1) gets the block [0, 2) (vertical 1 inside it,
    vertical 3 in the future); row 1 (queries 2-3) the block [2, 4) and column 1. Not causal:
    the slash range ends at kv_len + (m + 1) 2 - 0 = 6 (row 0) and 8 (row 1): row 0's range
    [4, 6) holds no key (no block below kv_len), so both verticals are columns; row 1 likewise."""
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    args = (i32([4]), i32([4]), i32([[[1, 3]]]), i32([[[0]]]), None, None, 4, 2, 2)
    bc, bo, cc, ci = CONVERT(*args, True)
    assert bc.tolist() == [[[1, 1]]] and bo.tolist() == [[[[0], [2]]]]
    assert cc.tolist() == [[[0, 1]]] and ci.tolist() == [[[[0, 0], [1, 0]]]]
    bc, bo, cc, ci = CONVERT(*args, False)
    assert bc.tolist() == [[[0, 0]]] and cc.tolist() == [[[2, 2]]]
    assert ci.tolist() == [[[[1, 3], [1, 3]]]]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_convert_covers_every_kept_slash_and_vertical(causal, seed):
    gen = torch.Generator().manual_seed(seed)
    bm = bn = 4
    q_lens, kv_lens, heads = [13, 6], [21, 6], 2
    kv_max = max(kv_lens)
    nnz_v, nnz_s = 5, 4
    vert = torch.stack([torch.randperm(kv_max, generator=gen)[:nnz_v].sort().values
                        for _ in range(2 * heads)]).view(2, heads, nnz_v).int()
    slash = torch.stack([torch.randperm(kv_max, generator=gen)[:nnz_s].sort(descending=True).values
                         for _ in range(2 * heads)]).view(2, heads, nnz_s).int()
    bc, bo, cc, ci = xpu_ops.convert_vertical_slash_indexes(
        torch.tensor(q_lens).int(), torch.tensor(kv_lens).int(), vert, slash, max(q_lens), bm, bn,
        causal=causal)
    for b in range(2):
        off = kv_lens[b] - q_lens[b]
        for h in range(heads):
            for row in range(bc.shape[2]):
                seen = visible_keys(bc, bo, cc, ci, b, h, row, kv_lens[b], bn)
                end_m = (row + 1) * bm
                limit = end_m + off
                for s in slash[b, h].tolist():
                    if causal and s >= limit:
                        continue
                    for i in range(row * bm, end_m):           # the diagonal's keys in this row
                        j = i + off - s if causal else i + kv_lens[b] - s
                        if 0 <= j < kv_lens[b] and (not causal or j >= 0):
                            if causal or j >= 0:
                                assert j in seen, (b, h, row, s, j)
                for c in vert[b, h].tolist():
                    if 0 <= c < kv_lens[b] and (not causal or c < limit - 1):
                        assert c in seen, (b, h, row, c)


def test_mergehead_uses_each_heads_counts():
    """Head h with counts (n_v, n_s) gives what the plain builder gives on its first n_v
    verticals and n_s slashes."""
    args, _ = list(sample_inputs(CONVERT, "cpu"))[3]
    q_lens, kv_lens, vert, slash, v_counts, s_counts, ctx, bm, bn, causal = args
    merged = CONVERT(*args)
    for h in range(vert.shape[1]):
        nv, ns = int(v_counts[h]), min(int(s_counts[h]), slash.shape[2])
        alone = xpu_ops.convert_vertical_slash_indexes(
            q_lens, kv_lens, vert[:, h:h + 1, :nv].contiguous(),
            slash[:, h:h + 1, :ns].contiguous(), ctx, bm, bn, causal=causal)
        for got, want in zip(merged, alone):
            got = got[:, h:h + 1]
            if want.dim() == 4:           # capacity nv / ns here: the rest of got stays 0
                assert not got[..., want.shape[-1]:].any()
                got = got[..., :want.shape[-1]]
            assert torch.equal(got, want), h


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("change,match", [
    ("rows", r"sparse_attn_func: block_count has too few query block rows"),
    ("gqa", r"sparse_attn_func: q/k_cache head counts are incompatible"),
    ("dtype", r"sparse_attn_func: column_index has dtype torch.float32"),
    ("block", r"sparse_attn_func: block_size_N is not positive"),
])
def test_checks(fake, change, match):
    args, kw = next(iter(sample_inputs(OP, "cpu")))
    args, kw = list(args), dict(kw)
    if change == "rows":
        args[3] = args[3][:, :, :1]
    elif change == "gqa":
        args[1] = args[1][:, :, :1].expand(-1, -1, 3, -1)
        args[2] = args[2][:, :, :1].expand(-1, -1, 3, -1)
    elif change == "dtype":
        args[6] = args[6].float()
    else:
        kw["block_size_N"] = 0
    if fake:
        mode = torch._subclasses.fake_tensor.FakeTensorMode()
        args = [fake_like(mode, a) for a in args]
        with mode, pytest.raises(RuntimeError, match=match):
            OP(*args, **kw)
    else:
        with pytest.raises(ValueError, match=match):
            OP(*args, **kw)


def test_wrapper_rejects_dropout_and_convert_rejects_negative_context():
    args, _ = next(iter(sample_inputs(OP, "cpu")))
    with pytest.raises(NotImplementedError, match="sparse_attn_func: dropout_p"):
        xpu_ops.sparse_attn_func(*args[:7], dropout_p=0.1)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(RuntimeError, match="convert_vertical_slash_indexes: context_size is "
                                           "negative"):
        xpu_ops.convert_vertical_slash_indexes(i32([4]), i32([4]), i32([[[1]]]), i32([[[0]]]),
                                               -1, 2, 2)


def test_fake_shapes_of_the_index_builder():
    args, _ = list(sample_inputs(CONVERT, "cpu"))[1]
    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    fake_args = [fake_like(mode, a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        fake = CONVERT(*fake_args)
    real = CONVERT(*args)
    assert [(f.shape, f.dtype) for f in fake] == [(r.shape, r.dtype) for r in real]


def test_fullgraph_trace():
    args, kw = next(iter(sample_inputs(OP, "cpu")))
    q, k, v, bc, bo, cc, ci, _ = args

    def fn(q, k, v):
        return xpu_ops.sparse_attn_func(q, k, v, bc, bo, cc, ci, block_size_M=4, block_size_N=4,
                                        return_softmax_lse=True)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(q, k, v), fn(q, k, v)):
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(GPU_DEVICE is None, reason="needs a CUDA or XPU device")
@pytest.mark.parametrize("index", sample_indices(OP))
def test_matches_oracle_on_the_gpu(index):
    args, kw = list(sample_inputs(OP, "cpu", seed=600 + index))[index]
    dev = [a.to(GPU_DEVICE) for a in args]
    lse = OP(*dev, **kw)
    out64, lse64 = oracle(*args[:7], **kw)
    torch.testing.assert_close(dev[7].cpu().double(), out64, **OUT_TOL[args[0].dtype])
    torch.testing.assert_close(lse.cpu().double(), lse64, atol=2e-5, rtol=2e-5)
