#!/usr/bin/env bash
# Runs tests/ckpt/hf_interop_test.py with Hugging Face's transformers and safetensors: a
# virtual environment under the build folder over Debian's python3-torch (made once; PyPI
# needed the first time). Where that cannot be had, the test is skipped (exit 77) with the
# reason printed.
# Usage: hf_interop.sh <hf_logits> <hp-train> <build dir> [mpirun]
set -uo pipefail
logits=$1 train=$2 build=$3 mpirun=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
venv=$build/py-transformers
# Debian's interpreter (its python3-torch), whatever python3 is first on PATH.
py=/usr/bin/python3
if ! $py -c 'import torch' 2>/dev/null; then
  echo "hf_interop.sh: SKIP: Debian's python3-torch is not installed (scripts/deps.sh installs it)"
  exit 77
fi
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import transformers, safetensors' 2>/dev/null; then
  rm -rf "$venv"
  # transformers 4.40 is the last release that runs on PyTorch 1.13.
  if $py -m venv --system-site-packages "$venv" > "$build/py-transformers.log" 2>&1 &&
     "$venv/bin/pip" install -q "transformers==4.40.2" safetensors >> "$build/py-transformers.log" 2>&1; then
    echo "hf_interop.sh: made $venv"
  else
    echo "hf_interop.sh: SKIP: could not install transformers and safetensors (see $build/py-transformers.log)"
    exit 77
  fi
fi
exec "$venv/bin/python" "$here/hf_interop_test.py" "$logits" "$train" "$build/hf-interop" "$mpirun"
