"""Shared machinery of the client-test runners (``run_sgl_kernel_tests.py``,
``run_sgl_kernel_xpu_tests.py``): jobs that each fit one GPU call, and per-file, per-function
counts that survive a job cut short.

A *job* is one pytest process over some client test files, optionally one shard of their tests
(``--xpu-ops-shard=i/n`` of the ``sgl_kernel_shim`` plugin: every n-th test of the sorted
collection, so shards split the work evenly whatever the parametrization) with a wall-clock
budget. The plugin appends one JSON line per test outcome to ``<out>/<job>.jsonl`` as tests
finish, so a job stopped at its budget still reports what ran (``timed_out`` in the summary).

Each runner writes, under ``--out``: ``<job>.log`` (pytest output), ``<job>.jsonl`` (outcomes)
and, aggregated over every ``*.jsonl`` in the folder (earlier calls into the same folder
included), ``<summary>.json`` and ``<summary>.md``: passed / failed / errors / skipped per file
and test function, per job, with the torch, Triton and device names.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTCOMES = ("passed", "failed", "errors", "skipped")


@dataclass(frozen=True)
class Job:
    """One pytest process: ``files`` (paths), ``shard`` ``(i, n)`` (1-based) or None, extra
    pytest arguments, and the environment it adds."""
    name: str
    files: tuple[pathlib.Path, ...]
    shard: tuple[int, int] | None = None
    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict, hash=False, compare=False)


def write_if_changed(path: pathlib.Path, text: str) -> None:
    """Write ``text`` to ``path`` unless it holds it already, atomically (a temporary file
    renamed over it): runners started side by side regenerate the same copies, and a test file
    being collected by one must never be seen half written."""
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def sharded(name: str, files, shards: int, **kwargs) -> list[Job]:
    """``name`` as one job (``shards`` 1) or as ``name_1of<n>`` ... ``name_<n>of<n>``."""
    files = tuple(files)
    if shards <= 1:
        return [Job(name, files, None, **kwargs)]
    return [Job(f"{name}_{i}of{shards}", files, (i, shards), **kwargs)
            for i in range(1, shards + 1)]


#: What a job adds to its environment on a machine without CUDA: the client tests' own Triton
#: references (``test_merge_state*.py``, ``test_flashmla.py``) run in Triton's interpreter (Triton
#: has no CPU code generator), and xpu-ops stays on its CPU provider, the reference oracle (the
#: interpreter would otherwise make the triton provider available there too).
CPU_ENV = {"TRITON_INTERPRET": "1", "XPU_OPS_PROVIDER": "reference"}


def device_env() -> dict:
    """``CPU_ENV`` when CUDA is not available, else nothing (an explicit setting in the caller's
    environment wins)."""
    import torch
    if torch.cuda.is_available():
        return {}
    return {k: v for k, v in CPU_ENV.items() if k not in os.environ}


def _pytest(job: Job, workers: int, extra: list[str], **env_extra) -> tuple[list[str], dict]:
    """The command line and environment of ``job``'s pytest with the shim plugin."""
    env = dict(os.environ, **device_env(), **job.env, **env_extra,
               PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", *map(str, job.files), "-q", "-rN",
           "-p", "sgl_kernel_shim", "-p", "no:cacheprovider", "-o", "addopts=",
           "--rootdir", str(job.files[0].parent),
           *(["-n", str(workers)] if workers > 0 else []),
           *([f"--xpu-ops-shard={job.shard[0]}/{job.shard[1]}"] if job.shard else []),
           *job.args, *extra]
    return cmd, env


def collect_job(job: Job, extra: list[str]) -> int:
    """How many tests ``job`` runs (its shard and selection applied; ``pytest --collect-only``,
    nothing executed); -1 when the collection fails."""
    import torch
    plugin = [] if torch.cuda.is_available() else ["-p", "collect_as_h100"]
    cmd, env = _pytest(job, 0, [*plugin, *extra, "--collect-only"])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    return len(ids) if proc.returncode in (0, 5) else -1


