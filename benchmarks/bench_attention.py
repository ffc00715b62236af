"""Benchmark the ``triton`` attention kernels against the device's ceilings and peers.

One process: measure the ceilings (device-to-device copy bandwidth, a large bf16 matmul), then
each workload of the targets table with the Triton provider and the peers that apply (torch SDPA
on contiguous K/V, FlexAttention over the paged cache, the reference provider, FlashInfer when it
imports). Writes ``attention.md`` (table), ``attention.png`` (plot) and ``attention.json`` to
``--out``. Times are medians of ``triton.testing.do_bench`` (device events) after warm-up.

``--variant`` A/B-tests kernel paths in the same process: ``baseline`` is the portable kernel
(no optional path), every other name a path of ``xpu_ops.triton._common.OPTIONAL_PATHS``; each
is timed through the launcher with the default tile config and only that path on (the ``triton
ms`` column is the op call with the process's defaults: ``DEFAULT_PATHS`` of each launch kind, or
``XPU_OPS_TRITON_PATHS``). ``--only`` keeps the rows whose names contain one of its substrings.

``--kernels-table`` is the kernels' one-run table (``gpu_session.sh`` part ``kernels``): MLA decode,
decode 64x4096 page 16/64 and 8x32768 against SDPA, cuDNN and FlashInfer, each decode row also
under both decode split schedules (``waves plan``/``legacy plan`` columns, the split counts under
the table) and page 16 under two-page and 4-warp tiles, the op-call rows (``attention_calls``:
b=1 decode eager and inside a CUDA graph), then prefill 8x4096 causal against SDPA, cuDNN,
FlashAttention-2 (SDPA's flash backend), FlashInfer and Flex. Every table names the device.
Beside it, ``limits.md``/``.json`` (``limits_report``): what limits the rows short of their
targets, measured in the same process: the eager call's host time split into our Python, the
Triton launch and the rest (after the op-call rows), the compiled kernels of the prefill and MLA
rows (registers, spills, shared memory, occupancy, waves), and last the host time per 16-layer
decode step in compiled mode (``compiled_step_host``).

    python benchmarks/bench_attention.py --kernels-table --out /tmp/kernels
    python benchmarks/bench_attention.py --quick --variant all --out benchmarks/results
    python benchmarks/bench_attention.py --quick --only "decode 1x,decode 4x" --out /tmp/small
    python benchmarks/bench_attention.py --quick --variant none --only "prefill 8x4096 causal" \
        --peers sdpa --configs "baseline@128,128,8,2;tma@128,128,8,3" --out /tmp/prefill
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from typing import Callable, Optional
from unittest import mock

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import xpu_ops  # noqa: E402
from xpu_ops.triton import _common  # noqa: E402
from xpu_ops.triton import paged_attention as pa  # noqa: E402
from xpu_ops.testing import recorded_triton_launches  # noqa: E402

DEV = "cuda"
HQ, HKV, D = 32, 8, 128
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried beside the default heuristic
DECODE_CFGS = [(16, 64, 4, 4), (16, 64, 2, 4), (16, 128, 2, 3), (16, 32, 2, 4), (16, 64, 2, 3),
               (16, 64, 1, 4), (16, 32, 1, 6)]
# (num_splits, BLOCK_M, BLOCK_N, num_warps, num_stages) for MLA decode
MLA_CFGS = [(8, 64, 32, 8, 2), (8, 32, 32, 4, 2), (8, 64, 64, 8, 2), (8, 128, 32, 8, 2),
            (4, 64, 32, 4, 2), (8, 16, 64, 4, 2), (2, 64, 32, 8, 3), (8, 64, 64, 16, 2),
            (8, 64, 32, 16, 2), (8, 128, 32, 16, 2)]
# 16 warps: four warpgroups share the [64 x 512] fp32 accumulator (FlashMLA splits it over two);
# the last two split the latent output columns over two programs (mla_split).
MLA_QUICK_CFGS = [(8, 64, 64, 16, 2), (8, 64, 32, 16, 2)]
MLA_VARIANTS = ("baseline", "mla_split")
# kernel paths that can change a decode launch (tma needs whole-tile row boxes: prefill)
DECODE_VARIANTS = ("baseline", "page_tiles", "phases")
PREFILL_CFGS = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3),
                (128, 32, 4, 3)]


# ---- bytes and FLOPs ---------------------------------------------------------------------------
def attention_cost(q_lens, k_lens, hq, hkv, d, dv, causal, elem=2, kv_elem=None, window=-1):
    """(bytes, flops) of one attention call: K/V of every request read once (``kv_elem`` bytes
    per element; a window reads only the keys some row sees), q read and out written once;
    FLOPs 2*(D + Dv) per visible (query, key, head), causal bottom-right, ``window`` keys left
    of the diagonal (-1: unbounded)."""
    kv_elem = kv_elem or elem
    keys = pairs = 0
    for lq, lk in zip(q_lens, k_lens):
        row_keys = [min(lk, lk - lq + i + 1) if causal else lk for i in range(lq)]
        if window >= 0:
            row_keys = [min(n, window + 1) for n in row_keys]
            keys += lk - max(0, lk - lq - window)
        else:
            keys += lk
        pairs += sum(row_keys)
    kv_bytes = keys * hkv * (d + dv) * kv_elem
    q_bytes = sum(q_lens) * hq * (d + dv) * elem
    return kv_bytes + q_bytes, 2 * (d + dv) * hq * pairs


def mla_cost(b, k_len, h, latent, rope, elem=2):
    """Latent cache read once ([R + r] per token), q read, out written; 2*(R+r) + 2*R per pair."""
    return (b * k_len * (latent + rope) + b * h * (2 * latent + rope)) * elem, \
        b * h * k_len * (2 * (latent + rope) + 2 * latent)


# ---- ceilings ----------------------------------------------------------------------------------
def ceilings():
    n = 1 << 30  # 2 GiB of bf16 per side
    src = torch.randn(n, device=DEV, dtype=BF16)
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    copy_tbs = 2 * src.numel() * 2 / (t * 1e-3) / 1e12
    del src, dst
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    t = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    mm_tflops = 2 * 8192 ** 3 / (t * 1e-3) / 1e12
    return copy_tbs, mm_tflops


# ---- workloads ---------------------------------------------------------------------------------
def make_paged(k_lens, q_lens, page_size, hq=HQ, hkv=HKV, d=D, kv_dtype=None, table_tokens=0):
    """Random paged K/V, shuffled pages; the page table is ``table_tokens`` wide when that is
    more than the longest request (a graph's table: the split plan sees its capacity)."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    pages = [-(-k // page_size) for k in k_lens]
    num_pages = sum(pages)
    perm = torch.randperm(num_pages, device=DEV, generator=gen).int()
    width = max(max(pages), -(-table_tokens // page_size))
    table = torch.zeros(len(k_lens), width, dtype=torch.int32, device=DEV)
    start = 0
    for r, used in enumerate(pages):
        table[r, :used] = perm[start:start + used]
        start += used
    k = torch.randn(num_pages, page_size, hkv, d, device=DEV, dtype=BF16, generator=gen)
    v = torch.randn(num_pages, page_size, hkv, d, device=DEV, dtype=BF16, generator=gen)
    q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=BF16, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV)
    lens = torch.tensor(k_lens, dtype=torch.int32, device=DEV)
    extra = {}
    if kv_dtype is not None:  # fp8 cache: one descale per (request, KV head), here all equal
        k, v = k.to(kv_dtype), v.to(kv_dtype)
        extra = dict(k_descale=torch.full((len(k_lens), hkv), 0.5, device=DEV),
                     v_descale=torch.full((len(k_lens), hkv), 0.5, device=DEV))
    return dict(q=q, k=k, v=v, table=table, cu=cu, lens=lens, q_lens=q_lens, k_lens=k_lens,
                page_size=page_size, extra=extra)


def contiguous_kv(w):
    """Per-request contiguous K/V [b, Hkv, Lk_max, D] (equal lengths only) for SDPA."""
    b = len(w["k_lens"])
    lk = max(w["k_lens"])
    idx = w["table"].long()[:, :, None] * w["page_size"] + torch.arange(w["page_size"],
                                                                         device=DEV)
    idx = idx.view(b, -1)[:, :lk]
    kf = w["k"].flatten(0, 1)[idx].transpose(1, 2).contiguous()
    vf = w["v"].flatten(0, 1)[idx].transpose(1, 2).contiguous()
    return kf, vf


def op_fn(w, causal, window, provider):
    """The public op under ``provider`` (the process's default paths for ``triton``)."""
    out = torch.empty_like(w["q"])
    mq = max(w["q_lens"])

    def run():
        with xpu_ops.use_provider(provider):
            xpu_ops.flash_attn_with_kvcache(w["q"], w["k"], w["v"], cache_seqlens=w["lens"],
                                            page_table=w["table"], cu_seqlens_q=w["cu"],
                                            max_seqlen_q=mq, causal=causal, out=out,
                                            window_size=(window, 0 if causal else -1),
                                            **w["extra"])
    return run


def variant_config(w, variant):
    """The default tile config with only ``variant``'s path on (``baseline``: none)."""
    paths = frozenset() if variant == "baseline" else frozenset({variant})
    return pa.default_config(w["q"], w["v"], max(w["q_lens"]), w["k"].shape[2], paths,
                             w["page_size"])


def launched_paths(fn) -> str:
    """The tiles and kernel-path constexprs ``fn``'s launch resolved to (one call, spied)."""
    try:
        with recorded_triton_launches() as seen:
            fn()
    except Exception as e:
        return f"failed: {type(e).__name__}: {str(e)[:300]}"
    keys = ("BLOCK_M", "BLOCK_N", "NUM_SPLITS", "PAGE_TILES", "EVEN_D", "PHASES", "TMA", "WS",
            "num_warps", "num_stages")
    return ", ".join(f"{k}={seen[0].get(k, '-')}" for k in keys) if seen else "no launch"


def launcher_fn(w, causal, window=-1, num_splits=None, config=None):
    """The launcher directly, to sweep split counts, tiles and kernel paths."""
    out = torch.empty_like(w["q"])
    page = w["page_size"]
    extra = w["extra"]

    def run():
        pa.paged_attention(w["q"], w["k"], w["v"], out, w["lens"], w["cu"], page_table=w["table"],
                           cu_seqlens_k=None, max_seqlen_q=max(w["q_lens"]),
                           max_kv_len=w["table"].shape[1] * page, qv=None, q_descale=None,
                           k_descale=extra.get("k_descale"), v_descale=extra.get("v_descale"),
                           sinks=None, softmax_scale=1 / math.sqrt(D), window_left=window,
                           window_right=0 if causal else -1, softcap=0.0, num_splits=num_splits,
                           config=config)
    return run


# SDPA peers pinned to one backend: cuDNN's fused attention and FlashAttention-2 (PyTorch's
# flash backend); "sdpa" is PyTorch's own dispatch.
SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "fa2": "FLASH_ATTENTION"}


def sdpa_fn(w, causal, backend=None):
    """torch SDPA on contiguous per-request K/V (equal lengths), bottom-right causal; only
    ``backend`` (a ``SDPBackend`` name) when given, which raises where it cannot run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    b, lq, lk = len(w["q_lens"]), max(w["q_lens"]), max(w["k_lens"])
    if len(set(w["k_lens"])) > 1 or len(set(w["q_lens"])) > 1 or w["extra"]:
        return None
    kf, vf = contiguous_kv(w)
    q = w["q"].view(b, lq, HQ, D).transpose(1, 2).contiguous()
    F = torch.nn.functional
    if lq == 1:
        call = lambda: F.scaled_dot_product_attention(q, kf, vf, enable_gqa=True)  # noqa: E731
    else:
        kx, vx = kf.repeat_interleave(HQ // HKV, 1), vf.repeat_interleave(HQ // HKV, 1)
        bias = None if lq == lk else causal_lower_right(lq, lk)
        call = lambda: F.scaled_dot_product_attention(  # noqa: E731
            q, kx, vx, is_causal=causal and bias is None, attn_mask=bias)
    if backend is None:
        return call
    pinned = getattr(SDPBackend, backend)

    def run():
        with sdpa_kernel([pinned]):
            return call()
    return run


def flex_fn(w, causal, window=-1):
    """FlexAttention over the physical paged cache: K/V [1, Hkv, slots, D] shared by the batch,
    a mask_mod mapping each physical slot back to (request, logical position)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    b, lq = len(w["q_lens"]), max(w["q_lens"])
    if len(set(w["q_lens"])) > 1 or w["extra"]:
        return None
    page = w["page_size"]
    num_pages = w["k"].shape[0]
    slots = num_pages * page
    owner = torch.full((num_pages,), -1, dtype=torch.int64, device=DEV)
    logical = torch.zeros(num_pages, dtype=torch.int64, device=DEV)
    for r, n in enumerate(w["k_lens"]):
        used = -(-n // page)
        owner[w["table"][r, :used].long()] = r
        logical[w["table"][r, :used].long()] = torch.arange(used, device=DEV)
    lens = w["lens"].long()

    def mask_mod(bi, h, qi, kv):
        p = kv // page
        pos = logical[p] * page + kv % page
        ok = (owner[p] == bi) & (pos < lens[bi])
        if causal:
            ok = ok & (pos <= lens[bi] - lq + qi)
        if window >= 0:
            ok = ok & (pos >= lens[bi] - lq + qi - window)
        return ok

    bm = torch.compile(create_block_mask)(mask_mod, b, None, lq, slots, device=DEV)
    q = w["q"].view(b, lq, HQ, D).transpose(1, 2)
    k = w["k"].view(1, slots, HKV, D).transpose(1, 2).expand(b, HKV, slots, D)
    v = w["v"].view(1, slots, HKV, D).transpose(1, 2).expand(b, HKV, slots, D)
    fa = torch.compile(flex_attention, dynamic=False)
    return lambda: fa(q, k, v, block_mask=bm, enable_gqa=True)


def flashinfer_fn(w, causal, window=-1):
    """FlashInfer's paged decode (one query per request) or prefill wrapper, NHD layout, the
    same page table as CSR; fp8 caches with FlashInfer's scalar k/v scales (our descale)."""
    try:
        import flashinfer
    except Exception as e:
        print(f"    flashinfer does not import: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None
    page = w["page_size"]
    b = len(w["k_lens"])
    pages = [-(-n // page) for n in w["k_lens"]]
    indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0)), dtype=torch.int32,
                          device=DEV)
    indices = torch.cat([w["table"][r, :pages[r]] for r in range(b)])
    last = torch.tensor([n - (p - 1) * page for n, p in zip(w["k_lens"], pages)],
                        dtype=torch.int32, device=DEV)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    kv, kv_dtype = (w["k"], w["v"]), w["k"].dtype
    scales = {}
    if w["extra"]:
        scales = dict(k_scale=float(w["extra"]["k_descale"][0, 0]),
                      v_scale=float(w["extra"]["v_descale"][0, 0]))
    if max(w["q_lens"]) == 1:
        dec = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        dec.plan(indptr, indices, last, HQ, HKV, D, page, window_left=window,
                 q_data_type=BF16, kv_data_type=kv_dtype)
        return lambda: dec.run(w["q"], kv, **scales)
    pre = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    pre.plan(w["cu"], indptr, indices, last, HQ, HKV, D, page, causal=causal,
             window_left=window, q_data_type=BF16, kv_data_type=kv_dtype)
    return lambda: pre.run(w["q"], kv, **scales)


@dataclasses.dataclass
class Row:
    workload: str
    kind: str           # "bw" or "flops"
    target: str
    triton_ms: float
    bytes: float
    flops: float
    peers: dict
    variants: dict = dataclasses.field(default_factory=dict)  # kernel path -> launcher ms
    notes: list = dataclasses.field(default_factory=list)     # shown under the table


def measure(fn: Optional[Callable]) -> Optional[float]:
    if fn is None:
        return None
    try:
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    except Exception as e:  # a peer that cannot run this shape is reported as missing
        print(f"    peer failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def safe(make):
    try:
        return make()
    except Exception as e:
        print(f"    peer setup failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


ALL_PEERS = ("sdpa", "flex", "reference", "flashinfer")
TABLE_PEERS = ("sdpa", "cudnn", "fa2", "flex", "flashinfer", "reference")


def run_attention(name, kind, target, k_lens, q_lens, page, causal, peers=ALL_PEERS, sweep=(),
                  variants=(), window=-1, kv_dtype=None, table_tokens=0, d=D, configs=(),
                  schedules=(), patches=(), sweep_columns=False, limits=None):
    """One workload: the op, each kernel variant and each ``configs`` entry (``(label,
    _Config)``) through the launcher, each split schedule of ``schedules`` (the launcher with
    planned splits under ``split_plan.set_schedule``), peers, sweeps (the peers assume head dim
    ``D``), and each ``patches`` entry (``(label, {paged_attention constant: value})``: the
    launcher with default tiles while those constants are patched); ``sweep_columns``: the
    sweep's times also become table columns (else only logged); ``limits``: a
    ``limits_report.LimitsReport`` that gets the compiled kernels of the op and each config."""
    print(f"== {name}", flush=True)
    w = make_paged(k_lens, q_lens, page, d=d, kv_dtype=kv_dtype, table_tokens=table_tokens)
    nbytes, flops = attention_cost(q_lens, k_lens, HQ, HKV, d, d, causal,
                                   kv_elem=w["k"].element_size(), window=window)
    start = time.perf_counter()
    t = measure(op_fn(w, causal, window, "triton"))
    print(f"    op: {t} ms ({time.perf_counter() - start:.0f} s into the row)", flush=True)
    if limits is not None:
        limits.kernel_rows(f"{name}: op", op_fn(w, causal, window, "triton"))
    timed = {}
    for v in variants:
        fn = launcher_fn(w, causal, window, config=variant_config(w, v))
        print(f"    variant {v}: {launched_paths(fn)}", flush=True)
        timed[v] = measure(fn)
    for label, config in configs:
        fn = launcher_fn(w, causal, window, config=config)
        print(f"    config {label}: {launched_paths(fn)}", flush=True)
        timed[label] = measure(fn)
        if limits is not None:
            limits.kernel_rows(f"{name}: {label}", fn)
        print(f"    config {label}: {timed[label]} ms", flush=True)
    notes = [schedule_ab(w, causal, window, schedules, timed)] if schedules else []
    for label, values in patches:
        with mock.patch.multiple(pa, **values):
            pa._launch_params.cache_clear()
            fn = launcher_fn(w, causal, window)
            print(f"    patch {label}: {launched_paths(fn)}", flush=True)
            timed[label] = measure(fn)
        pa._launch_params.cache_clear()
        print(f"    patch {label}: {timed[label]} ms", flush=True)
    res = {}
    for p in peers:
        make = {"sdpa": lambda: sdpa_fn(w, causal),
                "cudnn": lambda: sdpa_fn(w, causal, SDPA_BACKENDS["cudnn"]),
                "fa2": lambda: sdpa_fn(w, causal, SDPA_BACKENDS["fa2"]),
                "flex": lambda: flex_fn(w, causal, window),
                "reference": lambda: op_fn(w, causal, window, "reference"),
                "flashinfer": lambda: flashinfer_fn(w, causal, window)}[p]
        res[p] = measure(safe(make))
        torch.cuda.empty_cache()
        # each peer's end is logged: a run cut by its timeout shows which one took the time
        print(f"    peer {p}: {res[p]} ms ({time.perf_counter() - start:.0f} s into the row)",
              flush=True)
    for label, kw in sweep:
        kw = dict(kw)
        chunk = kw.pop("chunk_keys", pa.DECODE_CHUNK_KEYS)  # the plan's, or one to compare
        with mock.patch.object(pa, "DECODE_CHUNK_KEYS", chunk):
            pa._launch_params.cache_clear()
            ms = measure(launcher_fn(w, causal, window, **kw))
        pa._launch_params.cache_clear()
        print(f"    sweep {label}: {ms:.4f} ms" if ms else f"    sweep {label}: failed", flush=True)
        if sweep_columns:
            timed[label] = ms
    row = Row(name, kind, target, t, nbytes, flops, res, timed, notes)
    print(f"    triton {t:.4f} ms, variants {timed}, peers {res}", flush=True)
    del w
    torch.cuda.empty_cache()
    return row


def schedule_ab(w, causal, window, schedules, timed) -> str:
    """Time the launcher with planned splits under each split schedule into ``timed``
    (``<schedule> plan`` columns); returns the note naming each schedule's split count."""
    from xpu_ops.triton import split_plan
    counts = []
    for schedule in schedules:
        previous = split_plan.set_schedule(schedule)
        try:
            fn = launcher_fn(w, causal, window)
            launched = launched_paths(fn)
            timed[f"{schedule} plan"] = measure(fn)
        finally:
            split_plan.set_schedule(previous)
        splits = launched.split("NUM_SPLITS=")[-1].split(",")[0] if "NUM_SPLITS=" in launched \
            else "?"
        counts.append(f"{schedule} {splits}")
        print(f"    {schedule} plan: {launched}: {timed[f'{schedule} plan']} ms", flush=True)
    return "split counts: " + ", ".join(counts)


def run_mla(name, target, b=64, k_len=4096, h=128, latent=512, rope=64, page=64, sweep=(),
            variants=(), limits=None):
    """Absorbed MLA decode: the op (``flash_mla_decode``), the reference, each kernel variant
    that applies (``baseline``, ``mla_split``) and each ``sweep`` config through the launcher
    (``(num_splits, BLOCK_M, BLOCK_N, num_warps, num_stages)``; in the table as ``cfg ...``);
    ``limits`` (a ``limits_report.LimitsReport``) gets the compiled kernels of the op and each
    sweep config."""
    print(f"== {name}", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    width = k_len // page
    kv = torch.randn(b * width, page, latent + rope, device=DEV, dtype=BF16, generator=gen)
    table = torch.randperm(b * width, device=DEV, generator=gen).view(b, width).int()
    lens = torch.full((b,), k_len, dtype=torch.int32, device=DEV)
    qn = torch.randn(b, h, latent, device=DEV, dtype=BF16, generator=gen)
    qr = torch.randn(b, h, rope, device=DEV, dtype=BF16, generator=gen)
    ws = torch.empty(xpu_ops.flash_mla_get_workspace_size(k_len, b, h, page), dtype=torch.uint8,
                     device=DEV)

    def fn(prov):
        def run():
            with xpu_ops.use_provider(prov):
                xpu_ops.flash_mla_decode(qn, qr, kv, lens, table, ws, 1 / math.sqrt(576))
        return run
    t = measure(fn("triton"))
    if limits is not None:
        limits.kernel_rows(f"{name}: op", fn("triton"))
    res = {"reference": measure(fn("reference"))}
    out = torch.empty_like(qn)
    cu = torch.arange(b + 1, dtype=torch.int32, device=DEV)

    def direct(splits, config):
        return lambda: pa.paged_attention(
            qr, kv[:, :, None, latent:], kv[:, :, None, :latent], out, lens, cu,
            page_table=table, cu_seqlens_k=None, max_seqlen_q=1, max_kv_len=k_len, qv=qn,
            q_descale=None, k_descale=None, v_descale=None, sinks=None,
            softmax_scale=1 / math.sqrt(576), window_left=-1, window_right=-1, softcap=0.0,
            num_splits=splits, config=config)
    timed = {}
    default = pa.default_config(qr, kv[:, :, None, :latent], 1, 1, frozenset())
    for v in (v for v in variants if v in MLA_VARIANTS):
        run = direct(8, pa.with_paths(default, frozenset() if v == "baseline" else {v}))
        print(f"    variant {v}: {launched_paths(run)}", flush=True)
        timed[v] = measure(run)
    for c in sweep:
        run = direct(c[0], pa._Config(*c[1:]))
        label = "cfg " + "/".join(str(x) for x in c)
        print(f"    {label}: {launched_paths(run)}", flush=True)
        timed[label] = measure(run)
        if limits is not None:
            limits.kernel_rows(f"{name}: {label}", run)
    nbytes, flops = mla_cost(b, k_len, h, latent, rope)
    print(f"    triton {t:.4f} ms, variants {timed}, peers {res}", flush=True)
    return Row(name, "flops", target, t, nbytes, flops, res, timed)


def fraction(r, ms, copy_tbs, mm_tflops):
    """Fraction of the row's ceiling (copy bandwidth or matmul) reached in ``ms``."""
    if r.kind == "bw":
        return r.bytes / (ms * 1e-3) / 1e12 / copy_tbs
    return r.flops / (ms * 1e-3) / 1e12 / mm_tflops


def target_met(r, copy_tbs, mm_tflops):
    """Whether the fastest of the op call and the variants meets ``r.target`` (">= x copy",
    ">= x matmul" or ">= x <peer>": peer time / triton time), naming that variant."""
    if not r.target.startswith(">="):
        return ""
    _, num, against = r.target.split()[:3]
    timed = {"op": r.triton_ms, **{v: ms for v, ms in r.variants.items() if ms}}
    name, ms = min(timed.items(), key=lambda kv: kv[1])
    if against in ("copy", "matmul"):
        got = fraction(r, ms, copy_tbs, mm_tflops)
    else:
        peer = r.peers.get(against.lower())
        if not peer:
            return "n/a"
        got = peer / ms
    return f"{'yes' if got >= float(num) else 'no'} ({got:.2f}, {name})"


def table(rows, copy_tbs, mm_tflops, header):
    peers = [p for p in TABLE_PEERS if any(p in r.peers for r in rows)]
    variants = list(dict.fromkeys(v for r in rows for v in r.variants))
    lines = [header, "",
             f"Ceilings measured in this run: device copy {copy_tbs:.2f} TB/s (read + write), "
             f"bf16 matmul 8192^3 {mm_tflops:.0f} TFLOP/s.", "",
             "| workload | triton ms | TB/s | TFLOP/s | fraction of ceiling | target | met | "
             + "".join(f"{v} ms (fraction) | " for v in variants)
             + " | ".join(f"x {p}" for p in peers) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * (len(variants) + len(peers))]
    for r in rows:
        tbs = r.bytes / (r.triton_ms * 1e-3) / 1e12
        tfl = r.flops / (r.triton_ms * 1e-3) / 1e12
        frac = fraction(r, r.triton_ms, copy_tbs, mm_tflops)
        met = target_met(r, copy_tbs, mm_tflops)
        ratios = [("missing" if r.peers.get(p) is None else f"{r.peers[p] / r.triton_ms:.2f}")
                  if p in r.peers else "-" for p in peers]
        timed = [("-" if v not in r.variants else "failed" if r.variants[v] is None else
                  f"{r.variants[v]:.4f} ({fraction(r, r.variants[v], copy_tbs, mm_tflops):.2f})")
                 for v in variants]
        lines.append(f"| {r.workload} | {r.triton_ms:.4f} | {tbs:.2f} | {tfl:.0f} | "
                     f"{frac:.2f} of {'copy BW' if r.kind == 'bw' else 'matmul'} | {r.target} | "
                     f"{met} | " + "".join(f"{x} | " for x in timed) + " | ".join(ratios) + " |")
    lines += ["", "`x peer` = peer time / triton time (> 1: triton faster). `missing`: the peer "
              "could not run this shape in this process (see the log); `-`: not applicable. "
              "Variant columns: the launcher with the default tiles and only that kernel path "
              "on (`baseline`: the portable kernel, no optional path); `<schedule> plan`: "
              "the launcher with the split count that decode split schedule plans "
              "(`xpu_ops/triton/split_plan.py`); `PATHS@MxNxWxS`: the launcher with that "
              "tile config (BLOCK_M, BLOCK_N, warps, stages); `splits=N`: the launcher at N "
              "splits; `4-page tiles`: the launcher with page_tiles over tiles of up to four "
              "pages (`PAGE_TILE_MAX_PAGES = 4`). Peers: `sdpa` is PyTorch's SDPA dispatch on "
              "contiguous K/V, `cudnn` and `fa2` the same pinned to its cuDNN and "
              "FlashAttention-2 backends, `flex` FlexAttention over the paged cache, "
              "`flashinfer` FlashInfer's paged wrappers."]
    notes = [f"- {r.workload}: {n}" for r in rows for n in r.notes]
    lines += ["", *notes] if notes else []
    return "\n".join(lines)


def plot(rows, copy_tbs, mm_tflops, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    names = [r.workload for r in rows]
    fr = [fraction(r, r.triton_ms, copy_tbs, mm_tflops) for r in rows]
    ax.barh(names, fr, color="tab:blue", label="triton, fraction of ceiling")
    for p, c in (("sdpa", "tab:orange"), ("flashinfer", "tab:green"), ("flex", "tab:red")):
        xs = []
        for r, f in zip(rows, fr):
            xs.append(f * r.triton_ms / r.peers[p] if r.peers.get(p) else float("nan"))
        if any(x == x for x in xs):
            ax.scatter(xs, names, color=c, label=p, zorder=3)
    ax.axvline(1.0, color="k", lw=0.5)
    ax.set_xlabel("fraction of ceiling (copy BW for decode, bf16 matmul for prefill)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_variants(spec: str) -> tuple[str, ...]:
    """``--variant``: "all" (baseline and every optional path), "none", or a comma list."""
    if spec == "none":
        return ()
    if spec == "all":
        return ("baseline", *_common.OPTIONAL_PATHS)
    names = tuple(v.strip() for v in spec.split(",") if v.strip())
    known = ("baseline", *_common.OPTIONAL_PATHS)
    bad = [v for v in names if v not in known]
    if bad:
        raise SystemExit(f"--variant: {bad} not in {known}")
    return names


def variant_help() -> str:
    paths = "; ".join(f"{k}: {v}" for k, v in _common.OPTIONAL_PATHS.items())
    return ("kernel paths to time side by side, comma-separated, 'all' (default) or 'none'. "
            f"baseline: the portable kernel; {paths}. The op-call column uses the process "
            "defaults (DEFAULT_PATHS per launch kind, or XPU_OPS_TRITON_PATHS, read once at "
            "import). Decode rows time only "
            f"those of {DECODE_VARIANTS}, the MLA row those of {MLA_VARIANTS}, attention rows "
            "all but mla_split.")


FLEX_QUICK = ("decode 64x4096 page 16", "prefill 8x4096 causal page 64",
              "prefill 8x4096 window 1024 page 64")
# Variants timed after every other measurement, with the table already written: a device
# fault in a new descriptor kernel would poison the process for whatever runs after it.
LATE_VARIANTS = ("tma", "tma_ws")


def workloads(quick: bool, variants: tuple) -> list[dict]:
    """The ``run_attention`` keywords of every attention row."""
    import random
    rng = random.Random(0)
    uniform = [rng.randint(100, 8000) for _ in range(64)]

    def splits(counts):
        return () if quick else tuple((f"splits={s}", {"num_splits": s}) for s in counts)

    def cfgs(shapes):
        return () if quick else tuple((f"cfg={c}", {"config": pa._Config(*c)}) for c in shapes)
    small_splits = tuple((f"splits={n}", {"num_splits": n}) for n in (4, 16, 32, 64))
    # the full-grid plan with other chunk lengths (DECODE_CHUNK_KEYS) for mixed lengths
    chunks = tuple((f"plan, chunks of {n} keys", {"chunk_keys": n}) for n in (1024, 2048, 8192))
    # deeper K/V pipelines for one-page (64-key) decode tiles: 6 stages fit in shared memory
    deep = tuple((f"page_tiles {c[2]} warps {c[3]} stages",
                  {"config": pa.with_paths(pa._Config(*c), frozenset({"page_tiles"}))})
                 for c in ((16, 64, 2, 6), (16, 64, 4, 6), (16, 64, 4, 4)))
    # 16-key pages: page_tiles with 32-key tiles (two pages per tile; the default config keeps
    # 64-key tiles and per-key page ids there). Compiled for sm_90: 80 registers, no spill.
    two_pages = tuple((f"page_tiles 32-key tiles {c[2]} warps {c[3]} stages",
                       {"config": pa.with_paths(pa._Config(*c), frozenset({"page_tiles"}))})
                      for c in ((16, 32, 4, 4), (16, 32, 2, 6), (16, 32, 4, 6)))
    vd = tuple(x for x in variants if x in DECODE_VARIANTS)
    decode = dict(kind="bw", causal=False, variants=vd)
    prefill = dict(kind="flops", causal=True, page=64,
                   variants=tuple(x for x in variants if x not in MLA_VARIANTS[1:]))
    b64, one = [4096] * 64, [1] * 64
    rows = [
        dict(name="decode 64x4096 page 1", target=">= 0.92 copy", k_lens=b64, q_lens=one,
             page=1, peers=("sdpa", "flashinfer"), **decode),
        dict(name="decode 64x4096 page 16", target=">= 0.92 copy", k_lens=b64, q_lens=one,
             page=16, sweep=two_pages + splits((1, 2, 4, 8)), **decode),
        dict(name="decode 64x4096 page 64", target=">= 0.92 copy", k_lens=b64, q_lens=one,
             page=64, sweep=(deep + chunks if quick
                             else splits((1, 2, 4, 8)) + cfgs(DECODE_CFGS) + deep + chunks),
             **decode),
        dict(name="decode 64x4096 page 128", target=">= 0.92 copy", k_lens=b64, q_lens=one,
             page=128, peers=("sdpa", "flashinfer"), **decode),
        dict(name="decode fp8 KV 64x4096 page 64", target=">= 0.92 copy", k_lens=b64,
             q_lens=one, page=64, peers=("flashinfer",), kv_dtype=FP8, **decode),
        dict(name="decode 8x32768 (split-KV)", target=">= 0.75 copy", k_lens=[32768] * 8,
             q_lens=[1] * 8, page=64, sweep=splits((8, 16, 24, 32)), **decode),
        dict(name="decode 64 x U[100,8000]", target=">= 0.90 copy", k_lens=uniform, q_lens=one,
             page=64, peers=("reference", "flex", "flashinfer"),
             sweep=splits((1, 2, 4, 8)) + chunks, **decode),
        # small batches (b = 1 decode fills a fraction of the device): the plan's
        # split count against forced ones, also under a 128k-token page table (a graph's)
        dict(name="decode 1x1024 D64 page 16, 2k table (Llama-3.2-1B)", target="-",
             k_lens=[1024], q_lens=[1], page=16, d=64, peers=(), table_tokens=2048,
             sweep=tuple((f"splits={n}", {"num_splits": n}) for n in (4, 8, 16)), **decode),
        dict(name="decode 1x4096 page 64", target="-", k_lens=[4096], q_lens=[1],
             page=64, peers=("sdpa", "flashinfer"), sweep=small_splits, **decode),
        dict(name="decode 1x4096 page 64, 128k table", target="-", k_lens=[4096],
             q_lens=[1], page=64, peers=(), table_tokens=131072, sweep=small_splits, **decode),
        dict(name="decode 1x16384 page 64", target="-", k_lens=[16384], q_lens=[1],
             page=64, peers=("sdpa", "flashinfer"), sweep=small_splits + deep, **decode),
        dict(name="decode 4x4096 page 16", target="-", k_lens=[4096] * 4,
             q_lens=[1] * 4, page=16, peers=("sdpa", "flashinfer"), sweep=small_splits, **decode),
        dict(name="decode 8x4096 page 64", target="-", k_lens=[4096] * 8,
             q_lens=[1] * 8, page=64, peers=("sdpa", "flashinfer"), sweep=small_splits + deep,
             **decode),
        dict(name="prefill 8x4096 causal page 64", target=">= 0.85 SDPA", k_lens=[4096] * 8,
             q_lens=[4096] * 8, peers=("sdpa", "flex", "flashinfer"), sweep=cfgs(PREFILL_CFGS),
             **prefill),
        dict(name="prefill 8x4096 window 1024 page 64", target=">= 0.85 flashinfer",
             k_lens=[4096] * 8, q_lens=[4096] * 8, peers=("flex", "flashinfer"), window=1023,
             **prefill),
        dict(name="extend 8x(4096+512) page 64", target=">= 1.00 SDPA", k_lens=[4608] * 8,
             q_lens=[512] * 8, peers=("sdpa", "flex", "reference", "flashinfer"),
             sweep=cfgs(PREFILL_CFGS), **prefill),
    ]
    if quick:  # FlexAttention compiles per workload: only where it is the closest peer
        for row in rows:
            if row["name"] not in FLEX_QUICK:
                row["peers"] = tuple(p for p in row.get("peers", ALL_PEERS) if p != "flex")
    return rows


# The kernels' one-run table (--kernels-table), in run order: row -> (target, peers, tile configs
# timed beside the default, "PATHS@BLOCK_M,BLOCK_N,num_warps,num_stages;..."). Decode rows also
# time both split schedules; the configs (4 warps, one stage less; at page 16 two-page tiles
# with one page-table load per page) compile for sm_90 without spills. Prefill last: its
# FlashInfer JIT is the longest step of the run.
WIDE_DECODE = "page_tiles@16,64,4,4;page_tiles@16,64,2,3"
TABLE_ROWS = {
    "decode 8x32768 (split-KV)": (">= 1.00 flashinfer", ("sdpa", "cudnn", "flashinfer"),
                                  WIDE_DECODE),
    "decode 64x4096 page 16": (">= 1.00 flashinfer", ("sdpa", "cudnn", "flashinfer", "flex"),
                               "page_tiles@16,32,4,4;page_tiles@16,32,2,6;page_tiles@16,64,4,4"),
    "decode 64x4096 page 64": ("-", ("sdpa", "cudnn", "flashinfer"), ""),
    "prefill 8x4096 causal page 64": (">= 0.80 cudnn", ("sdpa", "cudnn", "fa2", "flashinfer",
                                                        "flex"), ""),
}
# --kernels-table rows timed with paged_attention constants patched (default tiles): page 16 with
# page_tiles over the 64-key tile's four pages (one page-table load per page; compiled for
# sm_90 without spills), where the default loads a page id per key
TABLE_PATCHES = {"decode 64x4096 page 16": (("4-page tiles", {"PAGE_TILE_MAX_PAGES": 4}),)}
# --kernels-table rows timed at forced split counts too (table columns): 8 x 32768 at one
# wave of two programs per multiprocessor (4 splits) and at four waves (16) beside the plan's
TABLE_SPLITS = {"decode 8x32768 (split-KV)": (4, 16)}
# MLA decode in --kernels-table: the default tiles at 1, 2 and 4 splits beside the op's 8
# (mla_num_kv_splits): 64 x 2 row tiles of 8 warps nearly fill one wave unsplit, and each split
# adds fp32 partials of [64, 128, 512] (134 MB at 8 splits, against 302 MB of latent cache)
MLA_TABLE_CFGS = [(1, 64, 64, 8, 2), (2, 64, 64, 8, 2), (4, 64, 64, 8, 2)]
SCHEDULES = ("waves", "legacy")


def table_specs() -> list[dict]:
    """The ``run_attention`` keywords of the table's rows (no sweeps, no variants)."""
    specs = {spec["name"]: spec for spec in workloads(True, ())}
    for name, (target, peers, configs) in TABLE_ROWS.items():
        specs[name].update(target=target, peers=peers, sweep=(), variants=(),
                           configs=parse_configs(configs))
        if specs[name]["kind"] == "bw":
            specs[name]["schedules"] = SCHEDULES
        specs[name]["patches"] = TABLE_PATCHES.get(name, ())
        specs[name]["sweep"] = tuple((f"splits={n}", {"num_splits": n})
                                     for n in TABLE_SPLITS.get(name, ()))
        specs[name]["sweep_columns"] = True
    return [specs[name] for name in TABLE_ROWS]


def late_variants(spec: dict, row: Row) -> None:
    """Time ``spec``'s LATE_VARIANTS and its descriptor ``late_configs`` (through the
    launcher) into ``row.variants``."""
    late = [v for v in spec["variants"] if v in LATE_VARIANTS]
    configs = spec.get("late_configs", ())
    if not late and not configs:
        return
    print(f"== {spec['name']} (late variants)", flush=True)
    w = make_paged(spec["k_lens"], spec["q_lens"], spec["page"], kv_dtype=spec.get("kv_dtype"),
                   table_tokens=spec.get("table_tokens", 0))
    runs = [(v, variant_config(w, v)) for v in late] + list(configs)
    for v, config in runs:
        fn = launcher_fn(w, spec["causal"], spec.get("window", -1), config=config)
        print(f"    variant {v}: {launched_paths(fn)}", flush=True)
        row.variants[v] = measure(fn)
        print(f"    variant {v}: {row.variants[v]} ms", flush=True)
    del w
    torch.cuda.empty_cache()


def parse_configs(spec: str) -> tuple[tuple[str, "pa._Config"], ...]:
    """``--configs``: ';'-separated ``PATHS@BLOCK_M,BLOCK_N,num_warps,num_stages`` (PATHS:
    '+'-joined optional paths, or 'baseline' for none) as ``(label, _Config)``."""
    out = []
    for item in (x.strip() for x in spec.split(";") if x.strip()):
        names, _, tiles = item.partition("@")
        paths = frozenset() if names == "baseline" else frozenset(names.split("+"))
        bad = sorted(paths - set(_common.OPTIONAL_PATHS))
        nums = tuple(int(x) for x in tiles.split(",")) if tiles else ()
        if bad or len(nums) != 4:
            raise SystemExit(f"--configs: {item!r}; expected PATHS@BLOCK_M,BLOCK_N,num_warps,"
                             f"num_stages with PATHS 'baseline' or '+'-joined names of "
                             f"{sorted(_common.OPTIONAL_PATHS)}")
        out.append((f"{names}@{'x'.join(map(str, nums))}", pa.with_paths(pa._Config(*nums),
                                                                          paths)))
    return tuple(out)


def device_line() -> str:
    """The device every table of this process was measured on, with its multiprocessors."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"{props.name} ({props.multi_processor_count} multiprocessors)"


def write_results(rows, copy_tbs, mm_tflops, out: str, echo: bool = True,
                  calls: Optional[list] = None) -> None:
    """``attention.md``, ``attention.json`` and ``attention.png`` in ``out``; the table printed
    when ``echo``; ``calls``: the op-call rows (``attention_calls``), a second table."""
    gpu = device_line()
    header = (f"Date {datetime.date.today()}, GPU {gpu}, torch {torch.__version__}, Triton "
              f"{triton.__version__}, Python {platform.python_version()}; bf16, Hq={HQ}, "
              f"Hkv={HKV}, D={D} unless stated.")
    md = table(rows, copy_tbs, mm_tflops, header)
    if calls:
        from attention_calls import calls_table
        md += "\n\n" + calls_table(calls, f"Op calls, GPU {gpu} (same process): Llama-3.2-1B "
                                           "attention (Hq 32, Hkv 8, D 64), page 16, bf16.")
    if echo:
        print(md, flush=True)
    with open(os.path.join(out, "attention.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(out, "attention.json"), "w") as f:
        json.dump({"device": gpu, "copy_tbs": copy_tbs, "mm_tflops": mm_tflops,
                   "header": header, "rows": [dataclasses.asdict(r) for r in rows],
                   "calls": calls or []}, f, indent=1)
    try:
        plot(rows, copy_tbs, mm_tflops, os.path.join(out, "attention.png"))
    except Exception as e:
        print(f"plot failed: {e}")


def op_calls(report=None, out: str = "") -> list:
    """The op-call rows (``attention_calls.call_rows``), logged; [] when they fail. With a
    ``limits_report.LimitsReport``, then the eager call's host breakdown into it (written to
    ``out``)."""
    print("== op calls (b=1, ctx 1024, D 64, page 16)", flush=True)
    try:
        from attention_calls import call_rows
        found = call_rows()
    except Exception as e:
        print(f"    op calls failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        found = []
    print(f"    {found}", flush=True)
    if report is not None:
        print("== eager call host time: (a) Python, (b) Triton launch, (c) other", flush=True)
        report.guarded("eager call host breakdown", report.eager_call, out)
    return found


# --kernels-table rows whose compiled kernels go into limits.md (MLA decode's op and tile
# configs always): those short of their targets
LIMIT_ROWS = ("prefill 8x4096 causal page 64",)


def new_limits_report(enabled: bool):
    """A ``limits_report.LimitsReport`` for ``--kernels-table`` (None otherwise)."""
    if not enabled:
        return None
    from kernel_limits import device_limits
    from limits_report import LimitsReport
    return LimitsReport(f"GPU {device_line()}", device_limits(torch.cuda.current_device()),
                        "same process as the kernels' table")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="skip the sweeps and slow peers")
    ap.add_argument("--variant", default="all", help=variant_help())
    ap.add_argument("--only", default="", help="comma list of substrings: time only the rows "
                    "whose names contain one (MLA: 'MLA')")
    ap.add_argument("--configs", default="", help="prefill and extend rows: more variant "
                    "columns, ';'-separated PATHS@BLOCK_M,BLOCK_N,num_warps,num_stages (PATHS: "
                    "'baseline' or '+'-joined optional paths), each through the launcher; "
                    "those with tma run last, e.g. 'baseline@128,128,8,2;tma@128,128,8,3'")
    ap.add_argument("--peers", default="", help=f"comma list: only these of {ALL_PEERS} "
                    "(default: each row's own)")
    ap.add_argument("--no-sweeps", action="store_true", help="time no sweep (split counts, "
                    "tiles, chunk lengths; MLA configs): each is a kernel compile, and the quick "
                    "rows carry about 40 of them")
    ap.add_argument("--targeted", action="store_true", help="time only the rows with a "
                    "target (the one-run table: no small-batch rows)")
    ap.add_argument("--kernels-table", action="store_true", help="the kernels' one-run table: MLA "
                    f"decode, {', '.join(TABLE_ROWS)} with their peers, both split schedules "
                    "on the decode rows, and the op-call rows (eager and in a CUDA graph); "
                    "no sweeps or variants (--only still filters)")
    args = ap.parse_args()
    if args.kernels_table:  # its own sweeps only (TABLE_SPLITS, MLA_TABLE_CFGS), no variants
        args.variant = "none"
    only = [x for x in args.only.split(",") if x]
    configs = parse_configs(args.configs)
    keep_peers = [x for x in args.peers.split(",") if x]
    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    copy_tbs, mm_tflops = ceilings()
    print(f"ceilings: copy {copy_tbs:.2f} TB/s, matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    specs = [spec for spec in (table_specs() if args.kernels_table
                               else workloads(args.quick, parse_variants(args.variant)))
             if (not only or any(x in spec["name"] for x in only))
             and not (args.targeted and spec["target"] == "-")]
    for spec in specs:
        if args.no_sweeps:
            spec["sweep"] = ()
        if keep_peers:
            spec["peers"] = tuple(p for p in spec.get("peers", ALL_PEERS) if p in keep_peers)
        if spec["kind"] == "flops" and not args.kernels_table:  # prefill and extend: --configs
            spec["configs"] = tuple(c for c in configs if not c[1].tma)
            spec["late_configs"] = tuple(c for c in configs if c[1].tma)
    report = new_limits_report(args.kernels_table)
    for spec in specs:
        if report is not None and spec["name"] in LIMIT_ROWS:
            spec["limits"] = report
    mla, mla_rows = "MLA decode H128 R512 r64 64x4096", []
    if not only or any(x in mla for x in only):  # first: no peer JIT can cut it
        mla_rows.append(run_mla(mla, ">= 0.50 matmul",
                                sweep=MLA_TABLE_CFGS if args.kernels_table else () if args.no_sweeps
                                else MLA_QUICK_CFGS if args.quick else MLA_CFGS,
                                variants=parse_variants(args.variant), limits=report))
        if report is not None:
            report.write(args.out)
    rows, calls, calls_due = [], [], args.kernels_table
    for spec in specs:  # files rewritten after every row: a run cut short keeps what it timed
        run = {k: v for k, v in spec.items() if k != "late_configs"}
        rows.append(run_attention(**dict(run, variants=tuple(v for v in spec["variants"]
                                                             if v not in LATE_VARIANTS))))
        write_results(rows + mla_rows, copy_tbs, mm_tflops, args.out, False, calls)
        if report is not None:
            report.write(args.out)
        if calls_due and spec["kind"] == "bw" and (
                spec is specs[-1] or specs[specs.index(spec) + 1]["kind"] != "bw"):
            # before prefill (its FlashInfer JIT is long)
            calls, calls_due = op_calls(report, args.out), False
            write_results(rows + mla_rows, copy_tbs, mm_tflops, args.out, False, calls)
    if calls_due:
        calls = op_calls(report, args.out)
    write_results(rows + mla_rows, copy_tbs, mm_tflops, args.out, calls=calls)
    print(f"bench_attention: {time.perf_counter() - start:.0f} s before the late variants",
          flush=True)
    for spec, row in zip(specs, rows):
        late_variants(spec, row)
        write_results(rows + mla_rows, copy_tbs, mm_tflops, args.out, False, calls)
    write_results(rows + mla_rows, copy_tbs, mm_tflops, args.out, calls=calls)
    if report is not None:  # last: its Inductor compile cannot cut the table
        print("== decode step host time (16 layers, b=1, ctx 1024)", flush=True)
        report.guarded("decode step host time", lambda: report.step_host(args.out), args.out)
        print(report.markdown(), flush=True)
    print(f"bench_attention: {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
