"""The kernels' table's measured limits without a GPU: the host-time split of a call around its
Triton launches, the launch's parameter counts, occupancy from a device's limits (numbers from
the CUDA occupancy rules, worked out by hand here), compiled-kernel rows from a stand-in
``CompiledKernel``, the eager call's report end to end with a stand-in launch, and the decode
step host time rows. One ``gpu`` test reads a real compiled kernel."""

import json
import time
import types

import pytest
import torch

import kernel_limits as kl
from xpu_ops.triton import _common

from ..markers import GPU_DEVICE

triton = pytest.importorskip("triton")
tl = triton.language
CPU = torch.device("cpu")
# H100 SXM: 65536 registers, 228 KiB shared memory, 2048 threads, 32 blocks per SM
H100 = dict(sms=132, regs=65536, threads=2048, smem=233472, smem_block=232448, warp=32,
            blocks=32, reserved_smem=1024)


@triton.jit
def _two_args(x, n, BLOCK: tl.constexpr):
    pass


@triton.jit
def _fill(x, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + offs, 1.0, mask=offs < n)


def _spin(us: float) -> None:
    end = time.perf_counter_ns() + us * 1e3
    while time.perf_counter_ns() < end:
        pass


def test_host_breakdown_splits_a_call_around_its_launch():
    def slow_launch(kernel, grid, device, args, kwargs):
        _spin(3000)

    def call():
        _spin(2000)                                   # (a) before the launch
        _common.launch(_two_args, (1,), CPU, None, 1, BLOCK=4)
        _spin(1000)                                   # (c) after it
    real = _common._launch
    got = kl.host_breakdown(call, lambda: None, warmup=1, iters=7, launch=slow_launch)
    assert _common._launch is real
    assert got["launches"] == 1
    assert got["python"] >= 2000 and got["triton"] >= 3000 and got["other"] >= 1000, got
    assert got["python"] < got["triton"] and got["other"] < got["python"], got
    assert got["host"] >= 6000 and got["with_sync"] >= got["host"]
    mocked = kl.host_breakdown(call, lambda: None, warmup=0, iters=3, launch=kl.NO_LAUNCH)
    assert mocked["triton"] < 1000 and mocked["host"] >= 3000, mocked


class _Compiled34:
    """A Triton 3.4+ ``CompiledKernel``: the launcher in ``_run``, behind a ``run`` property."""

    def __init__(self, launcher):
        self._run = launcher

    @property
    def run(self):
        return self._run


@pytest.mark.parametrize("style", ["3.4+", "3.3"])
def test_host_breakdown_splits_the_launch_into_binder_and_driver(style):
    def launcher(*args):
        _spin(500)
    compiled = _Compiled34(launcher) if style == "3.4+" else types.SimpleNamespace(run=launcher)

    def fake_launch(kernel, grid, device, args, kwargs):
        _spin(1500)                                   # Triton's binder and cache lookup
        compiled.run(1, 1, 1)
        return compiled

    def call():
        _common.launch(_two_args, (1,), CPU, None, 1, BLOCK=4)
    got = kl.host_breakdown(call, lambda: None, warmup=1, iters=5, launch=fake_launch)
    assert got["binder"] >= 1500 and 500 <= got["driver"] < got["binder"], got
    assert got["triton"] >= 2000
    assert compiled.run is launcher  # unwrapped again
    no_driver = kl.host_breakdown(call, lambda: None, warmup=1, iters=2, launch=kl.NO_LAUNCH)
    assert no_driver["binder"] is None and no_driver["driver"] is None


def test_launch_signature_counts_runtime_parameters_constexprs_and_options():
    def call():
        _common.launch(_two_args, (1,), CPU, None, 7, BLOCK=4, num_warps=2)
    [sig] = kl.launch_signature(call, kl.NO_LAUNCH)
    assert sig == dict(kernel="_two_args", runtime=2, constexpr=1, positional=2, keyword=1,
                       options=["num_warps"])
    # the interpreter's kernels have no ``params``: the annotations decide
    assert kl.kernel_params(types.SimpleNamespace(fn=_two_args.fn)) == {
        "x": False, "n": False, "BLOCK": True}


