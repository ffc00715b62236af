"""Run sgl-kernel's public attention tests unmodified on xpu-ops and count results per function.

sgl-kernel's ``sgl-kernel/tests/test_flash_attention.py`` and ``test_merge_state_v2.py`` (public
sglang repository; saved by hand under the git-ignored ``.peer/``, never committed) run with
``import sgl_kernel`` resolving to xpu-ops (``-p sgl_kernel_shim``, ``scripts/sgl_kernel_shim.py``).
Runs:

* ``flash_published``: ``test_flash_attention.py`` as published.
* ``flash_switches_off``: a generated copy (``.peer/generated/``) whose ``DISABLE_*`` switches for
  split, paged KV, append KV, local, softcap and pack-GQA are False (FP16/FP8 left as published;
  the file hard-codes its switches, so an environment variable cannot reach them).
* ``merge``: ``test_merge_state_v2.py`` as published.

Writes, under ``--out`` (default ``$OUT``): ``<run>.xml`` (JUnit), ``<run>.log`` (pytest output),
``sgl_kernel_tests.json`` and ``sgl_kernel_tests.md`` (passed / failed / errors / skipped per test
function per run, with the torch, Triton and device names). Exit status 1 when anything failed.

    python scripts/run_sgl_kernel_tests.py                           # all three runs, -n 4
    python scripts/run_sgl_kernel_tests.py --runs merge -n 0         # one run, no xdist
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]
SWITCHES_OFF = ("DISABLE_SPLIT", "DISABLE_PAGEDKV", "DISABLE_APPENDKV", "DISABLE_LOCAL",
                "DISABLE_SOFTCAP", "DISABLE_PACKGQA")
RUNS = ("flash_published", "flash_switches_off", "merge")


def switches_off_copy(peer: pathlib.Path) -> pathlib.Path:
    """``test_flash_attention.py`` with each of ``SWITCHES_OFF`` set to False (each assignment
    must appear exactly once as ``NAME = True``), written to ``peer/generated/``."""
    source = (peer / "test_flash_attention.py").read_text()
    for name in SWITCHES_OFF:
        line = f"\n{name} = True\n"
        if source.count(line) != 1:
            sys.exit(f"run_sgl_kernel_tests: `{line.strip()}` occurs {source.count(line)} times "
                     "in test_flash_attention.py; expected once. Is it the published file?")
        source = source.replace(line, f"\n{name} = False\n")
    target = peer / "generated" / "test_flash_attention_switches_off.py"
    target.parent.mkdir(exist_ok=True)
    target.write_text(source)
    return target


def test_file(run: str, peer: pathlib.Path) -> pathlib.Path:
    if run == "flash_switches_off":
        return switches_off_copy(peer)
    path = peer / ("test_merge_state_v2.py" if run == "merge" else "test_flash_attention.py")
    if not path.exists():
        sys.exit(f"run_sgl_kernel_tests: {path} is missing; save sgl-kernel/tests/{path.name} "
                 "from the sglang repository there (unmodified).")
    return path


def run_pytest(run: str, path: pathlib.Path, out: pathlib.Path, workers: int,
               extra: list[str]) -> int:
    """One pytest process over ``path``; JUnit XML and the log go to ``out``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "scripts"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "sgl_kernel_shim",
           "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={out / (run + '.xml')}",
           *(["-n", str(workers)] if workers > 0 else []), *extra]
    with open(out / f"{run}.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        return subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def counts(junit: pathlib.Path) -> dict[str, dict[str, int]]:
    """``{test function: {passed, failed, errors, skipped}}`` from a JUnit XML report."""
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for case in ET.parse(junit).getroot().iter("testcase"):
        function = case.get("name", "").split("[")[0]
        kinds = {child.tag for child in case}
        outcome = ("failed" if "failure" in kinds else "errors" if "error" in kinds
                   else "skipped" if "skipped" in kinds else "passed")
        table[function][outcome] += 1
    return {f: {k: c[k] for k in ("passed", "failed", "errors", "skipped")}
            for f, c in sorted(table.items())}


def environment() -> dict[str, str]:
    import torch
    import triton
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    return {"torch": torch.__version__, "triton": triton.__version__, "device": device}


def markdown(results: dict, env: dict) -> str:
    lines = [f"sgl-kernel tests on xpu-ops (shim): {env['device']}, torch {env['torch']}, "
             f"Triton {env['triton']}", "",
             "| run | test function | passed | failed | errors | skipped |",
             "| --- | --- | --- | --- | --- | --- |"]
    for run, table in results.items():
        for function, c in table.items():
            lines.append(f"| {run} | {function} | {c['passed']} | {c['failed']} | "
                         f"{c['errors']} | {c['skipped']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer", type=pathlib.Path, default=ROOT / ".peer")
    parser.add_argument("--out", type=pathlib.Path, default=os.environ.get("OUT", "sgl_out"))
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {RUNS}")
    parser.add_argument("-n", type=int, default=4, help="pytest-xdist workers (0: none)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results, failed = {}, False
    for run in args.runs.split(","):
        if run not in RUNS:
            parser.error(f"--runs: unknown run {run!r}; expected some of {RUNS}")
        status = run_pytest(run, test_file(run, args.peer), args.out, args.n, args.pytest_args)
        junit = args.out / f"{run}.xml"
        results[run] = counts(junit) if junit.exists() else {}
        failed |= status != 0 or not results[run]
    env = environment()
    (args.out / "sgl_kernel_tests.json").write_text(
        json.dumps({"environment": env, "results": results}, indent=2))
    (args.out / "sgl_kernel_tests.md").write_text(markdown(results, env))
    print(markdown(results, env))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
