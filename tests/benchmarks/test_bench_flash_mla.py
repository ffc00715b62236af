"""``bench_flash_mla --quick`` on the CPU: every case is timed on the reference, every other
provider is listed with the reason it was skipped, and the files are written."""

import json

import bench_flash_mla


def test_quick_run_times_every_case(tmp_path):
    bench_flash_mla.main(["--device", "cpu", "--quick", "--reps", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())
    assert rows[0]["copy_gbps"] > 0 and rows[0]["matmul_tflops"] > 0
    timed = {(r["case"], r["provider"]) for r in rows[1:] if "ms" in r and r["ms"] > 0}
    assert {(case, "reference") for case in bench_flash_mla.INPUTS} <= timed
    assert all("ms" in r or r["skipped"] for r in rows[1:])
    assert "| sparse_decode |" in (tmp_path / "results.md").read_text()
