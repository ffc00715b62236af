"""bench_attention's one-run table without a GPU: the table's rows and peers, the split
schedule A/B (each schedule planned in turn, the default restored), and the rendered tables
(the device named, a column per peer that ran, the split counts under the table)."""

import pytest

import bench_attention as b
from attention_calls import calls_table
from xpu_ops.triton import split_plan


def test_table_rows_carry_their_peers_targets_and_both_schedules():
    specs = {s["name"]: s for s in b.table_specs()}
    assert list(specs) == list(b.TABLE_ROWS) and list(specs)[-1].startswith("prefill")
    for name, spec in specs.items():
        splits = b.TABLE_SPLITS.get(name, ())
        assert spec["sweep"] == tuple((f"splits={n}", {"num_splits": n}) for n in splits)
        assert spec["variants"] == () and spec["sweep_columns"]
        assert spec["peers"] == b.TABLE_ROWS[name][1]
        assert spec.get("schedules", ()) == (b.SCHEDULES if spec["kind"] == "bw" else ())
    assert "cudnn" in specs["prefill 8x4096 causal page 64"]["peers"]
    assert [c.block_n for _, c in specs["decode 64x4096 page 16"]["configs"]] == [32, 32, 64]


def test_schedule_ab_times_each_schedule_and_restores_the_default(monkeypatch):
    seen = []

    def launcher(w, causal, window):
        seen.append(split_plan.SCHEDULE)
        return lambda: None
    counts = {"waves": 8, "legacy": 5}
    monkeypatch.setattr(b, "launcher_fn", launcher)
    monkeypatch.setattr(b, "launched_paths", lambda fn: f"BLOCK_M=16, NUM_SPLITS="
                        f"{counts[split_plan.SCHEDULE]}, PAGE_TILES=True")
    monkeypatch.setattr(b, "measure", lambda fn: 0.25 if split_plan.SCHEDULE == "waves" else 0.4)
    timed = {}
    note = b.schedule_ab({}, False, -1, b.SCHEDULES, timed)
    assert seen == ["waves", "legacy"] and split_plan.SCHEDULE == "waves"
    assert timed == {"waves plan": 0.25, "legacy plan": 0.4}
    assert note == "split counts: waves 8, legacy 5"


def test_tables_name_the_peers_that_ran_and_the_split_counts():
    row = b.Row("decode 8x32768 (split-KV)", "bw", ">= 1.00 flashinfer", 0.30, 1.0e9, 0.0,
                {"sdpa": 0.27, "cudnn": None, "flashinfer": 0.36},
                {"waves plan": 0.30, "legacy plan": 0.40}, ["split counts: waves 8, legacy 5"])
    md = b.table([row], 4.0, 700.0, "Date x, GPU NVIDIA H100 80GB HBM3 (132 multiprocessors)")
    head = next(line for line in md.splitlines() if line.startswith("| workload"))
    assert head.endswith("| x sdpa | x cudnn | x flashinfer |"), head
    assert "| yes (1.20, op) | 0.3000 (0.83) | 0.4000 (0.62) | 0.90 | missing | 1.20 |" in md
    assert md.rstrip().endswith("- decode 8x32768 (split-KV): split counts: waves 8, legacy 5")
    calls = calls_table([dict(workload="eager decode call b=1, ctx 1024 (host + device)",
                              triton=50.0, sdpa=20.0, flashinfer=None)], "GPU H200")
    assert "| 50.0 | 20.0 | missing | 0.40 | - | <= 2x SDPA: no |" in calls


@pytest.mark.parametrize("spec", ["bogus@16,64,2,4", "page_tiles@16,64"])
def test_bad_config_spec_is_refused(spec):
    with pytest.raises(SystemExit):
        b.parse_configs(spec)


def test_op_call_rows_run_on_the_cpu_interpreter():
    """The op-call rows' eager part end to end (the triton op and SDPA on a tiny cache, Triton
    through its interpreter; FlashInfer and the CUDA graph row missing on the CPU)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(root / "benchmarks"), str(root)])
    code = ("import json; from attention_calls import call_rows; print(json.dumps(call_rows("
            "context=32, page=16, layers=2, warmup=1, iters=1, device='cpu')))")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path))
    eager, eager_4d, graphed = json.loads(done.stdout.strip().splitlines()[-1])
    assert eager["triton"] > 0 and eager["sdpa"] > 0 and eager["flashinfer"] is None
    assert eager_4d["triton"] > 0 and eager_4d["sdpa"] == eager["sdpa"]
    assert "4-D q" in eager_4d["workload"] and eager_4d["workload"].startswith("eager")
    assert graphed["triton"] is None and graphed["sdpa"] is None
    assert "ctx 32" in eager["workload"] and "2 calls on 2 caches" in graphed["workload"]


def test_table_patches_name_existing_launcher_constants():
    from xpu_ops.triton import paged_attention as pa
    for name, patches in b.TABLE_PATCHES.items():
        assert name in b.TABLE_ROWS
        for label, values in patches:
            assert all(hasattr(pa, k) for k in values), (label, values)
    spec = next(s for s in b.table_specs() if s["name"] == "decode 64x4096 page 16")
    assert spec["patches"] == b.TABLE_PATCHES["decode 64x4096 page 16"]
