#!/usr/bin/env bash
# Runs the safetensors test with a Python that has Hugging Face's safetensors and numpy:
# a virtual environment under the build folder, made once (PyPI needed the first time).
# Without python3-venv or PyPI the interchange case is skipped, with the reason printed.
# Usage: interop.sh <safetensors test binary> <build dir>
set -uo pipefail
bin=$1 build=$2
venv=$build/py-safetensors
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import safetensors, numpy' 2>/dev/null; then
  if python3 -m venv "$venv" > "$build/py-safetensors.log" 2>&1 &&
     "$venv/bin/pip" install -q safetensors numpy >> "$build/py-safetensors.log" 2>&1; then
    echo "interop.sh: made $venv"
  else
    echo "interop.sh: SKIP the Hugging Face interchange case: could not install safetensors and numpy" \
         "(see $build/py-safetensors.log)"
    exec "$bin"
  fi
fi
HP_TEST_PYTHON="$venv/bin/python" exec "$bin"
