"""``bench_dsa_decode --quick`` on the CPU: both models (sparse DSA and dense MLA) decode every
batch size through one forward each, separate runs into one folder give one table with the
sparse / dense ratios, a profiled batch size gets its kernel table, and the bytes a step reads
are counted from the shapes."""

import json
from types import SimpleNamespace

import torch

import bench_dsa_decode

QUICK = ["--device", "cpu", "--quick", "--dtype", "float32", "--modes", "eager"]


def test_separate_runs_give_one_table(tmp_path):
    bench_dsa_decode.main(QUICK + ["--models", "sparse", "--out", str(tmp_path),
                                   "--profile-batches", "2", "--profile-steps", "1"])
    bench_dsa_decode.main(QUICK + ["--models", "dense", "--out", str(tmp_path)])
    profile = (tmp_path / "profile_sparse_eager_b2.md").read_text()   # the one profiled step
    assert profile.startswith("#### Kernels of one sparse eager b=2 step (cpu, 2 layers"), profile
    assert "| `aten::mm` |" in profile, profile
    assert sorted(p.name for p in tmp_path.glob("profile_*")) == ["profile_sparse_eager_b2.md"]
    rows = [r for m in ("sparse", "dense")
            for r in json.loads((tmp_path / f"dsa_decode_{m}.json").read_text())["rows"]]
    assert [(r["model"], r["b"]) for r in rows] == [("sparse", 1), ("sparse", 2), ("dense", 1),
                                                    ("dense", 2)]
    assert all(r["ms"] > 0 and r["tokens_per_s"] > 0 and r["graph_breaks"] == 0 for r in rows)
    text = (tmp_path / "dsa_decode.md").read_text()
    # two rows each, and the two sparse / dense ratio rows
    assert text.count("| sparse | eager |") == 4 and text.count("| dense | eager |") == 2, text
    assert text.count("DeepSeek-V3.2 shapes") == 1, text                 # one configuration
    s, d = rows[1], rows[3]                                                # b = 2
    ratio = s["tokens_per_s"] / d["tokens_per_s"]
    assert (f"| sparse | eager | 2 | {s['tokens_per_s']:.1f} | {d['tokens_per_s']:.1f} | "
            f"{ratio:.2f} |") in text, text


def test_step_bytes_count_topk_rows_and_index_keys_for_sparse():
    args = SimpleNamespace(quick=True, layers=1, intermediate=8, topk=16,
                           dtype=torch.float32, device="cpu")
    sparse, dense = bench_dsa_decode.build(args, True), bench_dsa_decode.build(args, False)

    def weights(m, b):   # every parameter, but only b rows of the embedding table (64 wide)
        return sum(p.numel() for p in m.parameters()) * 4 - (256 - b) * 64 * 4
    row = (128 + 16) * 4  # (R + r) float32
    # context 40: 41 keys; sparse reads top-16 rows and all 41 index keys (32 fp8 + 4 scale)
    assert bench_dsa_decode.step_bytes(sparse, 2, 40) == dict(
        weights=weights(sparse, 2), cache=2 * (16 * row + 41 * 36))
    assert bench_dsa_decode.step_bytes(dense, 2, 40) == dict(weights=weights(dense, 2),
                                                             cache=2 * 41 * row)
    # context shorter than top-k: every row
    assert bench_dsa_decode.step_bytes(sparse, 1, 9)["cache"] == 10 * row + 10 * 36


def test_size_units():
    assert [bench_dsa_decode.size(n) for n in (5, 6024, 4.4e8, 1.2075e9)] == [
        "5 B", "6.02 kB", "440 MB", "1.21 GB"]


def test_sparse_fp8_reads_flashmla_fp8_tokens(tmp_path):
    """``sparse_fp8``: the same sparse model over an fp8 latent cache; its rows read R + 4 R /
    128 + 2 r bytes a latent row (R = 128, r = 16: 164)."""
    table = bench_dsa_decode.main(QUICK + ["--models", "sparse_fp8", "--out", str(tmp_path)])
    assert [(r["model"], r["b"], r["graph_breaks"]) for r in table] == [
        ("sparse_fp8", 1, 0), ("sparse_fp8", 2, 0)]
    # b = 2, 2 layers, context 40: 41 keys; top-16 latent rows of 164 bytes, 41 index keys of
    # 32 + 4 bytes
    assert table[1]["cache_bytes"] == 2 * 2 * (16 * 164 + 41 * 36)
    assert "| sparse_fp8 | eager | 2 |" in (tmp_path / "dsa_decode.md").read_text()


def test_a_run_cut_after_its_first_batch_keeps_that_row(tmp_path, monkeypatch):
    """The files are rewritten after every row: a run stopped (by a time limit) while its
    second batch size runs still has the first one's row on disk and in the table."""
    timed = bench_dsa_decode.step_seconds
    calls = []

    def cut_on_second(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("cut by the time limit")
        return timed(*a, **kw)
    monkeypatch.setattr(bench_dsa_decode, "step_seconds", cut_on_second)
    try:
        bench_dsa_decode.main(QUICK + ["--models", "dense", "--out", str(tmp_path)])
    except KeyboardInterrupt:
        pass
    rows = json.loads((tmp_path / "dsa_decode_dense.json").read_text())["rows"]
    assert [(r["model"], r["b"], r["graph_breaks"]) for r in rows] == [("dense", 1, 0)]
    assert "| dense | eager | 1 |" in (tmp_path / "dsa_decode.md").read_text()
