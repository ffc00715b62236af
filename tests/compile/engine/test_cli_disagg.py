"""``python -m compile generate --disaggregation``: the two-process demo and its argument errors.

``--disaggregation both`` spawns a prefill and a decode process (gloo on the CPU, page size 16
on the prefill side, 1 on the decode side); rank 0 gets the decode side's tokens back, so
``--verify`` compares the disaggregated greedy tokens with ``transformers``' own ``generate``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from compile.__main__ import main
from compile.engine.cli_disagg import transfer_summary


def test_both_roles_verify_against_transformers():
    argv = [sys.executable, "-m", "compile", "generate", "--model", "tiny", "--device", "cpu",
            "--disaggregation", "both", "--verify", "--no-progress", "--prompt", "Hello there",
            "--prompt", "xy", "--max-new-tokens", "4", "--page-size", "16",
            "--decode-page-size", "1", "--threads", "1"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "verify: all prompts match" in run.stdout
    assert "transfer: 2 requests" in run.stdout
    assert "decode: 6 tokens" in run.stdout  # 2 x 4 tokens, the first of each from prefill


@pytest.mark.parametrize("env, extra, message", [
    ({}, ["--disaggregation", "prefill"], "expected an even number of processes"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, ["--disaggregation", "decode"],
     "rank 0 of 2 has the prefill role"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, ["--disaggregation", "prefill", "--tp", "2"],
     "expected --tp 1 --dcp 1"),
])
def test_role_errors(monkeypatch, capsys, env, extra, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "tiny", "--device", "cpu", "--prompt", "hi", *extra])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_transfer_summary_means():
    log = [[0, 10, 2**20, 0.002], [1, 5, 2**20, 0.004]]
    line = transfer_summary(log, prefill_seconds=0.5, n=2, pack_seconds=0.001)
    assert line == ("transfer: 2 requests, 2.00 MiB, 3.00 ms per request (receive + write), "
                    "pack 0.50 ms; prefill 250.00 ms per request")
