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


def test_extend_and_mixed_step_batches_and_rows():
    from compile.batch.forward_batch import ForwardMode
    from paged_batches import paged_batch, step_lens
    args = bench_model.parse_args(["--dtype", "float32", "--layers", "1", "--hidden", "64",
                                   "--context", "8", "--warmup", "0", "--steps", "1"])
    model = bench_model.build(args)
    cfg = model.config
    assert step_lens("extend", 10) == [4, 2, 2, 2] and step_lens("mixed", 9) == [2] + [1] * 7
    lens = step_lens("mixed", 10)
    fb = paged_batch(lens, 8, ForwardMode.MIXED, num_heads=cfg.num_attention_heads,
                     num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                     num_layers=1, dtype=torch.float32, device="cpu", page_size=4)
    assert fb.seq_lens_cpu.tolist() == [8 + n for n in lens] and fb.extend_seq_lens_cpu == lens
    table = fb.req_to_token_pool.req_to_token
    expected = torch.cat([table[r, 8:8 + n] for r, n in enumerate(lens)])
    assert torch.equal(fb.out_cache_loc, expected.long())  # each request's next slots
    assert fb.positions.tolist() == [p for n in lens for p in range(8, 8 + n)]
    args.step_modes, args.steps_tokens = ["eager"], [4, 10]
    rows = bench_model.step_rows(model, args)
    assert [(r["step"], r["tokens"]) for r in rows] == [("extend", 4), ("extend", 10),
                                                       ("mixed", 10)], rows  # mixed: T >= 8
    assert all(r["eager_ms"] > 0 for r in rows), rows
