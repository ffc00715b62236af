"""Host cost of binding one paged-attention launch: Triton's binder and cache key, plain vs full.

``kernel[grid](...)`` first runs Triton's generated binder over every argument (a
specialisation per runtime argument: dtype and 16-byte alignment of pointers, divisibility of
ints) and forms the kernel-cache key from the result, before the C launcher converts the
arguments again. This measures the first two for the arguments ``paged_attention`` passes on a
decode call, once as launched (the plain form takes ``_paged_attention_plain_kernel``) and once
with the plain form turned off (``_paged_attention_kernel``, every argument), with the binder
built for a CUDA sm_90 target: no GPU is needed, so the figures are this host's, and the C
launcher's share (also per argument) is left out.

    python benchmarks/bench_kernel_binding.py --batch 4 --iters 20000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from xpu_ops.triton import paged_attention as pa  # noqa: E402

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402


def decode_launch(batch: int, hq: int, hkv: int, d: int, page: int, context: int, plain: bool):
    """``(kernel, args, kwargs)`` that ``paged_attention`` launches for a bf16 decode call on
    CPU tensors of these shapes (the launch itself is not run)."""
    pages = -(-context // page)
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16)
    k = torch.randn(batch * pages, page, hkv, d, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    lens = torch.full((batch,), context, dtype=torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    seen = []
    decide = pa._plain_launch if plain else (lambda *a, **kw: False)
    with mock.patch.object(pa, "launch", lambda kernel, grid, device, *a, **kw:
                           seen.append((kernel, a, kw))), \
            mock.patch.object(pa, "_plain_launch", decide):
        pa._launch_params.cache_clear()
        pa.paged_attention(q, k, v, torch.empty_like(q), lens, cu, page_table=table,
                           cu_seqlens_k=None, max_seqlen_q=1, max_kv_len=pages * page, qv=None,
                           q_descale=None, k_descale=None, v_descale=None, sinks=None,
                           softmax_scale=d ** -0.5, window_left=-1, window_right=0,
                           softcap=0.0)
    pa._launch_params.cache_clear()
    return seen[0]


def time_binding(kernel, args, kwargs, iters: int) -> tuple[float, float]:
    """Median microseconds of the binder and of the warm cache-key lookup, over 5 rounds."""
    binder = create_function_from_signature(kernel.signature, kernel.params,
                                            make_backend(GPUTarget("cuda", 90, 32)))
    _, spec, options = binder(*args, **kwargs)
    cache = {(tuple(spec), str(options)): "kernel"}
    rounds_bind, rounds_key = [], []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            binder(*args, **kwargs)
        rounds_bind.append((time.perf_counter() - start) / iters * 1e6)
        start = time.perf_counter()
        for _ in range(iters):
            cache.get((tuple(spec), str(options)))
        rounds_key.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(rounds_bind), statistics.median(rounds_key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20000)
    args = ap.parse_args()
    print("| kernel | runtime args | constexprs + options | binder us | cache key us |")
    print("|---|---:|---:|---:|---:|")
    for plain in (True, False):
        kernel, pos, kw = decode_launch(args.batch, *args.heads, args.head_dim, args.page,
                                        args.context, plain)
        bind, key = time_binding(kernel, pos, kw, args.iters)
        print(f"| {kernel.fn.__name__} | {len(pos)} | {len(kw)} | {bind:.2f} | {key:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
