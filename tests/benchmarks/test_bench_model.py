"""bench_model's decode table with the dense peer and the roofline (CPU, tiny shapes; the dense
peer traced by Dynamo without Inductor to keep the test short: Inductor's compile of it is
checked on the GPU, tests/benchmarks/test_dense_baseline.py)."""

import json
import re

import pytest
import torch

import bench_model
from decode_roofline import decode_step_bytes


def test_table_has_the_dense_peer_and_the_roofline(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_model, "compile_dense", lambda dense, mode=None: torch.compile(
        dense, backend="eager", fullgraph=True))
    bench_model.main(["--device", "cpu", "--dtype", "float32", "--layers", "1", "--hidden", "64",
                      "--batches", "1", "2", "--modes", "eager", "dense", "--warmup", "0",
                      "--steps", "2", "--context", "8", "--compile-layers", "0", "--copy-mib", "8",
                      "--out", str(tmp_path / "bench")])
    out = capsys.readouterr().out
    assert re.search(r"^b=2 dense: [\d.]+ tok/s .*, [\d.]+ of the roofline\)$", out, re.M), out
    # each mode as x of dense (fraction of the roofline); dense is 1.00x of itself
    assert re.search(r"^\| 2 \| [\d.]+x \([\d.]+\) \| 1\.00x \([\d.]+\) \|$", out, re.M), out
    result = json.loads((tmp_path / "bench.json").read_text())
    args = bench_model.parse_args(["--dtype", "float32", "--layers", "1", "--hidden", "64"])
    model = bench_model.build(args)
    for row in result["rows"]:  # b tokens per (weights + KV bytes) at the measured bandwidth
        seconds = sum(decode_step_bytes(model, row["batch"], 8)) / result["copy_bytes_per_s"]
        assert row["roofline"] == pytest.approx(row["batch"] / seconds)
        assert row["dense"] > 0 and row["eager"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.md", "bench.png"]
