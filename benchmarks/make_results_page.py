"""Generate ``benchmarks/RESULTS.md``: one current section per device kind, each from one run
folder written by ``benchmarks/gpu_session.sh``.

    python benchmarks/make_results_page.py                      # every folder in results/
    python benchmarks/make_results_page.py --run h100=/tmp/h100 --run h200=benchmarks/results/h200

A run folder holds what ``gpu_session.sh`` leaves in ``$OUT`` once its ``results.tgz`` is
unpacked there: ``summary.txt`` (date, commit, each part's exit status and seconds),
``env.txt`` (device, torch, Triton and Python versions), ``commands.txt`` (``part<TAB>command``
per part) and each part's outputs (``decode.md``/``.png``, ``profile/*.md``,
``kernels/attention.md``/``.png`` with ``kernels/limits.md`` (the measured limits, shown under
the table), ``attention/attention.md``/``.png``, ``mla/``, ``steps.md``,
``gemm/decode_gemm.json``, ``disagg/disaggregation.json``, ``suite.log``, ``kernels_check.log``,
``sgl/*.md``, ``hybrid/hybrid_decode.md``, ``dsa/dsa_decode.md``, ``dsa_indexer/results.md``,
``clients/**/sgl_kernel*_tests.json`` from ``scripts/gpu_client_tests.sh``) and, optionally,
``notes.txt`` (shown under the device heading).
Every table of a section comes from that one run, so the figures
beside each other were measured together; each part shows the command that produced it. The
page is rewritten whole: edit the run folders or this script, never the page (history is in
git).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
PAGE = HERE / "RESULTS.md"
# part -> title, in page order (the parts of gpu_session.sh)
PARTS = {
    "decode": "Whole-model decode tokens/s per mode (bench_model.py)",
    "steps": "Extend and mixed steps, compiled against graphs (bench_model.py)",
    "profile": "Kernels of one decode step (profile_decode.py)",
    "kernels_check": "GPU check of the split-KV paths of the kernels' table (pytest -m gpu)",
    "kernels": "The kernels' one-run table: decode, prefill, MLA and op calls against the "
               "device's ceilings and peers (bench_attention.py --kernels-table)",
    "attention": "Attention kernels against the device's ceilings and peers (bench_attention.py)",
    "mla": "MLA decode: kernel paths and tile configurations (bench_attention.py)",
    "gemm": "The decode step's GEMMs under each GEMM choice (bench_decode_gemm.py)",
    "disagg": "Prefill/decode disaggregation on one card: KV transfer against prefill per "
              "request (bench_disaggregation.py)",
    "hybrid": ("Hybrid linear attention decode: a Qwen3-Next-shaped model against a dense model "
               "of the same size (bench_hybrid_decode.py)"),
    "dsa": "DeepSeek-V3.2-shaped decode: sparse (DSA) against dense MLA (bench_dsa_decode.py)",
    "dsa_dense": "DeepSeek-V3.2-shaped decode: the dense-MLA rows of the table above, in their "
                 "own process (bench_dsa_decode.py)",
    "dsa_indexer": "The DSA indexer ops: top-k and paged logits against the reference provider "
                   "and the copy ceiling (bench_dsa_indexer.py)",
    "suite": "The gpu-marked test suite",
    "sgl": "sgl-kernel's own tests through the shim (run_sgl_kernel_tests.py)",
    "generate": "The main job on the GPU (generate_verify.sh)",
    "clients": "The clients' own tests through the shim: sgl-kernel-xpu's tests/ and sgl-kernel's "
               "newest (scripts/gpu_client_tests.sh)",
}
#: summary name of each client runner -> its heading in the ``clients`` part
CLIENT_RUNNERS = {"sgl_kernel_xpu_tests": "sgl-kernel-xpu's tests/ (run_sgl_kernel_xpu_tests.py)",
                  "sgl_kernel_tests": "sgl-kernel's newest tests (run_sgl_kernel_tests.py)"}
OUTCOMES = ("passed", "failed", "errors", "skipped")


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def part_files(run: Path, part: str, suffix: str) -> list[Path]:
    """``<part><suffix>`` and ``<part>/*<suffix>`` in ``run``, sorted."""
    return sorted([*run.glob(f"{part}{suffix}"), *(run / part).glob(f"*{suffix}")])


def demote(markdown: str) -> str:
    """Every heading of an included file at level 4 (its part is ``###``)."""
    return re.sub(r"^#+ ", "#### ", markdown.strip(), flags=re.M)


def gemm_table(run: Path) -> str:
    """Microseconds per GEMM call of ``gemm/decode_gemm.json``: a row per shape and batch, a
    column per GEMM choice (fraction of the run's copy bandwidth in brackets)."""
    data = json.loads(read(run / "gemm" / "decode_gemm.json") or "{}")
    rows = data.get("rows", [])
    if not rows:
        return ""
    choices = list(dict.fromkeys(r["choice"] for r in rows))
    keys = list(dict.fromkeys((r["shape"], r["k"], r["n"], r["batch"]) for r in rows))
    cell = {(r["shape"], r["batch"], r["choice"]): r for r in rows}
    lines = [f"Copy bandwidth {data.get('bandwidth', 0) / 1e9:.0f} GB/s in this run. Cells: us "
             "per call (fraction of copy bandwidth).", "",
             "| shape (k x n) | batch | " + " | ".join(choices) + " |",
             "|---|---:|" + "---:|" * len(choices)]
    for shape, k, n, b in keys:
        cells = [f"{cell[shape, b, c]['us']:.2f} ({cell[shape, b, c]['of_copy']:.2f})"
                 if (shape, b, c) in cell else "-" for c in choices]
        lines.append(f"| {shape} ({k} x {n}) | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def disagg_table(run: Path) -> str:
    """``disagg/disaggregation.json``: its settings in a line, then medians per prompt length of
    the prefill, pack and transfer milliseconds per request."""
    data = json.loads(read(run / "disagg" / "disaggregation.json") or "{}")
    if not data.get("table"):
        return ""
    s, equal = data["settings"], data.get("requests_equal", [0, 0])
    lines = [f"{s['model']}, {s['dtype']}: a prefill process ({s['prefill_mode']}, page "
             f"{s['page_size']}) and a decode process ({s['decode_mode']}, page "
             f"{s['decode_page_size']}) on the one card, transport {data['backend']} (two NCCL "
             f"ranks on one card: {data['nccl_probe']}); greedy tokens equal to one engine's "
             f"for {equal[0]} of {equal[1]} requests. Medians per prompt length; prefill: the "
             "prefill step (forward and first token), pack: the request's KV gathered into "
             "send buffers, transfer: the decode side from posting the receives to the KV "
             "written into its pages. The two processes time-slice the card, so a prefill may "
             "wait behind the other process's decode step.", "",
             "| prompt tokens | requests | KV MiB | prefill ms | pack ms | transfer ms | "
             "(pack + transfer) / prefill |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["table"]:
        lines.append(f"| {r['prompt_len']} | {r['requests']} | {r['mib']:.2f} | "
                     f"{r['prefill_ms']:.2f} | {r['pack_ms']:.2f} | {r['transfer_ms']:.2f} | "
                     f"{r['moved_over_prefill']:.2f} |")
    return "\n".join(lines)


def pytest_result(log: str) -> Callable[[Path], str]:
    """The renderer of a pytest part: the summary line of ``log`` (the last line naming
    passed/failed/skipped), if any."""
    def render(run: Path) -> str:
        lines = [line for line in read(run / log).splitlines()
                 if re.search(r"\d+ (passed|failed|skipped)", line)]
        return f"`{lines[-1].strip()}`" if lines else ""
    return render


def client_tables(run: Path) -> str:
    """Every ``<runner>.json`` under ``clients/`` (the lanes of each ``gpu_client_tests.sh``
    part), summed per file and function across the jobs: a table per runner, each row marked
    when a job that holds it stopped at its budget (its counts are then a part of the file)."""
    blocks = []
    for summary, title in CLIENT_RUNNERS.items():
        rows: dict[str, dict] = {}
        for path in sorted((run / "clients").rglob(f"{summary}.json")):
            data = json.loads(read(path) or "{}")
            for job, table in data.get("results", {}).items():
                cut = bool(data.get("jobs", {}).get(job, {}).get("timed_out"))
                for function, c in table.items():
                    row = rows.setdefault(function, {o: 0 for o in OUTCOMES} | {"cut": False})
                    for o in OUTCOMES:
                        row[o] += c.get(o, 0)
                    row["cut"] |= cut
        if not rows:
            continue
        lines = [f"#### {title}", "", "| file::function | passed | failed | errors | skipped |",
                 "|---|---:|---:|---:|---:|"]
        for function, row in sorted(rows.items()):
            mark = " (a job stopped at its budget)" if row["cut"] else ""
            lines.append(f"| {function}{mark} | " + " | ".join(str(row[o]) for o in OUTCOMES)
                         + " |")
        total = {o: sum(r[o] for r in rows.values()) for o in OUTCOMES}
        lines.append("| total | " + " | ".join(str(total[o]) for o in OUTCOMES) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


suite_result = pytest_result("suite.log")
RENDERERS: dict[str, Callable[[Path], str]] = {"gemm": gemm_table, "suite": suite_result,
                                                "disagg": disagg_table, "clients": client_tables,
                                                "kernels_check": pytest_result("kernels_check.log")}


def commands(run: Path) -> dict[str, str]:
    out = {}
    for line in read(run / "commands.txt").splitlines():
        part, _, command = line.partition("\t")
        if command:
            out[part] = command
    return out


def statuses(run: Path) -> dict[str, str]:
    """part -> its summary line (``decode: exit 0 in 116 s (limit 240 s)``)."""
    found = {}
    for line in read(run / "summary.txt").splitlines():
        m = re.match(r"(\w+): (exit .*|skipped.*)$", line.strip())
        if m and m[1] in PARTS:
            found[m[1]] = m[2]
    return found


def part_section(run: Path, part: str, command: Optional[str], status: Optional[str],
                 page_dir: Path, env: str) -> str:
    """One part's subsection, or '' when the run has no output of it."""
    body = RENDERERS[part](run) if part in RENDERERS else "\n\n".join(
        demote(read(p)) for p in part_files(run, part, ".md"))
    if not body and status is None:
        return ""
    text = [f"### {PARTS[part]}", "", f"Measured on {env}.", ""]
    if command:
        text += [f"Command (from the repository root, `OUT` a results folder): "
                 f"`OUT=out PARTS={part} bash benchmarks/gpu_session.sh`, which runs", "",
                 f"    {command}", ""]
    if status:
        text += [f"Part status: {status}.", ""]
    if body:
        text += [body, ""]
    for png in part_files(run, part, ".png"):
        text += [f"![{PARTS[part]}]({link(png, page_dir)})", ""]
    return "\n".join(text)


def link(path: Path, page_dir: Path) -> str:
    """``path`` relative to the page's folder, as a Markdown link target."""
    return Path(os.path.relpath(path.resolve(), page_dir.resolve())).as_posix()


def device_section(kind: str, run: Path, page_dir: Path) -> str:
    """The ``##`` section of one device kind from its run folder."""
    env = read(run / "env.txt").strip() or "device and versions not recorded"
    header = (read(run / "summary.txt").splitlines() or [""])[0]
    when = re.search(r"\d{4}-\d\d-\d\dT[\d:]+Z", header)
    commit = re.search(r"; ([0-9a-f]{7,40})\b", header)
    cmd, status = commands(run), statuses(run)
    parts = [part_section(run, p, cmd.get(p), status.get(p), page_dir, env) for p in PARTS]
    return "\n".join([
        f"## {kind}: {env.split(',')[0]}", "",
        f"{env}. Run of {when[0] if when else 'an unrecorded date'} at commit "
        f"`{commit[1] if commit else 'unrecorded'}`; raw outputs in "
        f"[`{link(run, page_dir)}`]({link(run, page_dir)}).", "",
        *([read(run / "notes.txt").strip(), ""] if read(run / "notes.txt").strip() else []),
        *[p for p in parts if p]])


def page(runs: dict[str, Path], page_dir: Path) -> str:
    kinds = ", ".join(runs) or "none yet"
    head = ["# Benchmark results", "",
            "Generated by `python benchmarks/make_results_page.py` from one run folder per device "
            "kind (`benchmarks/results/<kind>/`, written by `benchmarks/gpu_session.sh`); do "
            "not edit by hand. Every table in a section comes from that section's run. Older "
            "runs are in the git history of this file and of `benchmarks/results/`.", "",
            f"Device kinds: {kinds}. No Intel GPU (XPU) result exists: no machine available to "
            "this project has one.", ""]
    return "\n".join(head + [device_section(k, r, page_dir) for k, r in runs.items()]) + "\n"


def parse_runs(values: list[str]) -> dict[str, Path]:
    """``kind=folder`` arguments, or every folder under ``benchmarks/results/``."""
    if not values:
        return {p.name: p for p in sorted((HERE / "results").iterdir())
                if (p / "summary.txt").is_file() or (p / "env.txt").is_file()}
    runs = {}
    for value in values:
        kind, sep, folder = value.partition("=")
        if not sep or not kind or not Path(folder).is_dir():
            raise SystemExit(f"make_results_page: --run expects KIND=FOLDER with an existing "
                             f"folder, got {value!r}")
        runs[kind] = Path(folder)
    return runs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", default=[], metavar="KIND=FOLDER",
                    help="a device kind and its run folder (repeatable); default: every folder "
                         "under benchmarks/results/ holding a summary.txt or env.txt, named by "
                         "its device kind")
    ap.add_argument("--out", type=Path, default=PAGE, help="the page to write")
    args = ap.parse_args(argv)
    args.out.write_text(page(parse_runs(args.run), args.out.parent), encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
