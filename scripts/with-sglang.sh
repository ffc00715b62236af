#!/usr/bin/env bash
# Like scripts/with-env.sh, and first create (once) .venv-sglang: sglang 0.5.23 plus the packages
# its attention backends' import chain needs (pyproject.toml's `sglang` extra), installed without
# dependencies into a plain directory that only the integration test puts on a child process's
# path (tests/integration/test_sglang_backend.py; the rest of the suite never imports sglang).
# sglang's own dependency list would pull CUDA builds of torch and its kernels, hence --no-deps.
#   bash scripts/with-sglang.sh python -m pytest -q tests/integration
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/with-env.sh" true            # the project's .venv first
target="$root/.venv-sglang"
stamp="$target/.xpu-ops-installed"                # holds the requirements it was built from
requirements=$("$root/.venv/bin/python" -c 'import sys, tomllib
print(" ".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["sglang"]))' \
  "$root/pyproject.toml")
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$requirements" ] || [ "$root/scripts/with-sglang.sh" -nt "$stamp" ]; then
  rm -rf "$target"
  echo "[with-sglang] installing sglang 0.5.23 and its import chain into $target (first use," \
       "about 300 MB and 2 minutes; quiet pip step)" >&2
  # shellcheck disable=SC2086  # one word per requirement
  "$root/.venv/bin/pip" install -q --disable-pip-version-check --no-deps --target "$target" $requirements
  echo "$requirements" > "$stamp"
  echo "[with-sglang] ready: $(du -sh "$target" | cut -f1) in $target" >&2
fi
exec bash "$root/scripts/with-env.sh" "$@"
