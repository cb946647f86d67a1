#!/usr/bin/env bash
# The device checks on a machine with an NVIDIA GPU (16 cores): llama-cpp-python and the llama.cpp
# tools built with CUDA for this GPU's architecture only, then one PASS/FAIL line per check
# (bench/device_check.py). Meant to finish in 10 minutes, builds included.
#
#   bench/device_check.sh                 # from a checkout, with PyPI reachable
#   SDIST=/path/llama_cpp_python-0.3.36.tar.gz bench/device_check.sh   # offline: the sdist carried
#
# Without network, the Python packages ggufcarve needs beyond the machine's (gguf) must be
# installed first (for example from carried wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
JOBS="${JOBS:-$(nproc)}"
VERSION=0.3.36
SDIST="${SDIST:-}"
export CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" GGML_NO_BACKTRACE=1 PYTHONUNBUFFERED=1
started=$(date +%s)
say() { printf '%s %s (%ss)\n' "$1" "$2" "$(( $(date +%s) - started ))"; }

args=(llama-cpp-python==$VERSION)
[ -n "$SDIST" ] && args=("$SDIST")
if CMAKE_ARGS="-DGGML_CUDA=on -DGGML_RPC=on -DCMAKE_CUDA_ARCHITECTURES=native" \
    python3 -m pip install -q --no-cache-dir --force-reinstall --no-deps "${args[@]}" >/tmp/device-pip.log 2>&1; then
  say PASS "llama-cpp-python $VERSION built with CUDA"
else
  say FAIL "llama-cpp-python build: $(tail -3 /tmp/device-pip.log | tr '\n' ' ')"; exit 1
fi
python3 -m pip install -q --no-deps -e . >/tmp/device-pip-self.log 2>&1 || { say FAIL "pip install -e ."; exit 1; }
if [ -n "$SDIST" ]; then
  mkdir -p "${GGUFCARVE_CACHE:-$HOME/.cache/ggufcarve}/sdist" && cp "$SDIST" "${GGUFCARVE_CACHE:-$HOME/.cache/ggufcarve}/sdist/"
fi
if python3 -m ggufcarve toolchain build --backend cuda --cuda-architectures native --jobs "$JOBS" --quiet \
    >/tmp/device-tools.log 2>&1; then
  say PASS "llama.cpp tools built with CUDA"
else
  say FAIL "tools build: $(tail -3 /tmp/device-tools.log | tr '\n' ' ')"; exit 1
fi
python3 bench/device_check.py
