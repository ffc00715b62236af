"""bench_hybrid_decode on the CPU (tiny shapes, pieces uncompiled, whole-step graphs emulated):
both models decode in graphs mode through one engine each for several batch sizes (before, the
second batch size's engine stopped the runner: "cannot use the step buffers made for another
backend"), with the same parameter count, no graph break, replayed decode steps, and the
hybrid one keeps a quarter of the KV; the results folder feeds the results page."""

import json

import bench_hybrid_decode
import make_results_page


def test_quick_rows_compare_models_of_one_size(capsys, tmp_path):
    out = tmp_path / "hybrid"
    rows = bench_hybrid_decode.main(["--device", "cpu", "--dtype", "float32", "--quick",
                                     "--no-inductor", "--emulate-graphs", "--batches", "1", "2",
                                     "--context", "8", "--new-tokens", "4", "--out", str(out)])
    assert [(r["model"], r["batch"]) for r in rows] == [
        ("hybrid", 1), ("dense", 1), ("hybrid", 2), ("dense", 2)]
    hybrid, dense = rows[:2]
    h, n = 64, 4  # QUICK: the dense MLP width is a multiple of 64: within 3 n h 32 parameters
    assert abs(hybrid["params"] - dense["params"]) <= 3 * n * h * 32
    # one full-attention layer of four (2 KV heads x (16 + 16) x 4 bytes) against four
    assert hybrid["kv_bytes_per_token"] == 2 * 32 * 4 and dense["kv_bytes_per_token"] == 4 * 256
    assert hybrid["state_bytes_per_request"] > 0 == dense["state_bytes_per_request"]
    # 3 decode steps per batch size: warm-up, capture, replay (a bucket per batch size)
    assert all(r["steps"] >= 1 and r["tokens_per_s"] > 0 for r in rows), rows
    assert all(r["graph_breaks"] == 0 and r["replays"] >= 1 for r in rows), rows
    text = capsys.readouterr().out
    assert text.count("\n| 1 | ") == 1 and text.count("\n| 2 | ") == 1, text
    saved = json.loads((out / "hybrid_decode.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    run = tmp_path
    (run / "env.txt").write_text("CPU, torch test\n")
    page = make_results_page.page({"cpu": run}, tmp_path)
    assert "bench_hybrid_decode.py" in page and "| hybrid | " in page, page
