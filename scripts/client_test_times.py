"""Worker-seconds per job of client-test runs, from the ``*.jsonl`` results lines the runners
write (``"seconds"`` of each test phase, recorded by ``sgl_kernel_shim``), for planning
``scripts/gpu_client_tests.sh``'s parts.

For each job under the given folders (searched recursively): tests reported, the sum of their
phase seconds (setup + call + teardown: the worker time the tests took, xdist start-up and
collection not included), seconds per test, and the file's seconds per test over all its jobs.

    python scripts/client_test_times.py results/h100/clients
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib


def job_times(path: pathlib.Path) -> tuple[str, int, float]:
    """``(file, tests, worker-seconds)`` of one job's results lines (lines without seconds, as
    older runs wrote them, count as 0 s)."""
    tests, seconds, file = set(), 0.0, ""
    for line in path.read_text().splitlines():
        record = json.loads(line)
        file = record["nodeid"].split("::")[0].rsplit("/", 1)[-1]
        if record["when"] != "collect":
            tests.add(record["nodeid"])
            seconds += record.get("seconds", 0.0)
    return file, len(tests), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=pathlib.Path)
    args = parser.parse_args()
    per_file = collections.defaultdict(lambda: [0, 0.0])
    print(f"{'job':42s} {'tests':>6s} {'worker-s':>9s} {'s/test':>7s}")
    for folder in args.folders:
        for path in sorted(folder.rglob("*.jsonl")):
            file, tests, seconds = job_times(path)
            per_file[file][0] += tests
            per_file[file][1] += seconds
            rate = seconds / tests if tests else 0.0
            print(f"{path.parent.name + '/' + path.stem:42s} {tests:6d} {seconds:9.1f} {rate:7.2f}")
    print()
    for file, (tests, seconds) in sorted(per_file.items()):
        print(f"{file:42s} {tests:6d} {seconds:9.1f} {seconds / max(tests, 1):7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
