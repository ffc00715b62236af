"""Host (Python) time of one attention layer call, layer by layer of the call stack.

In piecewise mode every decoder layer's attention runs eagerly between captured graph pieces, so
its host time adds to each decode step unless it stays below the GPU time of a layer. This
script measures, in microseconds per call, the rows

    providers.select       provider resolution of flash_attn_with_kvcache
    op: store_kv_cache     torch.ops.xpu_ops.store_kv_cache (shape checks + dispatch)
    store wrapper          xpu_ops.store_kv_cache (+ argument checks, scale handling)
    op: flash_attn         torch.ops.xpu_ops.flash_attn_with_kvcache
    flash_attn wrapper     xpu_ops.flash_attn_with_kvcache (+ defaults, packing, checks)
    backend.forward        XPUAttentionBackend.forward of one DECODE layer (store + attend)
    split op               torch.ops.xpu_ops.unified_attention_with_output of that layer
                           (dispatcher, its checks, forward context, backend.forward into the
                           op's output)
    attend_into            the split op's body, what a piecewise step's split graph calls per
                           layer (``graph_split.call_split_op_kernel``: no dispatcher, no checks)
    init_forward_metadata  the host metadata of one DECODE step (page table, cu_seqlens, ...)
    step                   what a piecewise step runs on the host besides its pieces:
                           init_forward_metadata, then ``--layers`` layers

Kernels are stubbed by default (``--kernels stub``): the ``fn`` of every registered
implementation of the two ops is swapped for a no-op (the attention stub still allocates its
``[Hq, total_q]`` float32 LSE, as a kernel does), so the rows are pure host time: checks,
provider selection, dispatcher, allocation. ``--kernels bind`` (CPU) runs the ``triton`` provider's own Python (launch parameters, buffers)
and, in place of each launch, Triton's binder and kernel-cache key for a CUDA sm_90 target
(what ``kernel[grid](...)`` computes per argument before the C launcher), so the rows are the
host time of a Triton call without a GPU, the C launcher excepted. ``--clock thread`` times
thread CPU time (``time.thread_time``), which other processes' load on a shared machine does
not inflate. ``--kernels real`` keeps the kernels (on a GPU
launches are asynchronous, so the rows stay host time while the GPU keeps up; on CPU they
include the kernel itself, e.g. Triton's with ``XPU_OPS_PROVIDER=triton TRITON_INTERPRET=1`` on
CPU). Each row is the minimum (or with
``--stat median`` the median) over ``--repeats`` of the mean of ``--iters`` calls, after a
warm-up; the minimum because the machine may be shared. ``--only`` picks rows by substring.

    PYTHONPATH=. python benchmarks/bench_overhead.py                 # CPU, stub kernels
    PYTHONPATH=. python benchmarks/bench_overhead.py --kernels bind --clock thread  # + Triton binder
    PYTHONPATH=. python benchmarks/bench_overhead.py --device cuda   # H200
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time
from types import SimpleNamespace
from typing import Callable

import statistics

import torch

import xpu_ops
from xpu_ops import providers
from compile.graphs import set_forward_context
from compile.backend import PagedAttention
from compile.graphs import split_op as _split_op  # noqa: F401  (registers the split op)
from bench_model import paged_decode_batch  # benchmarks/ is on sys.path when run as a script

OPS = ("flash_attn_with_kvcache", "store_kv_cache")


def _stub_attention(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, out, *args,
                    **kwargs):
    return torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)


def _stub_store(*args, **kwargs) -> None:
    return None


def stub_kernels() -> None:
    """Swap the ``fn`` of every implementation of ``OPS`` for a no-op (this process only)."""
    providers.select(OPS[0], torch.device("cpu"))  # make sure every provider is imported
    stubs = {"flash_attn_with_kvcache": _stub_attention, "store_kv_cache": _stub_store}
    for op, stub in stubs.items():
        impls = providers._registry[op]
        for name, impl in impls.items():
            impls[name] = dataclasses.replace(impl, fn=stub)
    providers.refresh()


class _Binders:
    """``launch(kernel, grid, device, *args, **kwargs)`` stand-in for ``--kernels bind``: Triton's
    generated binder for a CUDA sm_90 target over the launch's arguments, then the kernel-cache
    key as ``JITFunction.run`` forms it (one binder per kernel, built on first use)."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import compute_cache_key
        self.backend = make_backend(GPUTarget("cuda", 90, 32))
        self.cache_key = compute_cache_key
        self.binders: dict = {}  # id(kernel) -> binder (a JITFunction's own hash reads its source)
        self.keys: dict = {}

    def __call__(self, kernel, grid, device, *args, **kwargs) -> None:
        binder = self.binders.get(id(kernel))
        if binder is None:
            from triton.runtime.jit import create_function_from_signature
            binder = self.binders[id(kernel)] = create_function_from_signature(
                kernel.signature, kernel.params, self.backend)
        _, specialization, options = binder(*args, **kwargs)
        self.cache_key(self.keys, specialization, options)


