"""The FlashMLA surface at DeepSeek-V3.2's sizes (128 heads, D = 576, Dv = 512, page 64,
top-2048): time per call of each provider, as a fraction of the device's ceilings measured in
this run.

Cases (``--cases``):
  ``sparse_decode``   ``flash_mla_with_kvcache`` with ``indices`` over fp8 pages (656-byte
                      tokens), ``b`` requests of one query token: bound by reading the selected
                      tokens, ``b * topk * 656`` bytes; ``2 * b * H * topk * (D + Dv)`` FLOPs
  ``dense_mtp``       dense bf16 pages, two causal query tokens per request (MTP verify) over
                      ``context`` keys: ``b * context * D * 2`` bytes
  ``sparse_prefill``  ``flash_mla_sparse_fwd`` of ``b`` tokens with top-2048 each over a bf16
                      ``kv`` of ``context`` rows: ``2 * b * H * topk * (D + Dv)`` FLOPs
Ceilings: device copy bandwidth and a bf16 matmul's TFLOP/s (``bench_dsa_indexer``'s), measured
first. Peers: every provider that runs on the device (``reference``, ``triton``, ``sgl_kernel``
where installed); FlashMLA itself is not a dependency and is not timed.

    python benchmarks/bench_flash_mla.py --device cuda --out $OUT/flash_mla
    python benchmarks/bench_flash_mla.py --device cpu --quick            # CPU check: tiny shapes
"""

from __future__ import annotations

import torch

import xpu_ops
from xpu_ops import providers
from xpu_ops.mla_fp8_layout import fp8_token_bytes, quantize_fp8_tokens
from bench_dsa_indexer import case_main, matmul_tflops, time_call
from decode_roofline import copy_bandwidth

HEADS, DIM, DIM_V, PAGE, TOPK = 128, 576, 512, 64, 2048
FULL = {"sparse_decode": [(1, 32768), (32, 32768), (128, 32768)],
        "dense_mtp": [(32, 4096), (128, 4096)],
        "sparse_prefill": [(1024, 8192), (4096, 16384)]}
QUICK = {"sparse_decode": [(2, 256)], "dense_mtp": [(2, 128)], "sparse_prefill": [(4, 256)]}


def _flops(rows, topk):
    return 2 * rows * HEADS * topk * (DIM + DIM_V)


def _sparse_decode(device, b, context):
    """b requests, each a ``context``-token slice of an fp8 cache, top-k slots per token."""
    pages = b * -(-context // PAGE)
    cache = quantize_fp8_tokens(torch.randn(pages, PAGE, 1, DIM, device=device) / 4, DIM_V)
    topk = min(TOPK, context)
    base = torch.arange(b, device=device)[:, None, None] * (pages // b * PAGE)
    indices = (base + torch.randint(0, context, (b, 1, topk), device=device)).to(torch.int32)
    q = (torch.randn(b, 1, HEADS, DIM, device=device) / 4).to(torch.bfloat16)
    call = lambda: xpu_ops.flash_mla_with_kvcache(q, cache, None, None, DIM_V,  # noqa: E731
                                                  indices=indices, is_fp8_kvcache=True)
    return call, b * topk * fp8_token_bytes(DIM, DIM_V), _flops(b, topk)


def _dense_mtp(device, b, context):
    width = -(-context // PAGE)
    cache = (torch.randn(b * width, PAGE, 1, DIM, device=device) / 4).to(torch.bfloat16)
    table = torch.randperm(b * width, device=device).to(torch.int32).view(b, width)
    lens = torch.full((b,), context, dtype=torch.int32, device=device)
    q = (torch.randn(b, 2, HEADS, DIM, device=device) / 4).to(torch.bfloat16)
    call = lambda: xpu_ops.flash_mla_with_kvcache(q, cache, table, lens, DIM_V,  # noqa: E731
                                                  causal=True)
    return call, b * context * DIM * 2, 2 * 2 * b * HEADS * context * (DIM + DIM_V)


def _sparse_prefill(device, b, context):
    kv = (torch.randn(context, 1, DIM, device=device) / 4).to(torch.bfloat16)
    topk = min(TOPK, context)
    indices = torch.randint(0, context, (b, 1, topk), device=device).to(torch.int32)
    q = (torch.randn(b, HEADS, DIM, device=device) / 4).to(torch.bfloat16)
    call = lambda: xpu_ops.flash_mla_sparse_fwd(q, kv, indices, DIM ** -0.5)  # noqa: E731
    return call, b * topk * DIM * 2, _flops(b, topk)


INPUTS = {"sparse_decode": _sparse_decode, "dense_mtp": _dense_mtp,
          "sparse_prefill": _sparse_prefill}
OPS = {"sparse_decode": "flash_mla_with_kvcache", "dense_mtp": "flash_mla_with_kvcache",
       "sparse_prefill": "flash_mla_sparse_fwd"}


def run(device, cases, sizes, reps) -> list[dict]:
    """One row per (case, size, provider): ms, GB/s and TFLOP/s with their fractions of the
    ceilings (first row)."""
    bandwidth = copy_bandwidth(device, 1 << 28 if device.type != "cpu" else 1 << 22)
    peak = matmul_tflops(device, 8192 if device.type != "cpu" else 512)
    rows = []
    for case in cases:
        for b, context in sizes[case]:
            fn, nbytes, flops = INPUTS[case](device, b, context)
            for name, reason in providers.candidates(OPS[case], device.type):
                row = dict(case=case, b=b, context=context, provider=name)
                if reason is not None:
                    rows.append(dict(row, skipped=reason))
                    continue
                with xpu_ops.use_provider(name):
                    try:
                        seconds = time_call(fn, device, reps)
                    except NotImplementedError as declined:      # the provider declines it
                        rows.append(dict(row, skipped=str(declined)))
                        continue
                rows.append(dict(row, ms=seconds * 1e3, gbps=nbytes / seconds / 1e9,
                                 bw_fraction=nbytes / seconds / bandwidth,
                                 tflops=flops / seconds / 1e12,
                                 flop_fraction=flops / seconds / 1e12 / peak))
    return [dict(copy_gbps=bandwidth / 1e9, matmul_tflops=peak)] + rows


def main(argv=None) -> None:
    case_main(__doc__, INPUTS, run, QUICK, FULL, argv)


if __name__ == "__main__":
    main()
