"""``bench_dsa_decode --quick`` on the CPU: both models (sparse DSA and dense MLA) decode every
batch size, and the table and JSON are written."""

import json
from types import SimpleNamespace

import torch

import bench_dsa_decode


def test_quick_run_times_both_models(tmp_path):
    bench_dsa_decode.main(["--device", "cpu", "--quick", "--dtype", "float32", "--modes",
                           "eager", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "dsa_decode.json").read_text())
    assert [(r["model"], r["b"]) for r in rows] == [("sparse", 1), ("sparse", 2), ("dense", 1),
                                                    ("dense", 2)]
    assert all(r["ms"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert "| sparse | eager | 2 |" in (tmp_path / "dsa_decode.md").read_text()


def test_min_bytes_counts_topk_rows_for_sparse():
    args = SimpleNamespace(quick=True, layers=1, intermediate=8, topk=16,
                           dtype=torch.float32, device="cpu")
    sparse, dense = bench_dsa_decode.build(args, True), bench_dsa_decode.build(args, False)
    weights = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    row = (32 + 16) * 4  # (R + r) float32
    # context 40: 41 keys; sparse reads top-16 rows and all 41 index keys (32 fp8 + 4 scale)
    assert bench_dsa_decode.min_bytes(sparse, 2, 40) == weights(sparse) + 2 * (16 * row + 41 * 36)
    assert bench_dsa_decode.min_bytes(dense, 2, 40) == weights(dense) + 2 * 41 * row