def bind_kernels() -> None:
    """Route both ops to the ``triton`` provider on the CPU and replace its launches with
    ``_Binders`` (this process only)."""
    import os
    from xpu_ops.triton import kv_cache as tkv, paged_attention as tpa  # compiled kernels
    os.environ["TRITON_INTERPRET"] = "1"  # (read at decoration: after the import)
    os.environ["XPU_OPS_PROVIDER"] = "triton"
    providers.refresh()
    binders = _Binders()
    tkv.launch = tpa.launch = binders


def decode_setup(args) -> SimpleNamespace:
    """Pool, backend, one layer and a DECODE batch of ``args.batch`` requests (small shapes)."""
    device, dtype, b = torch.device(args.device), args.dtype, args.batch
    hq, hkv, d = 8, 2, 64
    fb = paged_decode_batch(b, args.context, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                            num_layers=1, dtype=dtype, device=device)
    backend, kv = fb.attn_backend, fb.token_to_kv_pool
    backend.init_forward_metadata(fb)
    layer = PagedAttention(hq, d, d ** -0.5, hkv, layer_id=0).to(device)
    q = torch.randn(b, hq * d, dtype=dtype, device=device)
    k = torch.randn(b, hkv, d, dtype=dtype, device=device)
    v = torch.randn(b, hkv, d, dtype=dtype, device=device)
    meta = backend.forward_metadata.main
    k_cache, v_cache = kv.get_paged_kv(0)
    return SimpleNamespace(backend=backend, fb=fb, layer=layer, q=q, k=k, v=v, meta=meta,
                           kv=kv, k_cache=k_cache, v_cache=v_cache, q3=q.view(b, hq, d),
                           out=torch.empty(b, hq, d, dtype=dtype, device=device),
                           k2=k.view(b, hkv * d), v2=v.view(b, hkv * d),
                           split_out=torch.empty(b, hq * d, dtype=dtype, device=device),
                           loc=fb.out_cache_loc)


