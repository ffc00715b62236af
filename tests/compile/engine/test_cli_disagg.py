"""``python -m compile generate --disaggregation``: the two-process demo and its argument errors.

``--disaggregation both`` spawns a prefill and a decode process (gloo on the CPU, page size 16
on the prefill side, 1 on the decode side); rank 0 gets the decode side's tokens back, so
``--verify`` compares the disaggregated greedy tokens with ``transformers``' own ``generate``.
Four torchrun-style ranks (two pairs) split the prompts and rank 0 verifies every one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from compile.__main__ import main
from compile.engine.cli_disagg import _wait, free_port, pair_prompts, role_argv, transfer_summary
from compile.engine.disaggregation import ROLES


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
    # torchrun's c10d rendezvous ranks nodes as they join, whatever --node-rank says
    ({"WORLD_SIZE": "2", "RANK": "0"}, ["--disaggregation", "decode"],
     "--master-addr HOST --master-port PORT"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, ["--disaggregation", "prefill", "--tp", "2"],
     "expected --tp 1 --dcp 1"),
    ({}, ["--transfer-backend", "gloo"], "argument --transfer-backend: sets the transfer of a "
     "disaggregated run; expected --disaggregation prefill|decode|both beside it"),
    ({}, ["--transfer-timeout", "5"], "got --transfer-timeout 5 alone"),
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


def test_pair_prompts_deals_the_prompts_round_robin():
    assert [pair_prompts(5, r, 4) for r in range(4)] == [[0, 2, 4], [1, 3], [0, 2, 4], [1, 3]]
    assert pair_prompts(1, 1, 4) == [] and pair_prompts(3, 1, 2) == [0, 1, 2]


def test_two_pairs_split_the_prompts_and_rank_zero_verifies_them_all():
    # torchrun-style: 4 ranks, prefill 0 and 1, decode 2 and 3; pair 0 serves prompts 0 and 2,
    # pair 1 prompt 1; rank 0 gathers every output and verifies all three
    argv = [sys.executable, "-m", "compile", "generate", "--model", "tiny", "--device", "cpu",
            "--verify", "--no-progress", "--prompt", "Hello there", "--prompt", "xy",
            "--prompt", "abc", "--max-new-tokens", "3", "--page-size", "4",
            "--decode-page-size", "1", "--threads", "1", "--disaggregation"]
    port, procs = free_port(), []
    for rank in range(4):
        env = {**os.environ, "PYTHONPATH": os.getcwd(), "RANK": str(rank), "WORLD_SIZE": "4",
               "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(argv + [("prefill", "decode")[rank // 2]], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    runs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-2000:] for _, err in runs]
    rank0, rank1 = runs[0][0], runs[1][0]
    assert "verify: all prompts match" in rank0 and rank0.count("verify: prompt ") == 3, rank0
    assert "transfer: 2 requests" in rank0 and "transfer: 1 requests" in rank1, (rank0, rank1)


def test_role_argv_names_the_role_and_stages_one_gpu_through_gloo():
    argv = ["generate", "--disaggregation", "both", "--model", "tiny"]
    assert role_argv(argv, "decode", 2) == ["generate", "--disaggregation", "decode", "--model",
                                            "tiny"]
    assert role_argv(["generate", "--disaggregation=both"], "prefill", 1) == [
        "generate", "--disaggregation=prefill", "--transfer-backend", "gloo"]


def test_wait_returns_the_first_failing_rank_status(capsys):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        assert _wait([failing, sleeper]) == 3
    finally:
        sleeper.kill()
        sleeper.wait()
    assert "the prefill rank exited with status 3" in capsys.readouterr().err


def test_requests_failed_over_the_transfer_make_the_prefill_rank_exit_1():
    # torchrun-style ranks with another --dtype each: the decode rank refuses every request
    # (its KV rows have twice the bytes) and says why; the prefill rank, which prints the
    # outputs, counts them failed and exits 1 (not 0 with truncated texts)
    argv = [sys.executable, "-m", "compile", "generate", "--model", "tiny", "--device", "cpu",
            "--no-progress", "--prompt", "Hello there", "--prompt", "xy", "--max-new-tokens",
            "3", "--threads", "1", "--transfer-timeout", "60", "--disaggregation"]
    port, procs = free_port(), []
    for rank, (role, dtype) in enumerate((("prefill", "bfloat16"), ("decode", "float32"))):
        env = {**os.environ, "PYTHONPATH": os.getcwd(), "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(argv + [role, "--dtype", dtype], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    (out0, err0), (_, err1) = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [1, 0], (err0[-2000:], err1[-2000:])
    assert err1.count("state does not match this engine's pools") == 2, err1[-2000:]
    assert "2 of 2 requests failed" in err0, err0[-2000:]
    assert "transfer: no request transferred" in out0


# a peer that joins the process group and exits at once
GONE_PEER = ("import os, datetime, torch.distributed as dist; "
             "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=60)); "
             "os._exit(0)")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_peer_that_exits_fails_the_requests_in_one_line_and_exit_1(role):
    argv = [sys.executable, "-m", "compile", "generate", "--model", "tiny", "--device", "cpu",
            "--no-progress", "--prompt", "Hello there", "--prompt", "xy", "--max-new-tokens",
            "3", "--threads", "1", "--transfer-timeout", "60", "--disaggregation", role]
    port, procs = free_port(), []
    rank = ROLES.index(role)
    for r, cmd in ((rank, argv), (1 - rank, [sys.executable, "-c", GONE_PEER])):
        env = {**os.environ, "PYTHONPATH": os.getcwd(), "RANK": str(r), "WORLD_SIZE": "2",
               "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    _, err = procs[0].communicate(timeout=300)
    procs[1].communicate(timeout=60)
    assert procs[0].returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    peer = ROLES[1 - rank]
    assert f"the {peer} rank {1 - rank} is gone" in err, err[-3000:]
    assert "2 of 2 requests failed" in err, err[-3000:]


def test_two_pairs_with_a_rank_gone_end_in_one_line_and_exit_1():
    # 4 torchrun-style ranks, decode rank 3 exits at once: pair 1's prefill rank says its peer
    # is gone; every rank's gather of the outputs fails in one line; the three exit 1
    argv = [sys.executable, "-m", "compile", "generate", "--model", "tiny", "--device", "cpu",
            "--no-progress", "--prompt", "Hello there", "--prompt", "xy", "--prompt", "abc",
            "--max-new-tokens", "3", "--threads", "1", "--transfer-timeout", "60",
            "--disaggregation"]
    port, procs = free_port(), []
    for rank in range(4):
        env = {**os.environ, "PYTHONPATH": os.getcwd(), "RANK": str(rank), "WORLD_SIZE": "4",
               "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        cmd = ([sys.executable, "-c", GONE_PEER] if rank == 3
               else argv + [("prefill", "decode")[rank // 2]])
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs[:3]] == [1, 1, 1], [e[-2000:] for e in errs]
    assert not any("Traceback" in e for e in errs), [e[-2000:] for e in errs]
    assert "the decode rank 3 is gone" in errs[1], errs[1][-2000:]
    assert all("gathering every pair's outputs on rank 0 failed" in e for e in errs[:3]), errs
