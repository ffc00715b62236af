"""Compile the DSA indexer's Triton kernels for a GPU target without a GPU.

Each kernel of ``xpu_ops/triton/dsa_indexer.py``, ``dsa_topk.py`` and ``dsa_index_cache.py``, and
the sparse FlashMLA decode kernel (``flash_mla.py``, one split and four with the fused merge), is
compiled with ``triton.compile`` for ``--arch`` (default sm_90) at DeepSeek-V3.2's constexprs
(64 heads, D = 128, block 64), each constexpr branch once, and its registers, spills
(``cuobjdump``) and dynamic shared memory are printed. A compile error is printed and counted
(exit status 1), so a kernel that cannot compile is known before GPU time is spent on it.

    python benchmarks/compile_dsa_kernels.py --arch 90
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from xpu_ops.triton import dsa_index_cache, dsa_indexer, dsa_topk, flash_mla  # noqa: E402
from compile_kernels import resources  # noqa: E402

_LOGITS = dict(Q="*fp8e4nv", K="*fp8e4nv", K_SCALE="*fp32", W="*fp32", KS="*i32", KE="*i32",
               OUT="*fp32")
_PAGED = dict(Q="*fp8e4nv", VALUES="*fp8e4nv", SCALES="*fp32", W="*fp32", CTX="*i32",
              TABLE="*i32", OUT="*fp32")
_TOPK = dict(SCORE="*fp32", LENGTHS="*i32", STARTS="*i32", REQUEST="*i64", TABLE="*i32",
             OUT="*i32")
_MLA = dict(Q="*bf16", K="*bf16", SLOTS="*i32", TOPK_LEN="*i32", K2="*bf16", SLOTS2="*i32",
            TOPK_LEN2="*i32", SEQLENS="*i32", SINK="*fp32", OUT="*bf16", LSE="*fp32",
            MAXL="*fp32", PART_O="*fp32", PART_ML="*fp32", COUNTERS="*i32", scale="fp32")
# DeepSeek-V3.2's sparse decode: 576 = 512 latent + 64 rope, 16 heads a program, top-k lengths
_MLA_CONSTEXPRS = dict(HEAD_DIM=576, HEAD_DIM_V=512, ROPE_OFF=0, BLOCK_H=16, BLOCK_N=16,
                       BLOCK_DV=512, BLOCK_DR=64, DENSE=False, CAUSAL=False, IS_FP8=False,
                       ALIGNED=True, HAS_LEN=True, HAS_EXTRA=False, HAS_LEN2=False,
                       HAS_SINK=False, STORE_MAX=False, PRECISION=None, UPCAST=False)
# (name, kernel, pointer and float argument types (others: i32), constexprs[, num_warps: 4])
CASES = [
    ("fp8_mqa_logits", dsa_indexer._mqa_logits_kernel, _LOGITS,
     dict(BLOCK_M=4, BLOCK_N=64, BLOCK_H=64, BLOCK_D=128, COMPRESSED=False)),
    ("fp8_mqa_logits compressed", dsa_indexer._mqa_logits_kernel, _LOGITS,
     dict(BLOCK_M=4, BLOCK_N=64, BLOCK_H=64, BLOCK_D=128, COMPRESSED=True)),
    ("fp8_paged_mqa_logits", dsa_indexer._paged_mqa_logits_kernel, _PAGED,
     dict(BLOCK_SIZE=64, BLOCK_N=64, BLOCK_H=64, BLOCK_D=128, CTX_2D=False),
     dsa_indexer.PAGED_WARPS),
    ("fp8_paged_mqa_logits 2-D lens", dsa_indexer._paged_mqa_logits_kernel, _PAGED,
     dict(BLOCK_SIZE=64, BLOCK_N=64, BLOCK_H=64, BLOCK_D=128, CTX_2D=True),
     dsa_indexer.PAGED_WARPS),
    ("fast_topk", dsa_topk._topk_kernel, _TOPK,
     dict(BLOCK=1024, RADIX_BLOCK=2048, HAS_STARTS=False, TRANSFORM=False), dsa_topk.TOPK_WARPS),
    ("fast_topk_transform ragged", dsa_topk._topk_kernel, _TOPK,
     dict(BLOCK=1024, RADIX_BLOCK=2048, HAS_STARTS=True, TRANSFORM=True), dsa_topk.TOPK_WARPS),
    ("store_index_k_cache", dsa_index_cache._store_index_k_kernel,
     dict(K="*bf16", LOC="*i64", VALUES="*u8", SCALES="*fp32"),
     dict(BLOCK_SIZE=64, BLOCK_D=128, UE8M0=False)),
    ("store_index_k_cache ue8m0", dsa_index_cache._store_index_k_kernel,
     dict(K="*fp32", LOC="*i32", VALUES="*u8", SCALES="*fp32"),
     dict(BLOCK_SIZE=64, BLOCK_D=128, UE8M0=True)),
    ("hadamard_transform bf16", dsa_index_cache._hadamard_kernel,
     dict(X="*bf16", OUT="*bf16", scale="fp32"),
     dict(N=128, BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, IEEE=False)),
    ("hadamard_transform fp32", dsa_index_cache._hadamard_kernel,
     dict(X="*fp32", OUT="*fp32", scale="fp32"),
     dict(N=128, BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, IEEE=True)),
    *[(f"flash_mla sparse decode, {splits} split(s)", flash_mla._flash_mla_kernel, _MLA,
       dict(_MLA_CONSTEXPRS, NUM_SPLITS=splits), 8) for splits in (1, 4)],
]


def compile_case(kernel, types: dict, constexprs: dict, arch: int, num_warps: int = 4):
    """``triton.compile`` of ``kernel`` for ``sm_<arch>``; arguments not in ``types`` are
    int32 scalars."""
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=signature, attrs={},
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--only", default=None, help="compile the cases whose name has this")
    args = parser.parse_args(argv)
    failed = 0
    for name, kernel, types, constexprs, *warps in CASES:
        if args.only and args.only not in name:
            continue
        try:
            compiled = compile_case(kernel, types, constexprs, args.arch, *warps)
        except Exception as exc:  # report every kernel, then fail
            failed += 1
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:2000]}")
            continue
        print(f"{name}: {resources(compiled.asm['cubin'])}, dynamic shared "
              f"{compiled.metadata.shared // 1024} KiB")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
