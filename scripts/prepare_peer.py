"""Save the client test files into the git-ignored ``.peer/`` folder (never committed).

* sgl-kernel-xpu: ``tests/*.py`` of a local git snapshot (default: the ``fetch`` mirror of
  github:sgl-project/sgl-kernel-xpu under ``/work/.mirror``) at ``--xpu-rev`` (default HEAD) ->
  ``.peer/sgl-kernel-xpu/tests/``, plus ``.peer/sgl-kernel-xpu/REVISION``.
* sgl-kernel (sglang repository): the files named in ``run_sgl_kernel_tests.SGLANG_FILES`` copied
  from ``--sglang-tests DIR`` (a folder holding sglang's current ``sgl-kernel/tests`` files,
  saved by hand: the repository is too large to fetch) -> ``.peer/sglang/sgl-kernel/tests/``.
  Files already directly under ``.peer/`` (the older layout) keep working without this step.

    python scripts/prepare_peer.py                                  # sgl-kernel-xpu only
    python scripts/prepare_peer.py --sglang-tests ~/saved/sgl-kernel-tests
"""

from __future__ import annotations

import argparse
import io
import pathlib
import shutil
import subprocess
import tarfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
XPU_MIRROR = pathlib.Path("/work/.mirror/sgl-project+sgl-kernel-xpu/repo")


def save_xpu_tests(repo: pathlib.Path, rev: str, peer: pathlib.Path) -> list[str]:
    """Extract ``tests/*.py`` (top level) of ``repo`` at ``rev`` into ``peer``."""
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "tests"],
                             check=True, capture_output=True).stdout
    dst = peer / "sgl-kernel-xpu" / "tests"
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    names = []
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            path = pathlib.PurePosixPath(member.name)
            if member.isfile() and len(path.parts) == 2 and path.suffix == ".py":
                (dst / path.name).write_bytes(tar.extractfile(member).read())
                names.append(path.name)
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", rev], check=True,
                            capture_output=True, text=True).stdout.strip()
    (peer / "sgl-kernel-xpu" / "REVISION").write_text(commit + "\n")
    return sorted(names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer", type=pathlib.Path, default=ROOT / ".peer")
    parser.add_argument("--xpu-repo", type=pathlib.Path, default=XPU_MIRROR)
    parser.add_argument("--xpu-rev", default="HEAD")
    parser.add_argument("--sglang-tests", type=pathlib.Path, default=None)
    args = parser.parse_args()
    names = save_xpu_tests(args.xpu_repo, args.xpu_rev, args.peer)
    print(f"sgl-kernel-xpu: {len(names)} test files -> {args.peer / 'sgl-kernel-xpu/tests'}")
    if args.sglang_tests is not None:
        import run_sgl_kernel_tests as sgl
        dst = args.peer / "sglang" / "sgl-kernel" / "tests"
        dst.mkdir(parents=True, exist_ok=True)
        for name in sgl.SGLANG_FILES.values():
            if (args.sglang_tests / name).exists():
                shutil.copy(args.sglang_tests / name, dst / name)
                print(f"sglang: {name} -> {dst}")
            else:
                print(f"sglang: {name} not in {args.sglang_tests}")


if __name__ == "__main__":
    main()
