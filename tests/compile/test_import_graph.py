"""The ``compile`` package has no import circle.

Two checks: the import graph read from the source (every ``import`` statement, those inside
functions included, so a circle hidden behind a deferred import is found too) has no cycle;
and the modules of the engine that were in circles import alone in a fresh interpreter (one
forked child per module from a parent that imported only torch, ``xpu_ops`` and
``transformers``, so no ``compile`` module is loaded first).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "compile"


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the ``compile`` package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(node: ast.AST, name: str, is_package: bool, known) -> set[str]:
    """Modules of ``known`` that the import statement ``node`` in module ``name`` names."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        parts = name.split(".")[:len(name.split(".")) - node.level + is_package]
        base = ".".join(parts + ([node.module] if node.module else []))
    found = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
    return found or ({base} if base in known else set())


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``compile`` modules it imports (at module level or inside functions)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        deps = set()
        for node in ast.walk(tree):
            deps |= _targets(node, name, path.name == "__init__.py", known)
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on_stack.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_reads_deferred_imports():
    graph = import_graph()
    # compile/__main__.py imports these inside functions only
    assert {"compile.engine.cli_models", "compile.models"} <= graph["compile.__main__"]
    assert "compile.engine.engine" in graph["compile.engine"]


def test_compile_has_no_import_circle():
    assert cycles(import_graph()) == []


CHILD = """
import os, sys, importlib, traceback
import torch, torch._dynamo, torch.distributed, xpu_ops  # third-party only: no compile module
try:
    import transformers  # the CLI's model loading
except ImportError:
    pass
assert not [m for m in sys.modules if m == "compile" or m.startswith("compile.")]
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1]:
        failed.append(name)
print("FAILED", *failed)
"""


# the modules of the two circles this check replaced (the engine and its disaggregation roles;
# the CLI and its disaggregation launcher) and the modules that broke them; every module of the
# package costs about 30 s on a 2-core machine, the static check above covers them all
ALONE = ("compile.__main__", "compile.engine.cli_disagg", "compile.engine.disaggregation",
         "compile.engine.engine", "compile.engine.forwards", "compile.engine.request",
         "compile.engine.kv_transfer")


def test_engine_modules_import_alone():
    names = list(ALONE)
    assert set(names) <= set(modules())
    run = subprocess.run([sys.executable, "-c", CHILD, *names], capture_output=True,
                         text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "FAILED", run.stderr[-3000:]
