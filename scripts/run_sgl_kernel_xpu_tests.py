"""Run sgl-kernel-xpu's attention tests on xpu-ops (device plumbing adapted, nothing else) and
count results per file and function.

The files of ``XPU_FILES`` (sgl-kernel-xpu main's attention, DSA-indexer, GDN and causal-conv1d
tests, saved under ``<peer>/sgl-kernel-xpu/tests/`` by ``scripts/prepare_peer.py``, never
committed) are plumbed to the local device by ``scripts/plumb_xpu_tests.py`` into
``<peer>/generated/`` (``"xpu"`` -> CUDA or CPU, ``torch.xpu.*`` -> ``scripts/local_device.py``)
and run with ``import sgl_kernel`` resolving to xpu-ops (``-p sgl_kernel_shim``). One job per file
(``--list``); the largest are split into shards (``SHARDS``) so each job fits a 10-minute GPU
call. Without CUDA the jobs run on the CPU (``client_test_runs.CPU_ENV``: the reference provider,
the tests' own Triton kernels interpreted); pass ``-- -k EXPR`` to sample a large file there.

Writes under ``--out`` (default ``$OUT``) each job's log and outcomes, and
``sgl_kernel_xpu_tests.json`` / ``.md`` (per job, file and function; see ``client_test_runs``).

    python scripts/run_sgl_kernel_xpu_tests.py --list
    python scripts/run_sgl_kernel_xpu_tests.py --jobs merge_state,store_cache_xpu -n 4
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import client_test_runs as runs  # noqa: E402
import plumb_xpu_tests  # noqa: E402

#: sgl-kernel-xpu's test files this runner runs (attention, MLA, merges, stores, DSA indexer,
#: the fused GDN layer and its workspace, the channel-first causal conv1d).
XPU_FILES = ("test_flash_attention.py", "test_flash_attention_4.py", "test_flash_attn_sparse.py",
             "test_flash_mla_decode.py", "test_flash_mla_prefill.py",
             "test_flash_mla_sparse_fwd.py", "test_flash_mla_with_kvcache.py", "test_flashmla.py",
             "test_merge_state.py", "test_merge_state_v2.py", "test_store_cache_xpu.py",
             "test_fp8_mqa_logits.py", "test_fp8_paged_mqa_logits.py", "test_hadamard.py",
             "test_topk_transform.py", "test_rotary_embedding.py", "test_gdn_attention.py",
             "test_gdn_attention_workspace.py", "test_gdn_attention_wrapper.py",
             "test_causal_conv1d.py")
#: Files split into this many shards (the rest run whole), so that each job is about 600 to
#: 1,100 worker-seconds on an H100 and two fit one lane of a ``scripts/gpu_client_tests.sh`` part
#: (test counts at sgl-kernel-xpu 9cf16bf, ``--collect``: flash_attention 11793, flash_mla_decode
#: 1152, topk_transform 688, flash_attn_sparse 676, flashmla 644 (about 5.5 s of one worker per
#: test on an H100), flash_mla_prefill 352, flash_attention_4 336).
SHARDS = {"test_flash_attention.py": 32, "test_flash_attention_4.py": 2, "test_flashmla.py": 6,
          "test_flash_mla_decode.py": 6, "test_flash_mla_prefill.py": 2,
          "test_topk_transform.py": 2, "test_flash_attn_sparse.py": 2}


def job_name(file: str) -> str:
    return file.removeprefix("test_").removesuffix(".py")


def jobs(peer: pathlib.Path) -> list[runs.Job]:
    src = peer / "sgl-kernel-xpu" / "tests"
    if not src.is_dir():
        sys.exit(f"run_sgl_kernel_xpu_tests: {src} is missing; run scripts/prepare_peer.py")
    dst = peer / "generated" / "sgl-kernel-xpu" / "tests"
    plumb_xpu_tests.plumb_folder(src, dst, verbose=False)
    result = []
    for name in XPU_FILES:
        if (dst / name).exists():
            result += runs.sharded(job_name(name), [dst / name], SHARDS.get(name, 1))
        else:
            print(f"run_sgl_kernel_xpu_tests: {name} is not in {src}", file=sys.stderr)
    return result


def main() -> int:
    args = runs.parser(__doc__.split("\n")[0]).parse_args()
    return runs.main_loop(args, jobs(args.peer), "sgl_kernel_xpu_tests",
                          "sgl-kernel-xpu tests on xpu-ops (shim, device plumbing adapted)")


if __name__ == "__main__":
    sys.exit(main())
