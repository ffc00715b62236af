"""``benchmarks/make_results_page.py``: one section per device kind from one run folder, each
part with its command, status, versions, tables and plots; the checked-in page is the
generator's output of ``benchmarks/results/`` (nobody edits it by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import make_results_page as gen

ENV = "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0, Python 3.12.3"


def _run(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "summary.txt").write_text(
        "gpu_session 2026-12-07T01:02:03Z parts: decode gemm suite; 1234abc a commit\n"
        "decode: exit 0 in 116 s (limit 240 s)\ngemm: exit 0 in 12 s (limit 240 s)\n"
        "suite: exit 1 in 300 s (limit 420 s)\n")
    (folder / "env.txt").write_text(ENV + "\n")
    (folder / "commands.txt").write_text(
        "decode\tpython benchmarks/bench_model.py --device cuda --out $OUT/decode\n"
        "gemm\tpython benchmarks/bench_decode_gemm.py --device cuda --out $OUT/gemm\n")
    (folder / "decode.md").write_text("# bench_model: decode tokens/s\n\n| batch | graphs |\n"
                                      "|---|---|\n| 1 | 802 |\n")
    (folder / "decode.png").write_bytes(b"\x89PNG")
    (folder / "gemm").mkdir()
    rows = [dict(shape="qkv", k=2048, n=3072, batch=1, choice=c, us=us, of_copy=f)
            for c, us, f in (("cublas", 6.24, 0.48), ("autotune", 4.95, 0.61))]
    (folder / "gemm" / "decode_gemm.json").write_text(json.dumps(dict(bandwidth=4.1e12,
                                                                      rows=rows)))
    (folder / "suite.log").write_text("....F\n1 failed, 4 passed in 290.00s\n")
    return folder


def test_a_device_section_holds_each_part_with_its_command_and_versions(tmp_path):
    run = _run(tmp_path / "results" / "h100")
    text = gen.page({"h100": run}, tmp_path)
    assert text.count("\n## ") == 1 and "## h100: NVIDIA H100 80GB HBM3" in text, text
    assert "Run of 2026-12-07T01:02:03Z at commit `1234abc`" in text, text
    assert text.count(f"Measured on {ENV}.") == 3, text           # decode, gemm, suite
    assert "`OUT=out PARTS=decode bash benchmarks/gpu_session.sh`" in text, text
    assert "    python benchmarks/bench_model.py --device cuda --out $OUT/decode" in text, text
    assert "#### bench_model: decode tokens/s\n\n| batch | graphs |" in text, text
    assert "(results/h100/decode.png)" in text, text
    assert "| qkv (2048 x 3072) | 1 | 6.24 (0.48) | 4.95 (0.61) |" in text, text
    assert "Part status: exit 1 in 300 s (limit 420 s).\n\n`1 failed, 4 passed in 290.00s`" \
        in text, text
    assert "Steps" not in text and "profile_decode" not in text      # parts it did not run
    assert text.index("Whole-model decode") < text.index("GEMMs") < text.index("test suite")


def test_runs_are_the_folders_with_a_summary_or_env(tmp_path, monkeypatch):
    results = tmp_path / "results"
    _run(results / "h100")
    (results / "scratch").mkdir()                       # a benchmark's default --out folder
    monkeypatch.setattr(gen, "HERE", tmp_path)
    assert gen.parse_runs([]) == {"h100": results / "h100"}


def test_the_checked_in_page_is_the_generators_output():
    assert gen.PAGE.read_text(encoding="utf-8") == gen.page(gen.parse_runs([]), gen.PAGE.parent), \
        "benchmarks/RESULTS.md is stale: run python benchmarks/make_results_page.py"


def test_disagg_part_is_a_table_of_transfer_against_prefill(tmp_path):
    run = tmp_path / "h100"
    (run / "disagg").mkdir(parents=True)
    (run / "env.txt").write_text(ENV + "\n")
    settings = dict(model="SmolLM2-135M-shaped Llama (random weights)", dtype="float32",
                    prefill_mode="graphs", decode_mode="graphs", page_size=16,
                    decode_page_size=1)
    table = [dict(prompt_len=512, requests=2, mib=22.5, prefill_ms=8.125, pack_ms=3.5,
                  transfer_ms=12.25, moved_over_prefill=1.94)]
    (run / "disagg" / "disaggregation.json").write_text(json.dumps(dict(
        settings=settings, backend="gloo", nccl_probe="DistBackendError: Duplicate GPU",
        requests_equal=[6, 6], table=table)))
    text = gen.page({"h100": run}, tmp_path)
    assert "### Prefill/decode disaggregation on one card" in text, text
    assert "transport gloo (two NCCL ranks on one card: DistBackendError: Duplicate GPU)" in text
    assert "equal to one engine's for 6 of 6 requests" in text, text
    assert "| 512 | 2 | 22.50 | 8.12 | 3.50 | 12.25 | 1.94 |" in text, text
    (run / "disagg" / "disaggregation.json").write_text("{}")
    assert "disaggregation" not in gen.page({"h100": run}, tmp_path)


def test_dsa_part_shows_the_decode_table_with_both_models_commands(tmp_path):
    run = tmp_path / "results" / "h200"
    (run / "dsa").mkdir(parents=True)
    (run / "env.txt").write_text(ENV + "\n")
    (run / "summary.txt").write_text(
        "gpu_session 2026-12-07T01:02:03Z parts: dsa dsa_dense; 1234abc a commit\n"
        "dsa: exit 0 in 80 s (limit 150 s)\ndsa_dense: exit 0 in 70 s (limit 150 s)\n")
    (run / "commands.txt").write_text(
        "dsa\tpython benchmarks/bench_dsa_decode.py --models sparse --out $OUT/dsa\n"
        "dsa_dense\tpython benchmarks/bench_dsa_decode.py --models dense --out $OUT/dsa\n")
    (run / "dsa" / "dsa_decode.md").write_text("| model | b |\n|---|---|\n| sparse | 1 |\n")
    (run / "dsa" / "dsa_decode_sparse.json").write_text("{}")
    text = gen.page({"h200": run}, tmp_path)
    assert "### DeepSeek-V3.2-shaped decode: sparse (DSA) against dense MLA" in text, text
    assert "| model | b |\n|---|---|\n| sparse | 1 |" in text, text
    assert "    python benchmarks/bench_dsa_decode.py --models dense --out $OUT/dsa" in text, text
    assert "Part status: exit 0 in 70 s (limit 150 s)." in text, text
    assert text.index("sparse (DSA) against dense") < text.index("the dense-MLA rows"), text


def test_the_kernels_check_part_shows_its_pytest_summary(tmp_path):
    run = tmp_path / "results" / "h200"
    run.mkdir(parents=True)
    (run / "summary.txt").write_text("gpu_session 2026-12-07T01:02:03Z parts: kernels_check; "
                                     "1234abc x\nkernels_check: exit 0 in 41 s (limit 75 s)\n")
    (run / "env.txt").write_text(ENV.replace("H100 80GB HBM3", "H200") + "\n")
    (run / "kernels_check.log").write_text("....\n5 passed, 71 deselected in 40.12s\n")
    text = gen.page({"h200": run}, tmp_path)
    assert "### GPU check of the split-KV paths" in text, text
    assert "Part status: exit 0 in 41 s (limit 75 s).\n\n`5 passed, 71 deselected in 40.12s`" \
        in text, text


def test_the_kernels_part_shows_its_limits_under_the_table(tmp_path):
    run = tmp_path / "results" / "h100"
    (run / "kernels").mkdir(parents=True)
    (run / "summary.txt").write_text("gpu_session 2026-12-07T01:02:03Z parts: kernels; "
                                     "1234abc x\nkernels: exit 0 in 250 s (limit 540 s)\n")
    (run / "env.txt").write_text(ENV + "\n")
    (run / "kernels" / "attention.md").write_text("| workload | triton ms |\n|---|---|\n"
                                                  "| prefill 8x4096 causal | 2.9 |\n")
    (run / "kernels" / "limits.md").write_text("Measured limits, GPU H100.\n\n| call | host us "
                                               "|\n|---|---:|\n| packed | 90.1 |\n")
    text = gen.page({"h100": run}, tmp_path)
    assert text.index("| prefill 8x4096 causal | 2.9 |") < text.index("| packed | 90.1 |"), text


def _client_summary(path, results, jobs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"results": results, "jobs": jobs}))


def test_the_clients_part_sums_each_function_over_the_lanes_and_marks_cut_jobs(tmp_path):
    run = tmp_path / "results" / "h100"
    run.mkdir(parents=True)
    (run / "env.txt").write_text(ENV + "\n")
    row = lambda p, f, e, s: {"passed": p, "failed": f, "errors": e, "skipped": s}  # noqa: E731
    # one file's function split over two shards in two parts' lanes; one shard was cut
    _client_summary(run / "clients" / "part1" / "xpu_a" / "sgl_kernel_xpu_tests.json",
                    {"flash_attention_1of2": {"test_flash_attention.py::test_kv": row(5, 1, 0, 2)},
                     "merge_state": {"test_merge_state.py::test_merge": row(7, 0, 0, 0)}},
                    {"flash_attention_1of2": {"timed_out": False},
                     "merge_state": {"timed_out": False}})
    _client_summary(run / "clients" / "part4" / "xpu_b" / "sgl_kernel_xpu_tests.json",
                    {"flash_attention_2of2": {"test_flash_attention.py::test_kv": row(3, 0, 1, 0)}},
                    {"flash_attention_2of2": {"timed_out": True}})
    _client_summary(run / "clients" / "part1" / "sgl" / "sgl_kernel_tests.json",
                    {"merge": {"test_merge_state_v2.py::test_merge_attn_states": row(150, 0, 0,
                                                                                     0)}},
                    {"merge": {"timed_out": False}})
    text = gen.page({"h100": run}, tmp_path)
    assert "### The clients' own tests through the shim" in text, text
    assert ("| test_flash_attention.py::test_kv (a job stopped at its budget) | 8 | 1 | 1 | 2 |"
            in text), text
    assert "| test_merge_state.py::test_merge | 7 | 0 | 0 | 0 |\n| total | 15 | 1 | 1 | 2 |" \
        in text, text
    assert "| test_merge_state_v2.py::test_merge_attn_states | 150 | 0 | 0 | 0 |" in text, text
    assert text.index("sgl-kernel-xpu's tests/") < text.index("sgl-kernel's newest tests"), text
