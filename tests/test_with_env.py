"""``scripts/with-env.sh`` on a throw-away copy of the checkout with stand-ins for ``python3``
and ``pip``: the command runs in the caller's directory with the checkout importable, and the
set-up tries the CPU build of torch (configured sources, then PyTorch's CPU index) before PyPI's
build, saying which it installed."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = """#!/usr/bin/env bash
# python3 -m venv DIR: make DIR/bin/pip (logs its arguments; fails for a +cpu torch when asked)
# and DIR/bin/python (prints a version)
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin"
  cat > "$3/bin/pip" <<'PIP'
#!/usr/bin/env bash
echo "pip $*" >> "$PIP_LOG"
case "$*" in *"+cpu"*) [ -n "${NO_CPU_BUILD:-}" ] && exit 1 ;; esac
exit 0
PIP
  printf '#!/usr/bin/env bash\\necho 2.13.0\\n' > "$3/bin/python"
  chmod +x "$3/bin/pip" "$3/bin/python"
fi
"""


def _checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "with-env.sh", root / "scripts")
    shutil.copy(ROOT / "pyproject.toml", root)
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "python3").write_text(FAKE_PYTHON)
    (tools / "python3").chmod((tools / "python3").stat().st_mode | stat.S_IEXEC)
    return root


def _run(tmp_path: Path, root: Path, *command: str, **env: str):
    caller = tmp_path / "elsewhere"
    caller.mkdir(exist_ok=True)
    full_env = {**os.environ, "PATH": f"{tmp_path / 'tools'}:{os.environ['PATH']}",
                "PIP_LOG": str(tmp_path / "pip.log"), "PYTHONPATH": "/some/where", **env}
    return subprocess.run(["bash", str(root / "scripts" / "with-env.sh"), *command], cwd=caller,
                          env=full_env, capture_output=True, text=True, timeout=60)


def test_runs_in_the_callers_directory_with_the_checkout_on_the_path(tmp_path):
    root = _checkout(tmp_path)
    proc = _run(tmp_path, root, "bash", "-c", 'echo "$PWD|$PYTHONPATH"')
    assert proc.returncode == 0, proc.stderr
    cwd, path = proc.stdout.strip().split("|")
    assert Path(cwd) == tmp_path / "elsewhere", proc.stdout     # before: the checkout's root
    assert path == f"{root}:/some/where", proc.stdout


@pytest.mark.parametrize("no_cpu_build", [False, True])
def test_torch_cpu_build_first_then_pypi_and_says_which(tmp_path, no_cpu_build):
    root = _checkout(tmp_path)
    proc = _run(tmp_path, root, "true", **({"NO_CPU_BUILD": "1"} if no_cpu_build else {}))
    assert proc.returncode == 0, proc.stderr
    torch_calls = [line for line in (tmp_path / "pip.log").read_text().splitlines()
                   if "torch==" in line]
    if no_cpu_build:
        assert len(torch_calls) == 3, torch_calls
        assert "torch==2.13.0+cpu" in torch_calls[0] and "download.pytorch.org/whl/cpu" not in \
            torch_calls[0]
        assert "--extra-index-url https://download.pytorch.org/whl/cpu" in torch_calls[1]
        assert torch_calls[2].endswith(" torch==2.13.0"), torch_calls
        assert "installing PyPI's torch==2.13.0 instead" in proc.stderr, proc.stderr
        assert "installed torch 2.13.0 from PyPI" in proc.stderr, proc.stderr
    else:
        assert len(torch_calls) == 1, torch_calls
        assert "installed torch 2.13.0+cpu (CPU build) from pip's configured sources" in \
            proc.stderr, proc.stderr
    assert (root / ".venv" / ".xpu-ops-installed").is_file()
    again = _run(tmp_path, root, "true")               # set up once: no pip call the 2nd time
    assert again.returncode == 0 and "[with-env]" not in again.stderr, again.stderr
