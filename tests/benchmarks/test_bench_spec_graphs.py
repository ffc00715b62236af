"""bench_spec_graphs on the CPU (tiny shapes, emulated graphs): every kind is captured and
replayed, and a replay computes what eager does."""

import bench_spec_graphs


def test_quick_rows_replay_what_eager_computes(capsys):
    rows = bench_spec_graphs.main(["--device", "cpu", "--quick", "--batches", "2",
                                   "--iters", "1"])
    assert [r["kind"] for r in rows] == list(bench_spec_graphs.KINDS)
    assert [r["tokens"] for r in rows] == [2 * 8, 2 * 4, 2 * 8]  # D=8 drafts, topk=4 branches
    for r in rows:
        assert r["graph_replays"] >= 1 and r["eager_ms"] > 0 and r["graphs_ms"] > 0, r
        assert r["max_abs_diff"] < 1e-4, r
    assert capsys.readouterr().out.count("| 2 |") == 3
