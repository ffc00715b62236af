"""GPU suite of the ``triton`` provider: realistic shapes, NaN poison, opcheck on the device.

Marked ``gpu`` (CI deselects it with ``-m 'not gpu'``); run on the GPU machine with
``pytest -m gpu tests/ops/test_triton_gpu.py``. Every case poisons the output and the unused
cache slots / page-table entries with NaN or out-of-range ids, and compares the Triton kernels
with the reference provider by relative Frobenius error.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import xpu_ops
import xpu_ops.testing as xt

from ..markers import GPU_DEVICE, requires_gpu

DEVICE = GPU_DEVICE
pytestmark = requires_gpu
OPS = ["flash_attn_with_kvcache", "flash_attn_varlen_func", "merge_state_v2", "flash_mla_decode",
       "flash_mla_prefill", "store_kv_cache", "store_mla_kv_cache", "prepare_swa_spec_page_table",
       "apply_rotary_emb"]


def _rel(got, want):
    got, want = got.float(), want.float()
    assert not torch.isnan(got).any(), "NaN in the triton output"
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def paged_case(k_lens, q_lens, page_size, hq=32, hkv=8, d=128, dv=None, dtype=torch.bfloat16,
               kv_dtype=None, table_tokens=0):
    """Random paged cache on the device; slots past the lengths hold NaN, page-table entries
    past a request's last page hold out-of-range ids, and pages are shuffled. The page table is
    ``table_tokens`` wide when that is more than the longest request needs (a graph's table)."""
    dv = dv or d
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    pages = [-(-k // page_size) for k in k_lens]
    num_pages = sum(pages) + 3
    perm = torch.randperm(num_pages, device=DEVICE, generator=gen)
    width = max(max(pages) + 2, -(-table_tokens // page_size))
    table = torch.full((len(k_lens), width), num_pages + 1000, dtype=torch.int32, device=DEVICE)
    table[:, ::2] = -7
    start = 0
    k = torch.randn(num_pages, page_size, hkv, d, device=DEVICE, generator=gen, dtype=dtype)
    v = torch.randn(num_pages, page_size, hkv, dv, device=DEVICE, generator=gen, dtype=dtype)
    for r, (n, used) in enumerate(zip(k_lens, pages)):
        ids = perm[start:start + used]
        start += used
        table[r, :used] = ids.to(torch.int32)
        tail = n - (used - 1) * page_size if used else 0
        if used and tail < page_size:
            k[ids[-1], tail:] = float("nan")
            v[ids[-1], tail:] = float("nan")
    k[perm[start:]] = float("nan")
    v[perm[start:]] = float("nan")
    if kv_dtype is not None:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    q = torch.randn(sum(q_lens), hq, d, device=DEVICE, dtype=dtype, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32,
                      device=DEVICE)
    lens = torch.tensor(k_lens, dtype=torch.int32, device=DEVICE)
    return q, k, v, lens, table, cu


def _both(q, k, v, **kw):
    with xpu_ops.use_provider("reference"):
        ref, ref_lse = xpu_ops.flash_attn_with_kvcache(q, k, v, return_softmax_lse=True, **kw)
    out = torch.full_like(ref, float("nan"))
    with xpu_ops.use_provider("triton"):
        got, lse = xpu_ops.flash_attn_with_kvcache(q, k, v, out=out, return_softmax_lse=True,
                                                   **kw)
    assert got is out
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 2e-2
    return _rel(got, ref)


@pytest.mark.parametrize("page_size", [64, 16, 1])
def test_long_context_decode_split_kv(page_size):
    """4 requests, one > 64k tokens: the split-KV path with the LSE-weighted merge."""
    q, k, v, lens, table, cu = paged_case([70001, 1, 9000, 33333], [1, 1, 1, 1], page_size)
    assert _both(q, k, v, cache_seqlens=lens, page_table=table, cu_seqlens_q=cu, max_seqlen_q=1) < 1e-2


@pytest.mark.parametrize("causal,window,softcap,sinks", [(True, (-1, -1), 0.0, False),
                                                         (True, (1000, 0), 30.0, True),
                                                         (False, (-1, -1), 0.0, True)])
def test_extend_128_pages_of_64(causal, window, softcap, sinks):
    """Extend over 128 pages of 64 tokens (cached prefix + new tokens), GQA 32/8, D 128."""
    q, k, v, lens, table, cu = paged_case([128 * 64, 128 * 64 - 5], [700, 300], 64)
    extra = {"sinks": torch.randn(32, device=DEVICE)} if sinks else {}
    assert _both(q, k, v, cache_seqlens=lens, page_table=table, cu_seqlens_q=cu,
                 max_seqlen_q=700, causal=causal, window_size=window, softcap=softcap,
                 **extra) < 1e-2


@pytest.mark.parametrize("d,dv,hq,hkv", [(64, 64, 8, 1), (80, 80, 16, 4), (96, 96, 12, 12),
                                         (256, 256, 8, 2), (192, 128, 16, 2)])
def test_head_dims_prefill_and_decode(d, dv, hq, hkv):
    q, k, v, lens, table, cu = paged_case([3000, 517, 1], [333, 1, 1], 32, hq=hq, hkv=hkv, d=d,
                                          dv=dv)
    assert _both(q, k, v, cache_seqlens=lens, page_table=table, cu_seqlens_q=cu,
                 max_seqlen_q=333, causal=True) < 1e-2


def test_fp8_kv_decode():
    q, k, v, lens, table, cu = paged_case([5000, 77], [1, 4], 64, kv_dtype=torch.float8_e4m3fn)
    desc = torch.rand(2, 8, device=DEVICE) + 0.5
    assert _both(q, k, v, cache_seqlens=lens, page_table=table, cu_seqlens_q=cu, max_seqlen_q=4,
                 causal=True, k_descale=desc, v_descale=desc.flip(0)) < 2e-2


def test_mla_decode_128_heads():
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    b, h, latent, rope, page = 4, 128, 512, 64, 64
    lens = torch.tensor([5000, 1, 70000, 300], dtype=torch.int32, device=DEVICE)
    width = 70000 // page + 2
    kv = torch.randn(b * width, page, latent + rope, device=DEVICE, dtype=torch.bfloat16,
                     generator=gen)
    table = torch.randperm(b * width, device=DEVICE, generator=gen).view(b, width).int()
    qn = torch.randn(b, h, latent, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    qr = torch.randn(b, h, rope, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    ws = torch.empty(xpu_ops.flash_mla_get_workspace_size(70000, b, h, page), dtype=torch.uint8,
                     device=DEVICE)
    outs = []
    for prov in ("reference", "triton"):
        with xpu_ops.use_provider(prov):
            outs.append(xpu_ops.flash_mla_decode(qn, qr, kv, lens, table, ws, 1 / math.sqrt(576)))
    assert _rel(outs[1], outs[0]) < 1e-2


@pytest.mark.parametrize("config", [("mla_split", 8), ("mla_split", 16), ("", 16)],
                         ids=["mla_split", "mla_split-16-warps", "16-warps"])
def test_mla_decode_128_heads_split_and_wide_configs(config):
    """The launcher with ``mla_split`` (two programs per row tile, each half of the 512 latent
    columns) and/or 16 warps, split-KV over 8 splits, against the reference provider."""
    import dataclasses
    from xpu_ops.triton import paged_attention as pa
    paths, warps = config
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    b, h, latent, rope, page = 4, 128, 512, 64, 64
    lens = torch.tensor([5000, 1, 20000, 300], dtype=torch.int32, device=DEVICE)
    width = 20000 // page + 2
    kv = torch.randn(b * width, page, latent + rope, device=DEVICE, dtype=torch.bfloat16,
                     generator=gen)
    table = torch.randperm(b * width, device=DEVICE, generator=gen).view(b, width).int()
    qn = torch.randn(b, h, latent, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    qr = torch.randn(b, h, rope, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    values = kv[:, :, None, :latent]
    config = dataclasses.replace(pa.with_paths(pa.default_config(qr, values, 1, 1, frozenset()),
                                               frozenset(paths.split(",")) - {""}),
                                 num_warps=warps)
    out = torch.full_like(qn, float("nan"))
    pa.paged_attention(qr, kv[:, :, None, latent:], values, out, lens,
                       torch.arange(b + 1, dtype=torch.int32, device=DEVICE), page_table=table,
                       cu_seqlens_k=None, max_seqlen_q=1, max_kv_len=width * page, qv=qn,
                       q_descale=None, k_descale=None, v_descale=None, sinks=None,
                       softmax_scale=1 / math.sqrt(576), window_left=-1, window_right=-1,
                       softcap=0.0, num_splits=8, config=config)
    ws = torch.empty(xpu_ops.flash_mla_get_workspace_size(20000, b, h, page), dtype=torch.uint8,
                     device=DEVICE)
    with xpu_ops.use_provider("reference"):
        ref = xpu_ops.flash_mla_decode(qn, qr, kv, lens, table, ws, 1 / math.sqrt(576))
    assert _rel(out, ref) < 1e-2


def test_mla_prefill_128_heads():
    """DeepSeek shapes: extend chunks over long prefixes, one request without a prefix."""
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    h, latent, rope, page = 128, 512, 64, 64
    q_lens, k_lens = [300, 1, 17], [5300, 1, 17]
    width = max(k_lens) // page + 2
    kv = torch.randn(3 * width, page, latent + rope, device=DEVICE, dtype=torch.bfloat16,
                     generator=gen)
    table = torch.randperm(3 * width, device=DEVICE, generator=gen).view(3, width).int()
    qn = torch.randn(sum(q_lens), h, latent, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    qp = torch.randn(sum(q_lens), h, rope, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, 300, 301, 318], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(k_lens, dtype=torch.int32, device=DEVICE)
    ws = torch.empty(xpu_ops.flash_mla_prefill_get_workspace_size(max(k_lens), 3, h, page),
                     dtype=torch.uint8, device=DEVICE)
    outs = []
    for prov in ("reference", "triton"):
        with xpu_ops.use_provider(prov):
            outs.append(xpu_ops.flash_mla_prefill(qn, qp, kv, cu, lens, 300, table, ws,
                                                  1 / math.sqrt(192)))
    assert _rel(outs[1], outs[0]) < 1e-2


def _captured(call) -> torch.cuda.CUDAGraph:
    """``call`` run once (compiling its kernels outside the capture), then captured in a CUDA
    graph, which is returned for the test to replay."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def test_decode_cuda_graph_capture_and_replay():
    """The launch (split-KV included) captures in a device graph; replay sees new values."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs")
    q, k, v, lens, table, cu = paged_case([40000, 100], [1, 1], 64)
    out = torch.empty_like(q)
    kw = dict(cache_seqlens=lens, page_table=table, cu_seqlens_q=cu, max_seqlen_q=1)
    with xpu_ops.use_provider("triton"):
        graph = _captured(lambda: xpu_ops.flash_attn_with_kvcache(q, k, v, out=out, **kw))
    q.copy_(torch.randn_like(q))
    lens.copy_(torch.tensor([30001, 57], dtype=torch.int32))   # still within each page list
    out.fill_(float("nan"))
    graph.replay()
    with xpu_ops.use_provider("reference"):
        ref = xpu_ops.flash_attn_with_kvcache(q, k, v, **kw)
    assert _rel(out, ref) < 1e-2


def test_split_kv_launch_replays_bitwise_and_leaves_counters_zero():
    """A split-KV launch (splits merged in-kernel by the last program to finish) with the
    caller's counters, captured in a CUDA graph: every replay gives the same bits whichever
    program merged, equals the eager op call, matches the reference, and leaves the counters
    zero."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs")
    from xpu_ops.triton.paged_attention import paged_attention
    q, k, v, lens, table, cu = paged_case([40000, 100, 7000, 1], [1, 1, 1, 1], 64)
    sinks = torch.randn(32, device=DEVICE)
    out = torch.empty_like(q)
    with xpu_ops.use_provider("triton"):
        eager = xpu_ops.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table,
                                                cu_seqlens_q=cu, max_seqlen_q=1, causal=True,
                                                sinks=sinks, num_splits=4)  # as launch()
    counters = torch.zeros(4096, dtype=torch.int32, device=DEVICE)

    def launch():
        return paged_attention(q, k, v, out, lens, cu, page_table=table, cu_seqlens_k=None,
                               max_seqlen_q=1, max_kv_len=table.shape[1] * k.shape[1], qv=None,
                               q_descale=None, k_descale=None, v_descale=None, sinks=sinks,
                               softmax_scale=128 ** -0.5, window_left=-1, window_right=0,
                               softcap=0.0, num_splits=4, counters=counters)
    graph = _captured(launch)
    for _ in range(20):
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, eager)
        assert not counters.any()
    with xpu_ops.use_provider("reference"):
        ref = xpu_ops.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table,
                                              cu_seqlens_q=cu, max_seqlen_q=1, causal=True,
                                              sinks=sinks)
    assert _rel(out, ref) < 1e-2


def test_split_workspace_per_stream_and_never_in_a_graph():
    """Eager split decode launches take their stream's workspace (``_WORKSPACES``); a launch
    captured in a graph allocates its own buffers (the workspace is not touched while
    capturing), and eager launches before and after replays, and on a second stream at the same
    time, all match the reference; every workspace's counters are zero after a sync."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs")
    from xpu_ops.triton import paged_attention as pa
    q, k, v, lens, table, cu = paged_case([30000, 20000], [1, 1], 64, table_tokens=131072)
    kw = dict(cache_seqlens=lens, page_table=table, cu_seqlens_q=cu, max_seqlen_q=1,
              causal=True)
    with xpu_ops.use_provider("reference"):
        ref = xpu_ops.flash_attn_with_kvcache(q, k, v, **kw)
    out, out2 = torch.empty_like(q), torch.empty_like(q)
    with xpu_ops.use_provider("triton"):
        xpu_ops.flash_attn_with_kvcache(q, k, v, out=out, **kw)
        torch.cuda.synchronize()
        before = {key: tuple(t.data_ptr() for t in ws) for key, ws in pa._WORKSPACES.items()}
        assert before, "an eager split launch took no workspace"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            xpu_ops.flash_attn_with_kvcache(q, k, v, out=out2, **kw)
        assert {key: tuple(t.data_ptr() for t in ws)
                for key, ws in pa._WORKSPACES.items()} == before
        side = torch.cuda.Stream()
        for _ in range(3):
            out.fill_(float("nan"))
            out2.fill_(float("nan"))
            graph.replay()
            xpu_ops.flash_attn_with_kvcache(q, k, v, out=out, **kw)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                o3 = xpu_ops.flash_attn_with_kvcache(q, k, v, **kw)
            torch.cuda.current_stream().wait_stream(side)
            for o in (out, out2, o3):
                assert _rel(o, ref) < 1e-2
    torch.cuda.synchronize()
    assert all(not ws[2].any() for ws in pa._WORKSPACES.values())


@pytest.mark.parametrize("page_size", [64, 16, 1])
@pytest.mark.parametrize("batch", [1, 2, 8])
def test_small_batch_decode_splits_each_length_under_a_wide_table(batch, page_size):
    """b = 1..8 decode under a 128k-token page table (a graph's): the planned splits share each
    request's own keys (1 to 40k of them), into NaN-poisoned outputs, against the reference."""
    k_lens = [40000, 1, 3000, 777, 16384, 5, 9000, 1024][:batch]
    q, k, v, lens, table, cu = paged_case(k_lens, [1] * batch, page_size, table_tokens=131072)
    with xt.recorded_triton_launches() as launches:
        rel = _both(q, k, v, cache_seqlens=lens, page_table=table, cu_seqlens_q=cu,
                    max_seqlen_q=1, causal=True)
    assert rel < 1e-2
    assert launches[-1]["NUM_SPLITS"] > 1


def test_small_batch_split_decode_graph_replays_other_lengths():
    """One capture under a 128k-token table, replayed at lengths that give each request a
    different number of working splits (one, some, all): equal to the reference every time."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs")
    q, k, v, lens, table, cu = paged_case([30000, 20000], [1, 1], 64, table_tokens=131072)
    out = torch.empty_like(q)
    kw = dict(cache_seqlens=lens, page_table=table, cu_seqlens_q=cu, max_seqlen_q=1,
              causal=True)
    with xpu_ops.use_provider("triton"):
        graph = _captured(lambda: xpu_ops.flash_attn_with_kvcache(q, k, v, out=out, **kw))
    for new_lens in ([64, 19999], [30000, 1], [257, 300]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        with xpu_ops.use_provider("reference"):
            ref = xpu_ops.flash_attn_with_kvcache(q, k, v, **kw)
        assert _rel(out, ref) < 1e-2, new_lens


@pytest.mark.parametrize("page_size", [64, 16, 1])
def test_plain_kernel_equals_the_full_kernel_bitwise(page_size, monkeypatch):
    """The plain entry (derived strides, constexpr head counts and dims) and the full entry run
    one program: the same decode and extend calls give the same bits through either."""
    from xpu_ops.triton import _common, paged_attention as pa
    outs = []
    # The extend call must take the plain entry too: the portable prefill paths (on sm_90 the
    # default is the descriptor path, which only the full kernel has).
    monkeypatch.setitem(_common.DEFAULT_PATHS, "prefill", frozenset({"phases"}))
    pa._launch_params.cache_clear()      # launch parameters are cached per shape: the
    for plain in (True, False):          # patched choice must not be answered from the cache
        if not plain:
            monkeypatch.setattr(pa, "_plain_launch", lambda *a, **kw: False)
            pa._launch_params.cache_clear()
        with xt.recorded_triton_launches() as launches:
            for k_lens, q_lens in (([9000, 1, 333, 4096], [1, 1, 1, 1]), ([2000, 77], [300, 5])):
                q, k, v, lens, table, cu = paged_case(k_lens, q_lens, page_size)
                with xpu_ops.use_provider("triton"):
                    outs.append(xpu_ops.flash_attn_with_kvcache(
                        q, k, v, cache_seqlens=lens, page_table=table, cu_seqlens_q=cu,
                        max_seqlen_q=max(q_lens), causal=True, return_softmax_lse=True))
        assert launches and all(("GROUP_SIZE" in launch) == plain for launch in launches)
    monkeypatch.undo()
    pa._launch_params.cache_clear()      # later tests get plain launches again
    for (out, lse), (out_full, lse_full) in zip(outs[:2], outs[2:]):
        assert torch.equal(out, out_full) and torch.equal(lse, lse_full)


def _paths_vs_reference(paths, q, k, v, lens, table, cu, max_seqlen_q, causal, descales=None,
                        window=-1):
    """The launcher with the default tiles and exactly the optional ``paths`` on, into a
    NaN-poisoned output, against the reference provider: (relative error, launch constexprs)."""
    from xpu_ops.triton import paged_attention as pa
    k_descale, v_descale = descales or (None, None)
    config = pa.default_config(q, v, max_seqlen_q, k.shape[2], frozenset(paths), k.shape[1])
    out = torch.full_like(q, float("nan"))
    with xt.recorded_triton_launches() as seen:
        pa.paged_attention(q, k, v, out, lens, cu, page_table=table, cu_seqlens_k=None,
                           max_seqlen_q=max_seqlen_q, max_kv_len=table.shape[1] * k.shape[1],
                           qv=None, q_descale=None, k_descale=k_descale, v_descale=v_descale,
                           sinks=None, softmax_scale=q.shape[-1] ** -0.5, window_left=window,
                           window_right=0 if causal else -1, softcap=0.0, config=config)
    with xpu_ops.use_provider("reference"):
        ref = xpu_ops.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table,
                                              cu_seqlens_q=cu, max_seqlen_q=max_seqlen_q,
                                              causal=causal, window_size=(window, -1),
                                              k_descale=k_descale, v_descale=v_descale)
    return _rel(out, ref), seen[0]


PATHS = [("page_tiles",), ("phases",), ("tma",), ("tma_ws",), ("tma", "fold_scale")]


@pytest.mark.parametrize("paths", PATHS, ids=["-".join(p) for p in PATHS])
@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
def test_paths_decode_and_extend(page_size, paths):
    """Every optional kernel path at full size: split-KV decode past 64k tokens, an extend
    over a cached prefix and a sliding-window prefill, garbage past every request; on a
    Hopper-class CUDA device ``tma`` must really take the descriptor path (page >= 16)."""
    decode = paged_case([70001, 1, 9000, 333], [1, 1, 1, 1], page_size)
    assert _paths_vs_reference(paths, *decode, 1, True)[0] < 1e-2
    extend = paged_case([4096 + 300, 77], [300, 1], page_size)
    err, meta = _paths_vs_reference(paths, *extend, 300, True)
    assert err < 1e-2
    hopper = DEVICE == "cuda" and torch.cuda.get_device_capability() >= (9, 0)
    if hopper and "tma" in paths[0] and page_size >= 16:
        assert meta.get("TMA"), meta
    window = paged_case([2000, 1500], [2000, 700], page_size)
    assert _paths_vs_reference(paths, *window, 2000, True, window=300)[0] < 1e-2


@pytest.mark.parametrize("paths", PATHS, ids=["-".join(p) for p in PATHS])
def test_paths_fp8_kv(paths):
    q, k, v, lens, table, cu = paged_case([5000, 77], [1, 4], 64, kv_dtype=torch.float8_e4m3fn)
    desc = torch.rand(2, 8, device=DEVICE) + 0.5
    assert _paths_vs_reference(paths, q, k, v, lens, table, cu, 4, True,
                               (desc, desc.flip(0)))[0] < 2e-2


@pytest.mark.parametrize("op", OPS)
def test_samples_match_reference_and_opcheck(op):
    """Every ``sample_inputs`` case on the device: triton == reference, then opcheck."""
    for args, kwargs in xt.sample_inputs(op, DEVICE):
        results = []
        for prov in ("reference", "triton"):
            a, kw = copy.deepcopy(args), copy.deepcopy(kwargs)
            with xpu_ops.use_provider(prov):
                res = getattr(torch.ops.xpu_ops, op)(*a, **kw)
            results.append((res, a))
        (want, want_args), (got, got_args) = results
        pairs = list(zip(got if isinstance(got, tuple) else [got],
                         want if isinstance(want, tuple) else [want]))
        pairs += [(g, w) for i, (g, w) in enumerate(zip(got_args, want_args))
                  if not (op == "flash_mla_decode" and i == 5)]
        for g, w in pairs:
            if not isinstance(g, torch.Tensor) or g.numel() == 0:
                continue
            if g.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or not g.is_floating_point():
                assert torch.equal(g.view(torch.uint8) if g.element_size() == 1 else g,
                                   w.view(torch.uint8) if w.element_size() == 1 else w), op
                continue
            fin = torch.isfinite(w)
            assert torch.equal(fin, torch.isfinite(g)), op
            if not fin.any():
                continue
            tol = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}[g.dtype]
            assert (g[fin].float() - w[fin].float()).abs().max().item() <= tol * max(
                1.0, w[fin].float().abs().max().item()), op
        # opcheck's test_schema compares mutated tensors with a multiply that CUDA lacks for
        # fp8 ("mul_cuda" not implemented for Float8_e4m3fn): skip that one check for fp8 cases.
        fp8 = any(isinstance(t, torch.Tensor) and t.dtype in (torch.float8_e4m3fn,
                                                               torch.float8_e5m2) for t in args)
        utils = ("test_faketensor", "test_aot_dispatch_dynamic") if fp8 else (
            "test_schema", "test_autograd_registration", "test_faketensor",
            "test_aot_dispatch_dynamic")
        with xpu_ops.use_provider("triton"):
            torch.library.opcheck(getattr(torch.ops.xpu_ops, op).default, args, kwargs,
                                  test_utils=utils)


# ---- FlashAttention-3 surface (API.md): masks, splits, appends and rotary on the device ----

def _block_ids(q_lens, spans):
    """Packed bidirectional_block_ids: span (request, first row, last row) k gets id k."""
    ids = torch.full((sum(q_lens),), -1, dtype=torch.int32)
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    for block, (r, first, last) in enumerate(spans):
        ids[starts[r] + first:starts[r] + last + 1] = block
    return ids.to(DEVICE)


@pytest.mark.parametrize("window", [(-1, -1), (300, 0)])
def test_fa3_leftpad_and_bidirectional_blocks(window):
    """A full prefill with image blocks crossing key tiles, and an extend after a prefix, with
    cache_leftpad skipping tiles (sglang 0.5.23 passes causal=False with the ids)."""
    q_lens = [1000, 200]
    q, k, v, lens, table, cu = paged_case([1000, 600], q_lens, 64, hq=16, hkv=4)
    kw = dict(cache_seqlens=lens, page_table=table, cu_seqlens_q=cu, max_seqlen_q=1000,
              window_size=window, causal=False,
              cache_leftpad=torch.tensor([130, 0], dtype=torch.int32, device=DEVICE),
              bidirectional_block_ids=_block_ids(q_lens, [(0, 100, 400), (0, 700, 705),
                                                          (1, 10, 150)]))
    assert _both(q, k, v, **kw) < 1e-2


def test_fa3_one_split_is_batch_invariant():
    """num_splits=1: a long decode request gives the same bits alone and in a batch (the
    automatic count would split it differently); num_splits=0 and 3 agree to rounding."""
    q, k, v, lens, table, cu = paged_case([70001, 1, 9000, 33333], [1, 1, 1, 1], 64)

    def run(rows, num_splits):
        idx = torch.tensor(rows, device=DEVICE)
        cu_r = torch.arange(len(rows) + 1, dtype=torch.int32, device=DEVICE)
        with xpu_ops.use_provider("triton"):
            return xpu_ops.flash_attn_with_kvcache(
                q[idx], k, v, cache_seqlens=lens[idx], page_table=table[idx], cu_seqlens_q=cu_r,
                max_seqlen_q=1, num_splits=num_splits)
    alone, batch = run([0], 1), run([0, 1, 2, 3], 1)
    assert torch.equal(alone, batch[:1])
    assert _rel(run([0, 1, 2, 3], 0), batch) < 1e-2 and _rel(run([0, 1, 2, 3], 3), batch) < 1e-2


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "dense"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_fa3_append_with_rotary(paged, interleaved):
    """k/v appended at cache_seqlens (the length before), keys and queries rotated (rotary_dim
    64 of 128): caches and outputs of the triton provider equal the reference's."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    b, s_new, hq, hkv, d = 3, 16, 16, 4, 128
    lens = torch.tensor([1000, 0, 4000], dtype=torch.int32, device=DEVICE)
    if paged:
        _, k_cache, v_cache, _, table, _ = paged_case([1016, 16, 4016], [1, 1, 1], 64, hq=hq,
                                                      hkv=hkv, d=d)
        layout = dict(page_table=table)
    else:
        k_cache = torch.randn(4, 4100, hkv, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        v_cache = torch.randn_like(k_cache)
        layout = dict(cache_batch_idx=torch.tensor([2, 0, 3], dtype=torch.int32, device=DEVICE))
    q = torch.randn(b, s_new, hq, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, s_new, hkv, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    angle = torch.rand(8192, 32, device=DEVICE, generator=gen) * 6.283
    results = []
    for provider in ("reference", "triton"):
        caches = (k_cache.clone(), v_cache.clone())
        with xpu_ops.use_provider(provider):
            out = xpu_ops.flash_attn_with_kvcache(
                q, *caches, k, v, rotary_cos=angle.cos().bfloat16(),
                rotary_sin=angle.sin().bfloat16(), cache_seqlens=lens, causal=True,
                rotary_interleaved=interleaved, **layout)
        results.append((out, *caches))
    assert _rel(results[1][0], results[0][0]) < 1e-2
    for got, want in zip(results[1][1:], results[0][1:]):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def test_fa3_varlen_seqused_q_and_k():
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    q_lens, k_lens = [300, 5, 700], [900, 0, 700]
    used_q, used_k = [200, 5, 1], [850, 0, 300]
    q = torch.randn(sum(q_lens), 16, 128, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(sum(k_lens), 4, 128, device=DEVICE, dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32,
                               device=DEVICE) for n in (q_lens, k_lens))
    kw = dict(max_seqlen_q=700, max_seqlen_k=900, causal=True,
              seqused_q=torch.tensor(used_q, dtype=torch.int32, device=DEVICE),
              seqused_k=torch.tensor(used_k, dtype=torch.int32, device=DEVICE))
    outs = []
    for provider in ("reference", "triton"):
        with xpu_ops.use_provider(provider):
            outs.append(xpu_ops.flash_attn_varlen_func(q, k, v, cu_q, cu_k, **kw))
    assert _rel(outs[1], outs[0]) < 1e-2
    assert outs[1][200:300].eq(0).all() and outs[1][306:].eq(0).all()
