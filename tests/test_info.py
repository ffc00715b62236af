"""``python -m xpu_ops info``: it reports what a call would actually run."""

import io
import re

import pytest

import xpu_ops
from xpu_ops import providers
from xpu_ops.__main__ import info, main


def _info(*device_types):
    buf = io.StringIO()
    info(list(device_types), out=buf)
    return buf.getvalue()


def test_reports_reference_on_cpu_for_every_op():
    text = _info("cpu")
    for packet in xpu_ops.REGISTERED_OPS:
        name = packet._qualified_op_name.split("::")[-1]
        assert f"{name:30s} -> reference" in text


def test_forced_provider_that_cannot_run_is_reported_as_an_error(xpu_env):
    xpu_env("TRITON_INTERPRET", None)
    xpu_env("XPU_OPS_PROVIDER", "triton")
    if providers.candidates("flash_attn_with_kvcache", "cpu")[1][1] is None:
        pytest.skip("triton runs on cpu in this process (interpreter enabled)")
    text = _info("cpu")
    assert "-> error: forced provider triton cannot run on cpu" in text
    assert "-> triton" not in text


def test_forced_reference_is_marked_forced():
    with xpu_ops.use_provider("reference"):
        assert "flash_attn_with_kvcache        -> reference (forced)" in _info("cpu")


def test_unknown_provider_exits_2_with_a_message(xpu_env, capsys):
    xpu_env("XPU_OPS_PROVIDER", "bogus")
    assert main(["info", "--device", "cpu"]) == 2
    assert "'bogus' is not a provider" in capsys.readouterr().err


def test_unknown_device_type_exits_2_naming_the_choices(capsys):
    # The ops have kernels for cpu, cuda and xpu only: any other device type is a typo.
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--device", "bogus"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "argument --device: invalid choice: 'bogus'" in err and "'xpu'" in err, err


def test_a_closed_pipe_ends_quietly():
    # ``python -m xpu_ops info | head``: the reader is gone before the first line is written.
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "xpu_ops", "info"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_each_skip_reason_is_printed_once_and_lines_stay_short():
    # before: every op's line repeated the same reasons, 330 characters long
    text = _info("cpu")
    assert max(len(line) for line in text.splitlines()) <= 100, text
    reasons = re.findall(r"^  \[(\d+)\] (\w+): ", text, re.M)
    assert reasons and len({n for n, _ in reasons}) == len(reasons), text
    for n, _ in reasons:  # every numbered reason is referred to by an op line
        assert re.search(rf"-> \w+ .*\(skipped .*\[{n}\]", text), text


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "provider" in out, out


def test_fallback_lines_stay_short(monkeypatch):
    # a provider's decline reason can be long (a page size, a dtype and the rule together)
    reason = "page_size 3 is not a power of two; this kernel path tiles pages " * 2
    monkeypatch.setattr(providers, "_fallbacks", {("flash_attn_with_kvcache", "triton", reason): 2})
    text = _info("cpu")
    assert "fallback: flash_attn_with_kvcache: triton declined 2 call(s)" in text
    assert max(len(line) for line in text.splitlines()) <= 100, text
