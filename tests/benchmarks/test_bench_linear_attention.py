"""bench_linear_attention on the CPU: every case and op timed, the rows and tables written."""

import json

from bench_linear_attention import QUICK_SHAPE, bytes_moved, flops, main


def test_quick_run_times_every_case(tmp_path):
    main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "linear_attention.json").read_text())["rows"]
    assert sorted({(r["case"], r["op"]) for r in rows}) == sorted(
        (case, op) for case in ("decode", "verify", "prefill") for op in ("gdn", "conv"))
    assert all(r["us"] > 0 for r in rows)
    assert (tmp_path / "linear_attention.md").read_text().count("| reference |") == len(rows)


def test_formulas_count_what_their_docstrings_say():
    s = QUICK_SHAPE
    state = s["hv"] * s["k"] * s["v"] * 4                               # float32 state
    rows = (2 * s["hk"] * s["k"] + 2 * s["hv"] * s["v"]) * 2            # bf16 q, k, v, o
    assert bytes_moved("decode", 3, 3, s) == 2 * 3 * state + 3 * rows
    assert bytes_moved("verify", 1, 4, s) == 2 * state + 4 * state + 4 * rows
    assert flops(10, s, chunk=4) == 2 * 10 * s["hv"] * (3 * 16 * 16 + 2 * 4 * 16 + 2 * 4 * 16)