@pytest.mark.parametrize("regs, shared, warps, expected", [
    (255, 0, 8, (1, "registers")),           # 8192 registers a warp: 8 warps fit
    (128, 100 * 1024, 4, (2, "shared memory")),  # 233472 // (102400 + 1024) = 2 (regs: 4)
    (32, 0, 1, (32, "blocks per SM")),       # regs and threads allow 64
    (32, 0, 32, (2, "registers, threads")),  # 1024 registers a warp: 64 warps; 1024 threads
    (64, 240 * 1024, 4, (0, "shared memory (over the per-block maximum)")),
])
def test_occupancy_follows_the_cuda_limits(regs, shared, warps, expected):
    assert kl.occupancy(regs, shared, warps, H100) == expected


def test_occupancy_with_no_known_limit_is_unknown():
    assert kl.occupancy(None, None, 4, {}) == (None, "unknown")


def test_launch_limits_reads_the_compiled_kernel_of_each_launch():
    compiled = types.SimpleNamespace(n_regs=128, n_spills=3, metadata=types.SimpleNamespace(
        shared=100 * 1024, num_warps=4, num_stages=3))

    def call():
        _common.launch(_two_args, (64, 16, 1), CPU, None, 1, BLOCK=4)
        _common.launch(_two_args, (8,), CPU, None, 1, BLOCK=4)   # the interpreter's: no row
    results = iter([compiled, None])
    real = _common._launch
    _common._launch = lambda *a: next(results)
    try:
        [row] = kl.launch_limits("prefill: op", call, H100)
    finally:
        _common._launch = real
    assert row == dict(label="prefill: op", kernel="_two_args", grid=(64, 16, 1), blocks=1024,
                       regs=128, spills=3,
                       shared=100 * 1024, warps=4, stages=3, blocks_per_sm=2,
                       limit="shared memory", waves=pytest.approx(1024 / (2 * 132)))


def test_profile_top_ranks_own_time_and_sums_it_per_area():
    def call():
        _spin(300)
        sum(range(10))
    got = kl.profile_top(call, calls=5, top=3)
    assert len(got["rows"]) == 3
    own = [r["own_us"] for r in got["rows"]]
    assert own == sorted(own, reverse=True)
    assert any("(_spin)" in r["function"] and r["ncalls"] == 1 for r in got["rows"]), got
    assert sum(got["areas"].values()) >= 300


def test_eager_call_report_on_the_cpu(xpu_env, tmp_path):
    """The op-call rows' eager call through the real op (Triton provider, its launch a
    stand-in): both forms, real and no-op launch, the signature, the profile, the files."""
    from limits_report import LimitsReport
    xpu_env("TRITON_INTERPRET", "1")
    report = LimitsReport("CPU test", None)
    report.eager_call(context=32, warmup=1, iters=2, device="cpu", profile_calls=2,
                      launch=lambda *a: _spin(50))
    assert [(c["form"], c["launch"]) for c in report.calls] == [
        ("packed", "real"), ("packed", "no-op"), ("4-D", "real"), ("4-D", "no-op")]
    assert all(c["launches"] >= 1 and c["python"] > 0 for c in report.calls)
    assert report.calls[0]["triton"] >= 50 > report.calls[1]["triton"]
    [sig] = report.signature
    assert sig["kernel"].startswith("_paged_attention") and sig["runtime"] > 0
    assert sig["constexpr"] > 0 and "num_warps" in sig["options"]
    report.kernel_rows("no limits: skipped", lambda: None)
    assert report.kernels == []
    report.write(str(tmp_path))
    md = (tmp_path / "limits.md").read_text()
    assert "| packed | no-op |" in md and "| 4-D | real |" in md
    assert f"{sig['runtime']} runtime parameters and {sig['constexpr']} constexprs" in md
    assert json.loads((tmp_path / "limits.json").read_text())["calls"] == report.calls


def test_step_host_rows_and_the_target(monkeypatch):
    import compiled_step_host as c
    from compile.graphs import compile_model
    monkeypatch.setattr(c, "make_forward", lambda model, mode: model if mode == "eager"
                        else compile_model(model, backend="eager", fullgraph=True))
    rows = c.step_host_rows(layers=1, hidden=64, context=16, warmup=1, steps=2, rounds=1,
                            device="cpu", dtype=torch.float32)
    assert [r["mode"] for r in rows] == ["compiled", "eager"]
    assert all(r["step"] >= r["host"] > 0 and r["syncs"] is None for r in rows)
    table = c.step_host_table([dict(rows[0], layers=16, host=2.5),
                               dict(rows[0], layers=16, host=3.5), rows[1]])
    lines = [line for line in table.splitlines() if line.startswith("| compiled")]
    assert lines[0].endswith("| - | <= 3 ms: yes |") and lines[1].endswith("<= 3 ms: no |")
    assert table.splitlines()[-1].endswith("| - | - |")


