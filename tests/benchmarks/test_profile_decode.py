"""profile_decode's bytes per operator, its per-kernel rows, and one whole profile of a tiny
`graphs` step (CPU)."""

import json

import pytest
import torch

from profile_decode import kernel_bytes, kernel_times, markdown, op_bytes, profile_rows

BF16, F32, I64 = "c10::BFloat16", "float", "long int"


@pytest.mark.parametrize("name, shapes, dtypes, want", [
    # A [M, K] and B [K, N] read, C [M, N] written
    ("aten::mm", [[3, 5], [5, 7]], [BF16, BF16], 2 * (3 * 5 + 5 * 7 + 3 * 7)),
    ("aten::bmm", [[2, 3, 5], [2, 5, 7]], [F32, F32], 4 * (30 + 70 + 42)),
    # addmm(bias [N], A, B, beta, alpha)
    ("aten::addmm", [[7], [3, 5], [5, 7], [], []], [BF16, BF16, BF16, "Scalar", "Scalar"],
     2 * (7 + 3 * 5 + 5 * 7 + 3 * 7)),
    # other operators: their tensor arguments (a long index and a bf16 table)
    ("xpu_ops::store_kv_cache", [[4, 2, 8], [10], []], [BF16, I64, "Scalar"],
     2 * 64 + 8 * 10),
    ("aten::fill_", [[], []], ["Scalar", "Scalar"], None),
    ("aten::mm", [[3, 5], [5, 7]], ["c10::ComplexFloat"] * 2, None),  # unknown dtype
])
def test_op_bytes(name, shapes, dtypes, want):
    assert op_bytes(name, shapes, dtypes) == want


def test_cpu_matmul_profile_has_its_time_and_exact_bytes():
    a, b = torch.randn(64, 96), torch.randn(96, 32)
    step = lambda: a @ b  # noqa: E731
    times = kernel_times(step, "cpu", steps=3)
    nbytes = kernel_bytes(step, "cpu")
    assert times["aten::mm"][0] == 3 and times["aten::mm"][1] > 0
    assert nbytes["aten::mm"] == 4 * (64 * 96 + 96 * 32 + 64 * 32)
    rows = profile_rows(times, nbytes, 3, bandwidth=1e9)
    mm = next(r for r in rows if r["kernel"] == "aten::mm")
    assert mm["calls"] == 1 and mm["gb_s"] == pytest.approx(mm["bytes"] / mm["us"] / 1e3)
    assert abs(sum(r["share"] for r in rows) - 1) < 1e-9
    assert [r["us"] for r in rows] == sorted((r["us"] for r in rows), reverse=True)
    assert "| `aten::mm` | 1 |" in markdown(rows, "### head")


def test_profiles_graphs_at_a_batch_of_many_requests(tmp_path, monkeypatch, capsys):
    """An H200 crash at b = 64 (a Dynamo ConstraintViolationError): making the
    uncaptured forward switched the shared model's split op off before the captured steps ran.
    Tiny shapes; the pieces run without Inductor and the uncaptured step on Dynamo's eager
    backend, which is where the crash happened (Dynamo, not Inductor)."""
    import bench_model
    import profile_decode
    from compile.graphs import compile_model, full_and_piecewise
    monkeypatch.setattr(bench_model, "full_and_piecewise",
                        lambda m: full_and_piecewise(m, inductor=False))
    monkeypatch.setattr(bench_model, "compile_model",
                        lambda m, **kw: compile_model(m, backend="eager", **kw))
    profile_decode.main(["--device", "cpu", "--dtype", "float32", "--mode", "graphs",
                         "--layers", "1", "--hidden", "64", "--context", "8", "--batches", "4",
                         "--steps", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "profile_decode_b4.json").read_text())
    assert result["batch"] == 4 and result["mode"] == "graphs" and result["step_us"] > 0
    assert any(r["kernel"] == "aten::mm" and r["bytes"] for r in result["rows"]), result["rows"]
    assert "### graphs decode step, b=4" in capsys.readouterr().out
