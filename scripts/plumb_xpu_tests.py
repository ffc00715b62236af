"""Adapt sgl-kernel-xpu's test files to the local device (the copies are never committed).

Reads ``<peer>/sgl-kernel-xpu/tests/*.py`` (saved there by ``scripts/prepare_peer.py``) and writes
``<peer>/generated/sgl-kernel-xpu/tests/`` with only the device plumbing changed:

* ``torch.xpu.<name>`` and ``torch.accelerator.<name>`` -> ``local_device.<name>``
  (``scripts/local_device.py``: CUDA's equivalents on CUDA, CPU ones otherwise;
  ``is_available()`` is True);
* the ``"xpu"`` / ``'xpu'`` device string (also ``"xpu:<i>"``) -> the local device; ``.xpu()``
  -> ``.to(local_device.DEVICE)``;
* a test function's ``device = device`` or ``torch.device(f"{device}:0")``, which reads the
  module-level ``device`` after the function made ``device`` local (sgl-kernel-xpu's
  ``test_flash_attention_4.py`` and ``test_flashmla.py::test_flash_mla_fp8`` raise
  ``UnboundLocalError`` there, on XPU as well) -> the local device;
* ``import local_device`` added after the module docstring and ``__future__`` imports.

Everything else (tolerances, shapes, references, calls) is as published. Prints each file and
how many replacements it got.

    python scripts/plumb_xpu_tests.py            # .peer -> .peer/generated
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import client_test_runs  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
RULES = (
    (re.compile(r"\btorch\.xpu\."), "local_device."),
    (re.compile(r"\btorch\.accelerator\."), "local_device."),
    (re.compile(r"""(["'])xpu:(\d+)\1"""), r'(local_device.DEVICE + ":\2")'),
    (re.compile(r"""(?<![\w{])(["'])xpu\1"""), "local_device.DEVICE"),
    (re.compile(r"\.xpu\(\)"), ".to(local_device.DEVICE)"),
    # a test function that reads the module's ``device`` after assigning a local of that name
    # (an UnboundLocalError everywhere, on XPU too): the local becomes the local device
    (re.compile(r"^(\s+)device = device$", re.M), r"\1device = local_device.DEVICE"),
    (re.compile(r"""torch\.device\(f(["'])\{device\}:0\1\)"""),
     r'torch.device(f"{local_device.DEVICE}:0")'),
)


def _import_line(source: str) -> int:
    """Line index after the docstring and ``from __future__`` imports (where to import)."""
    tree = ast.parse(source)
    line = 0
    for node in tree.body:
        is_doc = (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                  and isinstance(node.value.value, str))
        if is_doc or (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            line = node.end_lineno
        else:
            break
    return line


def plumb(source: str) -> tuple[str, int]:
    """``source`` with the device plumbing replaced; returns ``(text, replacements)``."""
    total = 0
    for pattern, replacement in RULES:
        source, n = pattern.subn(replacement, source)
        total += n
    lines = source.splitlines(keepends=True)
    at = _import_line(source)
    lines.insert(at, "import local_device  # xpu-ops: the local device for torch.xpu\n")
    return "".join(lines), total


def plumb_folder(src: pathlib.Path, dst: pathlib.Path, verbose: bool = True) -> list[str]:
    """Plumb every ``*.py`` of ``src`` into ``dst``; returns the file names."""
    dst.mkdir(parents=True, exist_ok=True)
    names = []
    for path in sorted(src.glob("*.py")):
        text, n = plumb(path.read_text())
        client_test_runs.write_if_changed(dst / path.name, text)
        names.append(path.name)
        if verbose:
            print(f"{path.name}: {n} replacements")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer", type=pathlib.Path, default=ROOT / ".peer")
    args = parser.parse_args()
    src = args.peer / "sgl-kernel-xpu" / "tests"
    if not src.is_dir():
        raise SystemExit(f"plumb_xpu_tests: {src} is missing; run scripts/prepare_peer.py first.")
    plumb_folder(src, args.peer / "generated" / "sgl-kernel-xpu" / "tests")


if __name__ == "__main__":
    main()