@pytest.mark.gpu
@pytest.mark.skipif(GPU_DEVICE != "cuda", reason="reads CUDA device limits")
def test_launch_limits_of_a_real_compiled_kernel():
    x = torch.zeros(1024, device="cuda")
    rows = kl.launch_limits("real", lambda: _common.launch(_fill, (4,), x.device, x, 200,
                                                          BLOCK=64, num_warps=4),
                            kl.device_limits())
    [row] = rows
    assert row["regs"] and row["regs"] > 0 and row["spills"] == 0 and row["warps"] == 4
    assert row["grid"] == (4,) and row["blocks_per_sm"] >= 1 and 0 < row["waves"] < 1
    assert x[:200].eq(1).all() and x[200:].eq(0).all()


def test_a_failed_part_is_noted_and_the_rest_written(tmp_path):
    from limits_report import LimitsReport
    report = LimitsReport("GPU X", H100, "same process")

    def broken():
        raise RuntimeError("no compiler here")
    report.guarded("decode step host time", broken, str(tmp_path))
    md = (tmp_path / "limits.md").read_text()
    assert md.startswith("Measured limits, GPU X (same process).")
    assert "- skipped: decode step host time: RuntimeError: no compiler here" in md


def test_the_limit_rows_are_rows_of_the_kernels_table():
    import bench_attention as b
    assert set(b.LIMIT_ROWS) <= set(b.TABLE_ROWS)
    assert b.new_limits_report(False) is None


def test_kernels_table_main_writes_the_limits_of_its_rows(monkeypatch, tmp_path):
    """``bench_attention --kernels-table``'s wiring without a GPU: every timing stubbed, the
    rows' kernel reads, the eager call and the step host time land in limits.md."""
    import sys
    import bench_attention as b
    import limits_report

    def fake_row(name, *args, limits=None, **kwargs):
        if limits is not None:
            limits.kernels.append(dict(label=f"{name}: op", kernel="k", grid=(1,), blocks=1,
                                       regs=1,
                                       spills=0, shared=0, warps=4, stages=2, blocks_per_sm=1,
                                       limit="registers", waves=0.1))
        return b.Row(name, "flops", "-", 1.0, 1.0, 1.0, {})
    monkeypatch.setattr(b, "ceilings", lambda: (3.0, 700.0))
    monkeypatch.setattr(b, "device_line", lambda: "Stub (1 multiprocessors)")
    monkeypatch.setattr(b, "run_attention", lambda name, **kw: fake_row(name, **kw))
    monkeypatch.setattr(b, "run_mla", fake_row)
    monkeypatch.setattr(b, "write_results", lambda *a, **kw: None)
    monkeypatch.setattr(b, "late_variants", lambda spec, row: None)
    monkeypatch.setattr("kernel_limits.device_limits", lambda index=0: H100)
    monkeypatch.setattr("attention_calls.call_rows", lambda: [])
    monkeypatch.setattr(limits_report.LimitsReport, "eager_call",
                        lambda self: self.calls.append(dict(
                            form="packed", launch="real", context=1024, page=16, iters=1,
                            host=90.0, python=40.0, triton=45.0, binder=20.0, driver=25.0,
                            other=5.0, launches=1, with_sync=95.0)))
    monkeypatch.setattr(limits_report.LimitsReport, "step_host",
                        lambda self, out: setattr(self, "steps", [dict(
                            mode="compiled", layers=16, batch=1, context=1024, host=2.0,
                            cpu=1.9, step=2.5, syncs=0)]))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--kernels-table", "--out",
                                      str(tmp_path)])
    b.main()
    md = (tmp_path / "limits.md").read_text()
    assert md.startswith("Measured limits, GPU Stub (1 multiprocessors) (same process")
    assert "| MLA decode H128 R512 r64 64x4096: op | k | 1 (1) | 4 | 2 | 1 | 0 | 0.0 | " \
        "1 (registers) | 0.10 |" in md
    assert "| prefill 8x4096 causal page 64: op | k |" in md
    assert "decode 64x4096 page 16: op" not in md                # met: not read
    assert "| packed | real | 90.0 | 40.0 | 45.0 (20.0 + 25.0) | 5.0 | 1 | 95.0 |" in md
    assert "| compiled | 2.00 | 1.90 | 2.50 | 0 | <= 3 ms: yes |" in md
