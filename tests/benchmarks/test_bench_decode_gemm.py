"""bench_decode_gemm on the CPU: every shape and batch timed, each product equal to a float64
reference, and the rows written."""

import json

from bench_decode_gemm import SHAPES, main


def test_quick_run_times_every_shape_against_float64(tmp_path):
    main(["--device", "cpu", "--quick", "--choices", "cublas", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "decode_gemm.json").read_text())["rows"]
    assert sorted((r["shape"], r["batch"]) for r in rows) == sorted(
        (name, b) for name in SHAPES for b in (1, 4))
    for r in rows:
        assert r["us"] > 0
        # bf16 output of a K-long dot of unit-variance x and 1/sqrt(K) weights: |y| ~ 1, so
        # rounding to bf16 costs at most about 2^-8 of it
        assert r["max_abs_err"] < 0.05, r
