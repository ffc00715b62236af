#!/usr/bin/env bash
# Create (once) .venv-xe, an environment with Intel's Triton (triton-xpu, whose `intel` backend
# compiles Triton kernels to SPIR-V for Intel GPUs) in place of the NVIDIA build, then run the
# given command in it from the repository root. Kept out of the default set-up: only the Xe
# compile check needs it (benchmarks/compile_kernels_xe.py).
#   bash scripts/with-xe-env.sh python benchmarks/compile_kernels_xe.py
# Everything comes from PyPI and Debian: triton-xpu and intel-sycl-rt (the SYCL headers and
# runtime its backend's small host helper builds against) from PyPI; from Debian the Level Zero
# headers and loader (libze-dev) and Intel's OpenCL runtime (intel-opencl-icd), whose `ocloc`
# compiles SPIR-V to native code for the targets it knows (Xe-HPC, Xe-HPG; not yet Xe2). torch and this package come from the project's .venv
# (scripts/with-env.sh), which .venv-xe sees through a path file placed after its own packages, so
# its `triton` is Intel's. Disk: about 0.7 GB beside .venv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-xe"
requirements="triton-xpu==3.3.0b1 intel-sycl-rt==2026.2.0"
bash "$root/scripts/with-env.sh" true              # the project's .venv (torch, xpu-ops)
if [ ! -f /usr/include/level_zero/ze_api.h ] || ! command -v ocloc > /dev/null; then
  echo "with-xe-env: installing Debian's libze-dev and intel-opencl-icd (Level Zero, ocloc)" >&2
  if [ "$(id -u)" = 0 ]; then
    apt-get install -y -q libze-dev intel-opencl-icd > /dev/null \
      || { apt-get update -q > /dev/null && apt-get install -y -q libze-dev intel-opencl-icd > /dev/null; }
  else
    echo "with-xe-env: run 'sudo apt-get install libze-dev intel-opencl-icd' first" >&2
    exit 2
  fi
fi
if [ ! -f "$venv/.xpu-ops-installed" ] || [ "$(cat "$venv/.xpu-ops-installed")" != "$requirements" ]; then
  echo "with-xe-env: creating $venv with $requirements (about 0.7 GB, a minute or two)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  # shellcheck disable=SC2086  # one word per requirement
  "$venv/bin/pip" install -q --disable-pip-version-check $requirements
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  main_site=$("$root/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$main_site" > "$site/zz-xpu-ops-main-venv.pth"   # after triton-xpu's own packages
  echo "$requirements" > "$venv/.xpu-ops-installed"
fi
cd "$root"
# Without an Intel GPU, Triton builds its host helper with $CC, C by default; the helper is C++.
export CC="${CC:-g++}" SYCL_DISABLE_FSYCL_SYCLHPP_WARNING=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$venv/bin:$PATH"
exec "$@"
