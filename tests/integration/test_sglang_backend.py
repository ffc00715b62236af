"""Integration: sglang 0.5.23's ``XPUAttentionBackend`` runs on xpu-ops, and
matches this project's backend mode by mode.

The cases live in ``sglang_backend_cases.py`` (sglang's backend against the float64 oracle) and
``sglang_parity_cases.py`` (sglang's backend and ``compile.backend.XPUAttentionBackend`` side by
side on the same batches) and run in a child process, because they need
sglang's import chain on the path (``.venv-sglang``, made by ``scripts/with-sglang.sh``) and a
torchvision stand-in (``stand_ins/``) that must not leak into the rest of the suite (transformers
would take it for the real package). Skipped, with the command that creates it, where
``.venv-sglang`` is absent; CI (``.ci/run``) creates it.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent
SGLANG_ENV = ROOT / ".venv-sglang"
CASES = [HERE / "sglang_backend_cases.py", HERE / "sglang_parity_cases.py"]
# sglang_backend_cases: 4 cases (extend with and without a cached prefix, decode, target verify)
# x 2 page sizes, plus the interface data check, each with 2 providers (reference, Triton through
# its interpreter; the provider fixture is autouse). sglang_parity_cases, reference provider
# only: 10 cases (extend, mixed and draft extend v2, decode, verify width, encoder-only, Gemma-3
# image blocks, encoder-decoder, deterministic inference, tree verify topk 2) x 2 page sizes,
# absorbed MLA in 3 modes x 2 page sizes, and a draft decode step at topk 1 and 2 x 2 page
# sizes.
EXPECTED_PASSED = 2 * (4 * 2 + 1) + (10 * 2 + 3 * 2 + 2 * 2)


@pytest.mark.skipif(not (SGLANG_ENV / ".xpu-ops-installed").exists(),
                    reason="sglang 0.5.23 environment absent; create it with "
                           "`bash scripts/with-sglang.sh true`")
def test_sglang_xpu_backend_matches_oracle():
    # One intra-op thread: the child shares CI's two cores with the xdist workers, and with two
    # threads one case (sglang_backend_cases test_extend[reference-1-cached-prefix]) missed the
    # float64 oracle by ~1e-4 on its requests with a cached prefix in about 1 of 8 runs on
    # one shared 2-core machine (never with one thread; not reproduced in 60 two-thread runs since).
    # Its cause is not known; _assert_close reports the rows and the CPU math setup if it recurs.
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(HERE / "stand_ins"), str(SGLANG_ENV), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("XPU_OPS_PROVIDER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
         *(str(c.relative_to(ROOT)) for c in CASES)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    summary = re.search(r"(\d+) passed", report)
    assert summary and int(summary.group(1)) == EXPECTED_PASSED, report
    assert not re.search(r"\d+ (skipped|failed|error)", report), report
