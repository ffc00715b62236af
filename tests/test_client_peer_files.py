"""sgl-kernel-xpu's plumbed test files import through the shim on the CPU (when ``.peer/`` holds
them; ``scripts/prepare_peer.py`` saves them, never committed).

For each file the runner ``scripts/run_sgl_kernel_xpu_tests.py`` runs: every ``sgl_kernel`` name
it imports (``from sgl_kernel... import``, ``import sgl_kernel.<module>``) and every
``torch.ops.sgl_kernel.<name>`` it calls resolves through the shim (read from the file's syntax
tree, so no third-party package is needed); then the file itself is imported as pytest would,
when the third-party packages it needs (einops, scipy, ...) are installed. Without ``.peer/``
the tests skip: a skip here proves nothing.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import re
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))
import plumb_xpu_tests  # noqa: E402
import run_sgl_kernel_xpu_tests as xpu_runner  # noqa: E402

PEER = ROOT / ".peer" / "sgl-kernel-xpu" / "tests"
pytestmark = pytest.mark.skipif(not PEER.is_dir(), reason=".peer/ holds no sgl-kernel-xpu tests "
                                                          "(scripts/prepare_peer.py)")


@pytest.fixture(scope="module")
def plumbed(tmp_path_factory):
    """The plumbed copies (``plumb_xpu_tests``) in a fresh folder, and the shim installed."""
    import xpu_ops
    from xpu_ops.compat import is_shim
    existing = sys.modules.get("sgl_kernel")
    if (existing is not None and not is_shim(existing)) or (
            existing is None and importlib.util.find_spec("sgl_kernel") is not None):
        pytest.skip("a real sgl_kernel is installed; the shim is not")
    dst = tmp_path_factory.mktemp("plumbed")
    plumb_xpu_tests.plumb_folder(PEER, dst, verbose=False)
    xpu_ops.compat.install_sgl_kernel_shim()
    yield dst
    xpu_ops.compat.uninstall_sgl_kernel_shim()


def sgl_kernel_uses(source: str) -> tuple[set, set]:
    """``({(module, name)}, {raw op name})`` of a test file's ``sgl_kernel`` imports and calls."""
    imports = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sgl_kernel":
            imports |= {(node.module, alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            imports |= {(alias.name, None) for alias in node.names
                        if alias.name.split(".")[0] == "sgl_kernel"}
    return imports, set(re.findall(r"torch\.ops\.sgl_kernel\.(\w+)", source))


@pytest.mark.parametrize("name", xpu_runner.XPU_FILES)
def test_every_sgl_kernel_name_of_the_file_resolves(plumbed, name):
    if not (PEER / name).exists():
        pytest.fail(f"{name} is in XPU_FILES but not in {PEER} (sgl-kernel-xpu renamed it?)")
    imports, raw_ops = sgl_kernel_uses((plumbed / name).read_text())
    assert imports or raw_ops, f"{name} uses nothing of sgl_kernel: not an sgl_kernel test?"
    for module, attr in sorted(imports, key=str):
        imported = importlib.import_module(module)
        if attr is not None:
            assert hasattr(imported, attr) or importlib.util.find_spec(f"{module}.{attr}"), \
                f"{name}: from {module} import {attr}"
    for op in sorted(raw_ops):
        assert hasattr(torch.ops.sgl_kernel, op), f"{name}: torch.ops.sgl_kernel.{op}"


@pytest.mark.parametrize("name", xpu_runner.XPU_FILES)
def test_the_file_imports(plumbed, name, monkeypatch):
    monkeypatch.syspath_prepend(str(plumbed))
    monkeypatch.syspath_prepend(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(f"plumbed_{name[:-3]}", plumbed / name)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] not in ("sgl_kernel", "local_device", "utils"):
            pytest.skip(f"{name} needs {exc.name}, not installed here")
        raise
    finally:
        sys.modules.pop("utils", None)     # sgl-kernel-xpu's tests/utils.py, not ours
