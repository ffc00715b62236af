"""``benchmarks/`` is a folder of scripts, not a package: its modules import each other by bare
name (``from dense_baseline import ...``) as when run as scripts, so the folder goes on
``sys.path`` for these tests."""

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
