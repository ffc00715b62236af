"""bench_decode_graph: its byte formula and one CPU run through the Triton interpreter (every
variant computes the same attention)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from bench_decode_graph import D, HKV, kv_bytes

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_decode_graph.py"


def test_kv_bytes_is_k_and_v_once():
    assert kv_bytes(3, 100, 2) == 2 * 3 * 100 * HKV * D * 2


def test_cpu_quick_run_writes_the_table(tmp_path):
    path = os.pathsep.join([str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out",
                    str(tmp_path)], check=True, env=env, capture_output=True, timeout=600)
    rows = json.loads((tmp_path / "decode_graph.json").read_text())
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 48), (2, 48)]
    for r in rows:
        assert set(r["us"]) == {"auto", "s=1", "s=4", "cfg=16,16,1,1"}
        assert max(r["max_diff"].values()) < 2e-2  # bf16 outputs of one attention
    assert "| b | context | planned splits |" in (tmp_path / "decode_graph.md").read_text()
