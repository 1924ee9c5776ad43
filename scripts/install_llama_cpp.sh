#!/usr/bin/env bash
# Install llama-cpp-python (the llama.cpp the GGUF export is validated against) into a venv.
# PyPI ships it as source only: build the library once per CPU kind (GGML_NATIVE: tuned to this
# CPU, so the wheel is keyed by the CPU's flags) and cache the wheel; ~4 min on 2 cores.
# A failed build warns and exits 0: the GGUF tests then skip, saying how to install it.
set -uo pipefail
PY=${1:-.venv/bin/python}
VERSION=0.3.36
KEY=$( (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m; "$PY" -V) | md5sum | cut -c1-12)
CACHE=${LLM_FOUNDRY_WHEELS:-$HOME/.cache/llm-foundry/wheels}/$KEY
if "$PY" -c "import llama_cpp" 2>/dev/null; then exit 0; fi
WHEEL=$(ls "$CACHE"/llama_cpp_python-$VERSION-*.whl 2>/dev/null | head -1)
if [ -z "$WHEEL" ]; then
    echo "building llama-cpp-python $VERSION from its sdist, once for this CPU (~4 min) ..."
    mkdir -p "$CACHE"
    CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "$PY" -m pip wheel --quiet --no-deps --no-cache-dir -w "$CACHE" "llama-cpp-python==$VERSION" \
        || { echo "warning: llama-cpp-python did not build; the GGUF tests will skip" >&2; exit 0; }
    WHEEL=$(ls "$CACHE"/llama_cpp_python-$VERSION-*.whl | head -1)
fi
"$PY" -m pip install --quiet "$WHEEL" \
    || echo "warning: $WHEEL did not install; the GGUF tests will skip" >&2
