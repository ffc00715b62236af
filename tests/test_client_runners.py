"""The client-test runners' pieces (``scripts/``): device plumbing of sgl-kernel-xpu's tests,
per-function counts from outcome lines, shards, the switches-off copy only when a switch is on,
and one real job end to end (a tiny test file through the shim plugin)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import client_test_runs as runs  # noqa: E402
import plumb_xpu_tests  # noqa: E402
import run_sgl_kernel_tests  # noqa: E402


def test_plumbing_replaces_only_the_device():
    source = ('"""doc"""\nfrom __future__ import annotations\nimport torch\n'
              'x = torch.ones(2, device="xpu")\ny = torch.zeros(1).xpu()\n'
              "z = torch.device('xpu:1')\nif torch.xpu.is_available(): torch.xpu.synchronize()\n"
              "t = torch.accelerator.current_accelerator().type\nname = 'xpu_kernel'\n"
              'msg = "XPU not available"\n')
    text, n = plumb_xpu_tests.plumb(source)
    assert n == 6
    lines = text.splitlines()
    assert lines[2] == "import local_device  # xpu-ops: the local device for torch.xpu"
    assert 'device=local_device.DEVICE)' in text and ".to(local_device.DEVICE)" in text
    assert 'torch.device((local_device.DEVICE + ":1"))' in text
    assert "local_device.is_available(): local_device.synchronize()" in text
    assert "local_device.current_accelerator().type" in text
    assert "'xpu_kernel'" in text and '"XPU not available"' in text   # other strings stay
    compile(text, "plumbed", "exec")


def test_plumbing_gives_a_shadowed_device_local_the_local_device():
    source = ('device = utils.get_device()\n\ndef test_a():\n    device = device\n'
              'def test_b():\n    device = torch.device(f"{device}:0")\n'
              'def test_c(device):\n    other = device\n')
    text, n = plumb_xpu_tests.plumb(source)
    assert n == 2
    assert "    device = local_device.DEVICE\n" in text
    assert 'device = torch.device(f"{local_device.DEVICE}:0")' in text
    assert "device = utils.get_device()" in text and "    other = device" in text


def test_counts_one_outcome_per_test(tmp_path):
    lines = [("a.py::test_f[1]", "setup", "passed"), ("a.py::test_f[1]", "call", "passed"),
             ("a.py::test_f[2]", "call", "failed"), ("a.py::test_f[3]", "setup", "skipped"),
             ("a.py::T::test_g", "setup", "failed"), ("a.py::T::test_g", "teardown", "passed"),
             ("a.py::test_f[4]", "call", "passed"), ("a.py::test_f[4]", "teardown", "failed"),
             ("b.py", "collect", "failed")]
    path = tmp_path / "job.jsonl"
    path.write_text("".join(json.dumps({"nodeid": n, "when": w, "outcome": o,
                                        **({"message": "E   boom"} if o == "failed" else {})})
                            + "\n" for n, w, o in lines))
    table = runs.counts(path)
    assert {k: [v[o] for o in runs.OUTCOMES] for k, v in table.items()} == {
        "a.py::T.test_g": [0, 0, 1, 0], "a.py::test_f": [1, 1, 1, 1], "b.py::(import)": [0, 0, 1, 0]}
    assert table["a.py::test_f"]["first_failure"] == "E   boom"


def test_shards_and_switches(tmp_path):
    assert [j.name for j in runs.sharded("flash", ["f.py"], 3)] == [
        "flash_1of3", "flash_2of3", "flash_3of3"]
    assert [j.shard for j in runs.sharded("merge", ["m.py"], 1)] == [None]
    on = tmp_path / "on.py"
    on.write_text("X = 1\nDISABLE_SPLIT = True\nDISABLE_FP8 = True\n")
    copy = run_sgl_kernel_tests.switches_off_copy(on, tmp_path)
    assert "\nDISABLE_SPLIT = False\n" in copy.read_text()
    assert "\nDISABLE_FP8 = True\n" in copy.read_text()
    off = tmp_path / "off.py"
    off.write_text("X = 1\nDISABLE_SPLIT = False\nDISABLE_FP8 = True\n")
    assert run_sgl_kernel_tests.switches_off_copy(off, tmp_path) is None


def test_a_sharded_job_runs_through_the_shim(tmp_path):
    test_file = tmp_path / "test_tiny.py"
    test_file.write_text(
        "import pytest\nimport torch\nfrom sgl_kernel import merge_state_v2\n"
        "@pytest.mark.parametrize('i', range(6))\ndef test_merge(i):\n"
        "    v, s = torch.randn(2, 1, 4), torch.randn(2, 1)\n"
        "    out, lse = merge_state_v2(v, s, v, s)\n"
        "    assert torch.allclose(out, v, atol=1e-6) and i != 5\n")
    job = runs.sharded("tiny", [test_file], 2)[1]                 # tests 2, 4, 6 (i = 1, 3, 5)
    info = runs.run_job(job, tmp_path, workers=0, budget=120, extra=[])
    assert info["status"] == 1 and not info["timed_out"]
    table = runs.counts(tmp_path / "tiny_2of2.jsonl")
    assert {k: (v["passed"], v["failed"]) for k, v in table.items()} == {
        "test_tiny.py::test_merge": (2, 1)}


def test_collect_counts_a_shards_tests_without_running_them(tmp_path):
    test_file = tmp_path / "test_tiny.py"
    test_file.write_text("import pytest\n@pytest.mark.parametrize('i', range(7))\n"
                         "def test_x(i):\n    raise SystemExit(3)\n")
    assert runs.collect_job(runs.sharded("tiny", [test_file], 2)[1], []) == 3   # 2nd, 4th, 6th
    (tmp_path / "test_broken.py").write_text("import no_such_module\n")
    assert runs.collect_job(runs.Job("broken", (tmp_path / "test_broken.py",)), []) == -1


def test_times_sum_each_tests_phase_seconds(tmp_path):
    import client_test_times
    lines = [("d/t.py::f[1]", "setup", 0.5), ("d/t.py::f[1]", "call", 2.0),
             ("d/t.py::f[1]", "teardown", 0.25), ("d/t.py::f[2]", "call", 1.0)]
    path = tmp_path / "job.jsonl"
    path.write_text("".join(json.dumps({"nodeid": n, "when": w, "outcome": "passed",
                                        "seconds": s}) + "\n" for n, w, s in lines))
    assert client_test_times.job_times(path) == ("t.py", 2, 3.75)


def test_generated_copies_are_written_once_and_atomically(tmp_path):
    target = tmp_path / "copy.py"
    runs.write_if_changed(target, "x = 1\n")
    inode = target.stat().st_ino
    runs.write_if_changed(target, "x = 1\n")              # unchanged: the file is left alone
    assert target.stat().st_ino == inode
    runs.write_if_changed(target, "x = 2\n")              # changed: a new file renamed over it
    assert target.read_text() == "x = 2\n" and target.stat().st_ino != inode
    assert [p.name for p in tmp_path.iterdir()] == ["copy.py"]


def test_cpu_jobs_interpret_the_tests_triton_on_the_reference_provider(monkeypatch):
    """Without CUDA a job adds TRITON_INTERPRET=1 (the client tests' own Triton references) and
    XPU_OPS_PROVIDER=reference, unless the caller set them; with CUDA it adds nothing."""
    import torch
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("XPU_OPS_PROVIDER", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runs.device_env() == {"TRITON_INTERPRET": "1", "XPU_OPS_PROVIDER": "reference"}
    monkeypatch.setenv("XPU_OPS_PROVIDER", "triton")
    assert runs.device_env() == {"TRITON_INTERPRET": "1"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runs.device_env() == {}


def _gpu_parts_jobs(runner: str = "XPU") -> dict[str, list[str]]:
    """``{part: job names}`` of ``scripts/gpu_client_tests.sh``'s lanes of ``runner`` (``XPU``:
    sgl-kernel-xpu's, ``SGL``: sgl-kernel's), its ``$(fa ...)`` / ``$(so ...)`` shard lists
    spelled out."""
    import re
    import run_sgl_kernel_xpu_tests as xpu
    shards = {"fa": ("flash_attention", xpu.SHARDS["test_flash_attention.py"]),
              "so": ("flash_switches_off", run_sgl_kernel_tests.SWITCHES_OFF_SHARDS)}
    text = (SCRIPTS / "gpu_client_tests.sh").read_text()
    body = text[text.index('case "$PART" in'):]
    body = "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("#"))
    parts: dict[str, list[str]] = {}
    for part, block in re.findall(r"^(\d+)\)(.*?);;", body, flags=re.M | re.S):
        for jobs in re.findall(rf"lane \w+ \${runner} \d+ \d+ (\"[^\"]*\"|\S+)", block):
            jobs = re.sub(r"\$\((fa|so) ([\d ]+)\)", lambda m: ",".join(
                f"{shards[m[1]][0]}_{i}of{shards[m[1]][1]}" for i in m[2].split()),
                jobs.strip('"'))
            parts.setdefault(part, []).extend(j for j in jobs.split(",") if j)
    return parts


def _listed_once(expected: list[str], runner: str) -> None:
    listed = sorted(j for jobs in _gpu_parts_jobs(runner).values() for j in jobs)
    assert listed == sorted(expected), (sorted(set(expected) - set(listed)),
                                        sorted(set(listed) - set(expected)),
                                        sorted(j for j in set(listed) if listed.count(j) > 1))


def test_every_sgl_kernel_xpu_job_runs_in_exactly_one_gpu_part():
    import run_sgl_kernel_xpu_tests as xpu
    _listed_once([job.name for name in xpu.XPU_FILES
                  for job in runs.sharded(xpu.job_name(name), [], xpu.SHARDS.get(name, 1))],
                 "XPU")


def test_every_sgl_kernel_job_runs_in_exactly_one_gpu_part():
    """The default shards of every job (the switches-off copy included: sgl-kernel's file
    hard-codes DISABLE_PAGEDKV and DISABLE_SOFTCAP as True)."""
    sgl = run_sgl_kernel_tests
    _listed_once([job.name for name, n in (("flash", sgl.FLASH_SHARDS),
                                           ("flash_switches_off", sgl.SWITCHES_OFF_SHARDS),
                                           ("merge", 1), ("flashmla", sgl.FLASHMLA_SHARDS))
                  for job in runs.sharded(name, [], n)], "SGL")


def test_no_gpu_part_runs_both_flashmla_files():
    """Their fp8 cases take up to ~30 GB each: never side by side."""
    xpu, sgl = _gpu_parts_jobs("XPU"), _gpu_parts_jobs("SGL")
    assert not [p for p in xpu if any(j.startswith("flashmla_") for j in xpu[p])
                and any(j.startswith("flashmla_") for j in sgl.get(p, []))]
