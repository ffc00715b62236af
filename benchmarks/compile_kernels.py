"""Compile the paged-attention kernel's launch shapes for a GPU target without a GPU.

For each workload of ``bench_attention.py`` and each kernel path (``baseline`` and
``xpu_ops.triton._common.OPTIONAL_PATHS``), this builds the launch exactly as ``paged_attention``
would on a CUDA device (tiles, splits, constexprs; the device's multiprocessor count and
capability are given on the command line), compiles it with ``triton.compile`` for
``--arch`` (default sm_90) and reports registers, spills and shared memory from ``cuobjdump``. A
compile error is printed and counted, so a path that cannot compile is known before GPU time is
spent on it. The installed Triton compiles (the GPU machine's may be older); spills and shared
memory are facts of this compiler's output, not measurements of speed.

    python benchmarks/compile_kernels.py --arch 90 --sms 132
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from xpu_ops.triton import _common  # noqa: E402
from xpu_ops.triton import paged_attention as pa  # noqa: E402

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
         torch.int32: "*i32", torch.float8_e4m3fn: "*fp8e4nv", torch.uint8: "*u8"}


def workloads():
    """(name, q_lens, k_lens, page, Hq, Hkv, D, Dv, kv dtype, causal, window, MLA) of each launch
    to compile: the benchmark's shapes, shortened (compilation depends on shapes only through
    the constexprs)."""
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    return [
        ("decode page 1", [1] * 64, [4096] * 64, 1, 32, 8, 128, 128, bf16, False, -1, False),
        ("decode b1 16k page 64", [1], [16384], 64, 32, 8, 128, 128, bf16, False, -1, False),
        ("decode page 16", [1] * 64, [4096] * 64, 16, 32, 8, 128, 128, bf16, False, -1, False),
        ("decode b64 1k page 16", [1] * 64, [1000] * 64, 16, 32, 8, 128, 128, bf16, False, -1,
         False),
        ("decode b1 1k page 16 D64", [1], [1024], 16, 32, 8, 64, 64, bf16, True, -1, False),
        ("decode page 64", [1] * 64, [4096] * 64, 64, 32, 8, 128, 128, bf16, False, -1, False),
        ("decode page 128", [1] * 64, [4096] * 64, 128, 32, 8, 128, 128, bf16, False, -1, False),
        ("decode fp8 page 64", [1] * 64, [4096] * 64, 64, 32, 8, 128, 128, fp8, False, -1, False),
        ("prefill page 64", [4096] * 8, [4096] * 8, 64, 32, 8, 128, 128, bf16, True, -1, False),
        ("prefill window", [4096] * 8, [4096] * 8, 64, 32, 8, 128, 128, bf16, True, 1023, False),
        ("extend page 64", [512] * 8, [4608] * 8, 64, 32, 8, 128, 128, bf16, True, -1, False),
        ("MLA decode", [1] * 64, [4096] * 64, 64, 128, 1, 64, 512, bf16, False, -1, True),
    ]


def launch_args(case, paths, sms, tiles=None):
    """The kernel's positional tensors (meta tensors) and ``_LaunchParams`` of ``case``, with the
    default tiles or ``tiles`` (``(BLOCK_M, BLOCK_N, num_warps, num_stages)``)."""
    name, q_lens, k_lens, page, hq, hkv, d, dv, kv_dtype, causal, window, mla = case
    meta = torch.device("meta")
    b, total_q = len(q_lens), sum(q_lens)
    pages = max(k_lens) // page + 1
    q = torch.empty(total_q, hq, d, dtype=torch.bfloat16, device=meta)
    if mla:
        kv = torch.empty(b * pages, page, dv + d, dtype=kv_dtype, device=meta)
        k, v, qv = kv[:, :, None, dv:], kv[:, :, None, :dv], torch.empty(total_q, hq, dv,
                                                                          dtype=q.dtype,
                                                                          device=meta)
    else:
        k = torch.empty(b * pages, page, hkv, d, dtype=kv_dtype, device=meta)
        v = torch.empty(b * pages, page, hkv, dv, dtype=kv_dtype, device=meta)
        qv = None
    out = torch.empty(total_q, hq, dv, dtype=q.dtype, device=meta)
    table = torch.empty(b, pages, dtype=torch.int32, device=meta)
    lens = torch.empty(b, dtype=torch.int32, device=meta)
    descale = torch.empty(b, hkv, dtype=torch.float32, device=meta) if kv_dtype != q.dtype else None
    if tiles:
        config = pa.with_paths(pa._Config(*tiles), paths)
    else:
        with mock.patch.object(pa, "num_sms", lambda device: sms):
            config = pa._pick_config(torch.device("cuda"), max(q_lens) * (hq // hkv),
                                     max(16, pa.next_pow2(d)), max(16, pa.next_pow2(dv)), 2,
                                     paths, page, kv_programs=b * hkv)
    with mock.patch.object(pa, "num_sms", lambda device: sms):
        params = pa._launch_params(
            torch.device("cuda"), q.shape, q.stride(), q.dtype, k.shape, k.stride(), v.shape,
            v.stride(), out.stride(), None if qv is None else qv.stride(), table.stride(), True,
            b, max(q_lens), pages * page,
            (qv is not None, False, descale is not None, descale is not None, False, False,
             False, False), 1 / d ** 0.5, 0.0, window, 0 if causal else -1,
            8 if mla else None, config, None, total_q,
            pa._metadata_strides(lens, lens, None, table, None, None, descale, descale, None,
                                 None, None),
            (2, k.element_size(), 2, True))
    dummy = torch.empty(1, dtype=torch.float32, device=meta)
    counters = torch.empty(1, dtype=torch.int32, device=meta)
    if params.plain:  # as a decode layer launches it: LSE, scratch, counters None at one split
        split = params.num_splits > 1
        return [q, k, v, out, dummy if split else None, dummy if split else None, counters if split else None,
                lens, table, lens], params
    tensors = [q, k, v, q if qv is None else qv, out, dummy, dummy, dummy, counters, lens, table,
               lens, lens, dummy, descale if descale is not None else dummy,
               descale if descale is not None else dummy, dummy, dummy, dummy, dummy]
    return tensors, params


def compile_one(case, paths, arch, sms, tiles=None):
    """Compile one launch; returns (constexpr summary, resource usage)."""
    tensors, params = launch_args(case, paths, sms, tiles)
    kernel = pa._paged_attention_plain_kernel if params.plain else pa._paged_attention_kernel
    names = kernel.arg_names
    options = {k: params.meta[k] for k in ("num_warps", "num_stages")}
    constexprs = {k: v for k, v in params.meta.items() if k not in options}
    values = [*tensors, *params.scalars]
    signature = {}
    for n, val in zip(names, values):
        if val is None:  # a constexpr None, as Triton's binder specialises it
            signature[n] = "constexpr"
            constexprs[n] = None
        elif isinstance(val, torch.Tensor):
            signature[n] = TYPES[val.dtype]
        elif isinstance(val, float):
            signature[n] = "fp32"
        else:
            signature[n] = "i32"
    for n in constexprs:
        signature[n] = "constexpr"
    # what a launch specialises on: 16-byte aligned pointers, ints divisible by 16
    # (not the arguments the kernel is declared not to specialise on)
    attrs = {(i,): [["tt.divisibility", 16]] for i, val in enumerate(values)
             if isinstance(val, torch.Tensor) or (isinstance(val, int) and val % 16 == 0
                                                  and val != 0
                                                  and names[i] not in kernel.do_not_specialize)}
    src = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    summary = ", ".join(f"{k}={params.meta.get(k, '-')}" for k in (
        "BLOCK_M", "BLOCK_N", "NUM_SPLITS", "PAGE_TILES", "PHASES", "TMA", "WS", "DV_SPLIT",
        "num_warps")) + (", plain kernel" if params.plain else "")
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    return summary, (f"{resources(compiled.asm['cubin'])}, dynamic shared "
                     f"{compiled.metadata.shared // 1024} KiB")


def resources(cubin: bytes) -> str:
    """Registers per thread (``REG``) and stack bytes (``STACK``: spills) of a cubin
    (``cuobjdump``); its static shared memory is not what Triton uses (dynamic)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                              text=True).stdout
    fields = dict(re.findall(r"(REG|STACK):(\d+)", text))
    return ", ".join(f"{k}={v}" for k, v in fields.items())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    ap.add_argument("--sms", type=int, default=132, help="multiprocessors (split planning)")
    ap.add_argument("--only", default="", help="comma list of workload name substrings")
    ap.add_argument("--tiles", default="", help="BLOCK_M,BLOCK_N,num_warps,num_stages instead "
                    "of the default tiles")
    ap.add_argument("--variant", default="", help="comma list of paths, each '+'-joined names "
                    "(default: baseline and each optional path alone)")
    args = ap.parse_args()
    tiles = tuple(int(x) for x in args.tiles.split(",")) if args.tiles else None
    variants = args.variant.split(",") if args.variant else ("baseline", *_common.OPTIONAL_PATHS)
    only = [s for s in args.only.split(",") if s]
    failed = 0
    with mock.patch.object(pa, "descriptors_supported", lambda *a: args.arch >= 90):
        for case in workloads():
            if only and not any(s in case[0] for s in only):
                continue
            for variant in variants:
                paths = frozenset() if variant == "baseline" else frozenset(variant.split("+"))
                try:
                    summary, usage = compile_one(case, paths, args.arch, args.sms, tiles)
                    print(f"{case[0]:20s} {variant:11s} ok   {usage:40s} {summary}", flush=True)
                except Exception as e:  # report and go on: the point is to list them all
                    failed += 1
                    msg = str(e).strip().splitlines()
                    print(f"{case[0]:20s} {variant:11s} FAIL {type(e).__name__}: "
                          f"{' | '.join(msg[-3:])[:400]}", flush=True)
    print(f"compile_kernels: {failed} launch(es) failed to compile")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
