"""bench_hybrid_decode on the CPU (tiny shapes, pieces uncompiled): both models decode in graphs
mode, with the same parameter count, and the hybrid one keeps a quarter of the KV."""

import bench_hybrid_decode


def test_quick_rows_compare_models_of_one_size(capsys):
    rows = bench_hybrid_decode.main(["--device", "cpu", "--dtype", "float32", "--quick",
                                     "--no-inductor", "--batches", "2", "--context", "8",
                                     "--new-tokens", "4"])
    hybrid, dense = rows
    assert (hybrid["model"], dense["model"]) == ("hybrid", "dense")
    h, n = 64, 4  # QUICK: the dense MLP width is a multiple of 64: within 3 n h 32 parameters
    assert abs(hybrid["params"] - dense["params"]) <= 3 * n * h * 32
    # one full-attention layer of four (2 KV heads x (16 + 16) x 4 bytes) against four
    assert hybrid["kv_bytes_per_token"] == 2 * 32 * 4 and dense["kv_bytes_per_token"] == 4 * 256
    assert hybrid["state_bytes_per_request"] > 0 == dense["state_bytes_per_request"]
    assert all(r["steps"] >= 1 and r["tokens_per_s"] > 0 for r in rows), rows
    out = capsys.readouterr().out
    assert out.count("\n| hybrid | ") == 1 and out.count("\n| dense | ") == 1, out