def cases(s: SimpleNamespace, layers: int = 16) -> dict[str, Callable[[], object]]:
    """Name -> zero-argument call, one per row of the table (``layers``: of the step row)."""
    m, kbuf, vbuf = s.meta, *s.kv.get_kv_buffer(0)
    attn_args = (s.q3, s.k_cache, s.v_cache, m.cache_seqlens, m.page_table, m.cu_seqlens_q,
                 s.out, None, None, None, None, None, None, None)
    attn_kwargs = dict(max_seqlen_q=m.max_seqlen_q, softmax_scale=s.layer.scaling, causal=True,
                       window_size_left=-1, window_size_right=0, softcap=0.0, num_splits=0,
                       return_softmax_lse=False)
    op_attn, op_store = torch.ops.xpu_ops.flash_attn_with_kvcache, torch.ops.xpu_ops.store_kv_cache
    split_op = torch.ops.xpu_ops.unified_attention_with_output

    def step():
        s.backend.init_forward_metadata(s.fb)
        for _ in range(layers):
            s.backend.forward(s.q, s.k, s.v, s.layer, s.fb)
    return {
        "providers.select": lambda: providers.select(OPS[0], s.q3.device, *attn_args,
                                                     **attn_kwargs),
        "op: store_kv_cache": lambda: op_store(kbuf, vbuf, s.loc, s.k, s.v, None, None),
        "store wrapper": lambda: xpu_ops.store_kv_cache(kbuf, vbuf, s.loc, s.k, s.v),
        "op: flash_attn_with_kvcache": lambda: op_attn(*attn_args, **attn_kwargs),
        "flash_attn wrapper": lambda: xpu_ops.flash_attn_with_kvcache(
            s.q3, s.k_cache, s.v_cache, cache_seqlens=m.cache_seqlens, page_table=m.page_table,
            cu_seqlens_q=m.cu_seqlens_q, max_seqlen_q=m.max_seqlen_q,
            softmax_scale=s.layer.scaling, causal=True, out=s.out),
        "backend.forward (1 layer)": lambda: s.backend.forward(s.q, s.k, s.v, s.layer, s.fb),
        "split op (1 layer)": lambda: split_op(s.q, s.k2, s.v2, s.split_out, 0),
        "attend_into (1 layer)": lambda: _split_op.attend_into(s.q, s.k2, s.v2, s.split_out, 0),
        "init_forward_metadata": lambda: s.backend.init_forward_metadata(s.fb),
        f"step: init_forward_metadata + {layers} layers": step,
    }


def time_us(fn: Callable[[], object], device: torch.device, iters: int, repeats: int,
            stat: Callable[[list[float]], float] = min,
            clock: Callable[[], int] = time.perf_counter_ns) -> float:
    """``stat`` (default: the minimum) over ``repeats`` of the mean host microseconds of
    ``iters`` calls, by ``clock`` (nanoseconds)."""
    for _ in range(max(iters // 10, 5)):
        fn()
    means = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = clock()
        for _ in range(iters):
            fn()
        means.append((clock() - t0) / iters / 1e3)
    return stat(means)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (CPU)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--kernels", choices=("stub", "bind", "real"), default="stub")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--grad", action="store_true", help="run outside torch.inference_mode")
    p.add_argument("--layers", type=int, default=16, help="layers of the step row")
    p.add_argument("--stat", choices=("min", "median"), default="min")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="wall: perf_counter; thread: this thread's CPU time")
    p.add_argument("--only", nargs="*", default=None, help="rows whose name contains one of these")
    args = p.parse_args()
    device = torch.device(args.device)
    args.dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    if args.kernels == "stub":
        stub_kernels()
    elif args.kernels == "bind":
        bind_kernels()
    clock = time.perf_counter_ns if args.clock == "wall" else time.thread_time_ns
    ctx = torch.no_grad() if args.grad else torch.inference_mode()
    with ctx:
        setup = decode_setup(args)
        calls = cases(setup, args.layers)
        impl = calls["providers.select"]()
        stat = min if args.stat == "min" else statistics.median
        wanted = [name for name in calls
                  if args.only is None or any(part in name for part in args.only)]
        with set_forward_context({0: setup.layer}, setup.fb, num_tokens=args.batch):
            rows = [(name, time_us(calls[name], device, args.iters, args.repeats, stat,
                                         clock))
                    for name in wanted]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(f"# bench_overhead: {gpu or device.type}, torch {torch.__version__}, "
          f"provider {impl.provider}, kernels {args.kernels}, b={args.batch}, "
          f"context {args.context}, {args.dtype}, {args.stat} of {args.repeats}, "
          f"{args.clock} clock")
    print("| call | host us/call |\n|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
