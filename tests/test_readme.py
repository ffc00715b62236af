"""The README as a new user meets it: at most 1,500 words, every link resolves, every Python
block runs as written, every shell block runs (the slow commands in their ``--help`` form), and
its test command is the one CI runs. ``docs/USAGE.md``'s Python blocks run too.

Shell lines that start with ``bash scripts/with-env.sh`` / ``with-sglang.sh`` run as written
when this checkout's ``.venv`` is set up (CI); otherwise (a developer's worktree using another
environment) the wrapper is dropped and the rest runs with this interpreter's environment.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
USAGE = (ROOT / "docs" / "USAGE.md").read_text(encoding="utf-8")
WRAPPERS = ("bash scripts/with-env.sh ", "bash scripts/with-sglang.sh ")
# Commands that take minutes (the default model, the whole suite): checked as `<command> --help`.
SLOW = (re.compile(r"python -m compile generate(?!.*--model tiny)"),
        re.compile(r"python -m pytest"))


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


def shell_lines() -> list[str]:
    return [line.split("  #")[0].strip() for block in blocks(README, "bash")
            for line in block.splitlines() if line.strip()]


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT)}


def test_readme_is_short_and_its_links_resolve():
    words = len(README.split())
    assert words <= 1500, f"README.md has {words} words; expected at most 1500"
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        assert (ROOT / target).exists(), target


def test_docs_links_resolve():
    """Relative links in docs/*.md resolve from docs/ (as GitHub renders them)."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if target != "..." and not re.match(r"[a-z]+://", target):
                assert (page.parent / target).exists(), (page.name, target)


def test_ci_runs_the_readme_test_command():
    tests = [line for line in shell_lines() if "pytest" in line]
    assert len(tests) == 1, tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^{re.escape(tests[0])}$", ci, re.M), (tests[0], ci)


@pytest.mark.parametrize("source", [*blocks(README, "python"), *blocks(USAGE, "python")],
                         ids=lambda s: s.splitlines()[-1][:40])
def test_python_blocks_run(source):
    proc = subprocess.run([sys.executable, "-c", source], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("line", shell_lines())
def test_shell_lines_run(line):
    command = line
    if not (ROOT / ".venv" / ".xpu-ops-installed").is_file():
        command = next((line[len(w):] for w in WRAPPERS if line.startswith(w)), line)
    if any(p.search(command) for p in SLOW):
        command += " --help"
    proc = subprocess.run(command, shell=True, cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-3000:])
