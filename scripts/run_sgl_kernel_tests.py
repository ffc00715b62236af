"""Run sgl-kernel's public attention tests unmodified on xpu-ops and count results per function.

sgl-kernel's tests from the sglang repository (``sgl-kernel/tests/test_flash_attention.py``,
``test_merge_state_v2.py``, ``test_flashmla.py``; saved by hand, never committed) are read from
``<peer>/sglang/sgl-kernel/tests/`` (``scripts/prepare_peer.py``) or, the older layout, directly
from ``<peer>/``; ``import sgl_kernel`` resolves to xpu-ops (``-p sgl_kernel_shim``). Jobs
(``--list``), each one pytest process meant to fit a 10-minute GPU call:

* ``flash_<i>of<n>``: ``test_flash_attention.py`` as published, split into ``--flash-shards``
  shards (every n-th test; ``--collect`` counts each job's tests without running them);
* ``flash_switches_off_<i>of<n>``: only when the file still hard-codes a ``DISABLE_*`` switch
  for split, paged KV, append KV, local, softcap or pack-GQA as True: a generated copy
  (``<peer>/generated/``) with those switches False (FP16/FP8 as published), in
  ``--switches-off-shards`` shards;
* ``merge``: ``test_merge_state_v2.py``; ``flashmla_<i>of<n>``: ``test_flashmla.py`` in
  ``--flashmla-shards`` shards.

Writes under ``--out`` (default ``$OUT``) each job's log and outcomes, and
``sgl_kernel_tests.json`` / ``.md`` (per job, file and function; see ``client_test_runs``).
Exit status 1 when anything failed, errored or was stopped at its budget.

    python scripts/run_sgl_kernel_tests.py --list
    python scripts/run_sgl_kernel_tests.py --jobs flash_1of4,flash_2of4 -n 8 --budget 280
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import client_test_runs as runs  # noqa: E402

SWITCHES_OFF = ("DISABLE_SPLIT", "DISABLE_PAGEDKV", "DISABLE_APPENDKV", "DISABLE_LOCAL",
                "DISABLE_SOFTCAP", "DISABLE_PACKGQA")
#: job name -> sgl-kernel test file.
SGLANG_FILES = {"flash": "test_flash_attention.py", "merge": "test_merge_state_v2.py",
                "flashmla": "test_flashmla.py"}


def find(peer: pathlib.Path, name: str) -> pathlib.Path | None:
    """The saved file ``name``: the current layout first, then the older flat one."""
    for path in (peer / "sglang" / "sgl-kernel" / "tests" / name, peer / name):
        if path.exists():
            return path
    return None


def switches_off_copy(path: pathlib.Path, peer: pathlib.Path) -> pathlib.Path | None:
    """``path`` with each ``NAME = True`` of ``SWITCHES_OFF`` set to False, written to
    ``peer/generated/``; None when no switch is on (the published file already runs them)."""
    source = path.read_text()
    on = [name for name in SWITCHES_OFF if f"\n{name} = True\n" in source]
    if not on:
        return None
    for name in on:
        source = source.replace(f"\n{name} = True\n", f"\n{name} = False\n")
    target = peer / "generated" / "sglang" / "test_flash_attention_switches_off.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    runs.write_if_changed(target, source)
    return target


#: Default shard counts (``scripts/gpu_client_tests.sh`` plans its parts on them): at about 4 s of
#: one worker per test on an H100 (part 1: 524 tests of test_flash_attention.py in 450 s at -n 5;
#: test_flashmla.py about 5.5 s), each shard is about 1,100 worker-seconds (flashmla: 590).
FLASH_SHARDS, SWITCHES_OFF_SHARDS, FLASHMLA_SHARDS = 4, 12, 6


def jobs(peer: pathlib.Path, flash_shards: int = FLASH_SHARDS,
         flashmla_shards: int = FLASHMLA_SHARDS,
         switches_off_shards: int = SWITCHES_OFF_SHARDS) -> list[runs.Job]:
    found = {job: find(peer, name) for job, name in SGLANG_FILES.items()}
    missing = [SGLANG_FILES[j] for j, p in found.items() if p is None]
    if missing:
        print(f"run_sgl_kernel_tests: not saved under {peer}: {', '.join(missing)} "
              "(scripts/prepare_peer.py --sglang-tests DIR)", file=sys.stderr)
    result = []
    if found["flash"] is not None:
        result += runs.sharded("flash", [found["flash"]], flash_shards)
        copy = switches_off_copy(found["flash"], peer)
        if copy is not None:
            result += runs.sharded("flash_switches_off", [copy], switches_off_shards)
    if found["merge"] is not None:
        result.append(runs.Job("merge", (found["merge"],)))
    if found["flashmla"] is not None:     # 644 tests
        result += runs.sharded("flashmla", [found["flashmla"]], flashmla_shards)
    return result


def main() -> int:
    parser = runs.parser(__doc__.split("\n")[0])
    parser.add_argument("--flash-shards", type=int, default=FLASH_SHARDS,   # 1008 tests
                        help="shards of test_flash_attention.py (jobs flash_<i>of<n>)")
    parser.add_argument("--switches-off-shards", type=int, default=SWITCHES_OFF_SHARDS,
                        help="shards of its switches-off copy, 3072 tests (jobs "
                             "flash_switches_off_<i>of<n>)")
    parser.add_argument("--flashmla-shards", type=int, default=FLASHMLA_SHARDS,
                        help="shards of test_flashmla.py (jobs flashmla_<i>of<n>)")
    args = parser.parse_args()
    return runs.main_loop(args, jobs(args.peer, args.flash_shards, args.flashmla_shards,
                                     args.switches_off_shards),
                          "sgl_kernel_tests",
                          "sgl-kernel tests on xpu-ops (shim)")


if __name__ == "__main__":
    sys.exit(main())