def run_job(job: Job, out: pathlib.Path, workers: int, budget: float, extra: list[str]) -> dict:
    """Run ``job``'s pytest with the shim plugin (``device_env()`` added); stop it (its whole
    process group) after ``budget`` seconds. Returns ``{"status", "seconds", "timed_out"}``."""
    results = out / f"{job.name}.jsonl"
    results.unlink(missing_ok=True)
    cmd, env = _pytest(job, workers, extra, XPU_OPS_TEST_RESULTS=str(results))
    start = time.monotonic()
    with open(out / f"{job.name}.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            status, timed_out = proc.wait(timeout=budget), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)      # the job's own process group only
            status, timed_out = proc.wait(), True
            log.write(f"\n[client_test_runs] stopped after the budget of {budget:.0f} s\n")
    return {"status": status, "seconds": round(time.monotonic() - start, 1),
            "timed_out": timed_out}


def counts(results: pathlib.Path) -> dict[str, dict]:
    """``{"file::function": {passed, failed, errors, skipped, first_failure}}`` from a job's JSON
    lines (one test counts once: an error in collection, setup or teardown makes it an error,
    else its call's outcome; a file that does not import is one error of ``file::(import)``)."""
    per_test: dict[str, str] = {}
    messages: dict[str, str] = {}
    if results.exists():
        for line in results.read_text().splitlines():
            record = json.loads(line)
            node, when, outcome = record["nodeid"], record["when"], record["outcome"]
            if when == "collect":
                node = node + "::(import)"
            if outcome == "failed":
                messages.setdefault(node, record.get("message", ""))
            if outcome == "failed" and when != "call":
                per_test[node] = "errors"
            elif per_test.get(node) == "errors":
                continue
            elif when == "call" or outcome == "skipped":
                per_test[node] = outcome
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    first: dict[str, str] = {}
    for node, outcome in per_test.items():
        path, _, test = node.partition("::")
        key = f"{pathlib.Path(path).name}::{test.split('[')[0].replace('::', '.')}"
        table[key][outcome] += 1
        if node in messages:
            first.setdefault(key, messages[node])
    return {key: {**{k: c[k] for k in OUTCOMES}, "first_failure": first.get(key, "")}
            for key, c in sorted(table.items())}


def environment() -> dict[str, str]:
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA device)"
    return {"torch": torch.__version__, "triton": triton_version, "device": device}


def summarize(out: pathlib.Path, jobs_info: dict, summary: str, title: str) -> tuple[dict, bool]:
    """Aggregate every ``*.jsonl`` under ``out`` into ``<summary>.json``/``.md``; returns the
    summary and whether every test of every job passed or was skipped."""
    info_path = out / f"{summary}_jobs.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    info.update(jobs_info)
    info_path.write_text(json.dumps(info, indent=2))
    results = {p.stem: counts(p) for p in sorted(out.glob("*.jsonl"))}
    env = environment()
    data = {"environment": env, "jobs": info, "results": results,
            "totals": {o: sum(c[o] for table in results.values() for c in table.values())
                       for o in OUTCOMES}}
    (out / f"{summary}.json").write_text(json.dumps(data, indent=2))
    lines = [f"{title}: {env['device']}, torch {env['torch']}, Triton {env['triton']}", "",
             "| job | file::function | passed | failed | errors | skipped |",
             "| --- | --- | --- | --- | --- | --- |"]
    for job, table in results.items():
        note = " (stopped at its budget)" if info.get(job, {}).get("timed_out") else ""
        for function, c in table.items():
            lines.append(f"| {job}{note} | {function} | " + " | ".join(str(c[o]) for o in OUTCOMES)
                         + " |")
    lines.append(f"| total | | " + " | ".join(str(data["totals"][o]) for o in OUTCOMES) + " |")
    (out / f"{summary}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    ok = (data["totals"]["failed"] == 0 and data["totals"]["errors"] == 0 and bool(results)
          and not any(v.get("timed_out") or v.get("status") not in (0, 5) for v in info.values()))
    return data, ok


def parser(description: str, default_budget: float = 540.0) -> argparse.ArgumentParser:
    """The options both runners share."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--peer", type=pathlib.Path, default=ROOT / ".peer",
                   help="folder of the saved client files (default .peer)")
    p.add_argument("--out", type=pathlib.Path, default=os.environ.get("OUT", "client_out"))
    p.add_argument("--jobs", default="", help="comma list of job names (default: all; "
                                              "--list shows them)")
    p.add_argument("--list", action="store_true", help="print the job names and exit")
    p.add_argument("--collect", action="store_true",
                   help="print each selected job's test count (collected, nothing run) and exit")
    p.add_argument("-n", type=int, default=0, help="pytest-xdist workers per job (0: none)")
    p.add_argument("--budget", type=float, default=default_budget,
                   help="seconds per job before it is stopped (its counts so far are kept)")
    p.add_argument("--total-budget", type=float, default=570.0,
                   help="seconds for all the jobs of this call: a job gets at most what is left, "
                        "and jobs that would start with under 20 s left are not started")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    return p


def main_loop(args, jobs: list[Job], summary: str, title: str) -> int:
    """Select ``args.jobs``, run them one after another, write the summary; exit status 1 when
    anything failed, errored or ran out of time."""
    by_name = {job.name: job for job in jobs}
    if args.list:
        print("\n".join(by_name))
        return 0
    wanted = [n for n in args.jobs.split(",") if n] or list(by_name)
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        sys.exit(f"{summary}: --jobs {', '.join(unknown)} unknown; expected some of "
                 f"{', '.join(by_name)}")
    if args.collect:
        for name in wanted:
            print(f"{name} {collect_job(by_name[name], args.pytest_args)}", flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    info, start = {}, time.monotonic()
    for name in wanted:
        left = args.total_budget - (time.monotonic() - start)
        if left < 20:
            info[name] = {"status": None, "seconds": 0, "timed_out": True,
                          "not_started": "no time left in --total-budget"}
        else:
            info[name] = run_job(by_name[name], args.out, args.n, min(args.budget, left),
                                 args.pytest_args)
        print(f"[{summary}] {name}: {info[name]}", flush=True)
    _, ok = summarize(args.out, info, summary, title)
    return 0 if ok else 1
