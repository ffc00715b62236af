"""Host time of one Triton launch: ``JITFunction.run`` vs ``BoundLaunch``'s re-launch path.

    PYTHONPATH=. python benchmarks/bench_launch.py            # on a CUDA/XPU machine

Times, in microseconds of host time per call (minimum over repeats of the mean of ``--iters``
calls, after a warm-up; the GPU work is queued asynchronously and synchronised once per repeat),
a decode-shaped call of the two per-layer kernels of the ``triton`` provider:

    paged_attention     split-KV attention, splits merged in-kernel (one launch; the split
                        counters preallocated), batch 1, Hq 32, Hkv 8, D 64
    store_kv_cache      one launch writing K and V of one token

with ``XPU_OPS_TRITON_FAST_LAUNCH=0`` (every launch through ``kernel[grid](...)``) and with the
default (``BoundLaunch`` re-launches the compiled kernel), and says whether the fast path held a
compiled kernel (``CompiledKernel``) after the first call.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from xpu_ops.triton import kv_cache, paged_attention as pa


def _time(fn, iters: int, repeats: int, device) -> float:
    for _ in range(10):
        fn()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e6


def main(argv=None) -> None:
    """Parse ``argv``, time both paths, print a table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    hq, hkv, d, pages, page = 32, 8, 64, 128, 16
    q = torch.randn(1, hq, d, device=device, dtype=torch.bfloat16)
    kc = torch.randn(pages, page, hkv, d, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    out = torch.empty_like(q)
    lens = torch.tensor([1000], dtype=torch.int32, device=device)
    table = torch.arange(pages, dtype=torch.int32, device=device)[None]
    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    loc = torch.tensor([999], dtype=torch.int64, device=device)
    k_new = torch.randn(1, hkv, d, device=device, dtype=torch.bfloat16)
    counters = torch.zeros(hkv, dtype=torch.int32, device=device)  # b * Hkv * 1 m-block

    def attention():
        pa.paged_attention(q, kc, vc, out, lens, cu, page_table=table, cu_seqlens_k=None,
                           max_seqlen_q=1, max_kv_len=pages * page, qv=None, q_descale=None,
                           k_descale=None, v_descale=None, sinks=None, softmax_scale=0.125,
                           window_left=-1, window_right=0, softcap=0.0, counters=counters)

    def store():
        kv_cache.store_kv_cache(kc, vc, loc, k_new, k_new, None, None)

    print(f"# bench_launch: {torch.cuda.get_device_name(device) if device.type == 'cuda' else device}")
    print("| call | JITFunction.run us | BoundLaunch us |\n|---|---:|---:|")
    for name, fn in (("paged_attention (1 launch)", attention), ("store_kv_cache", store)):
        # The flag is read when a launch is created: drop the cached launches around each switch.
        os.environ["XPU_OPS_TRITON_FAST_LAUNCH"] = "0"
        _forget_launches()
        slow = _time(fn, args.iters, args.repeats, device)
        os.environ.pop("XPU_OPS_TRITON_FAST_LAUNCH")
        _forget_launches()
        fast = _time(fn, args.iters, args.repeats, device)
        print(f"| {name} | {slow:.1f} | {fast:.1f} |")
    from xpu_ops.triton import launcher
    held = [type(c).__name__ for launch_ in _bound_launches() for c in launch_._compiled.values()]
    print(f"compiled kernels held by BoundLaunch objects: {held}; fast launch enabled: "
          f"{launcher.fast_launch_enabled()}; launch hooks installed: "
          f"{launcher._hooks_installed()}")


def _forget_launches() -> None:
    pa._launch_plan.cache_clear()
    kv_cache._store_kv_launch.cache_clear()


def _bound_launches():
    """Every BoundLaunch created so far by the two providers' shape caches."""
    import gc
    from xpu_ops.triton.launcher import BoundLaunch
    return [o for o in gc.get_objects() if isinstance(o, BoundLaunch)]


if __name__ == "__main__":
    main()
