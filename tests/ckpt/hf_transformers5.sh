#!/usr/bin/env bash
# Runs a test of tests/ckpt/ (hf_deepseek_test.py, hf_llama_rope_test.py) with Hugging Face's
# transformers 5 (DeepseekV3ForCausalLM, Llama 3.1's rotary scaling), which needs PyTorch 2.x: a virtual environment under the build folder that sees the PyTorch
# 2.x one scripts/torch2_check.sh installs (HP_TORCH2_VENV, default
# ~/.cache/hyperparallel/torch-2.11) and adds transformers and safetensors from PyPI (once).
# Where either cannot be had, the test is skipped (exit 77) with the reason printed.
# Usage: hf_transformers5.sh <test.py> <hf_logits> <hp-train> <build dir> [mpirun]
set -uo pipefail
test=$1 logits=$2 train=$3 build=$4 mpirun=${5:-}
here=$(cd "$(dirname "$0")" && pwd)
torch2=${HP_TORCH2_VENV:-$HOME/.cache/hyperparallel/torch-2.11}
venv=$build/py-deepseek
if ! "$torch2/bin/python" -c 'import torch; assert int(torch.__version__.split(".")[0]) >= 2' 2>/dev/null; then
  echo "hf_transformers5.sh: SKIP: no PyTorch 2.x in $torch2 (scripts/torch2_check.sh installs it; transformers' DeepSeek-V3 needs it)"
  exit 77
fi
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'from transformers import DeepseekV3ForCausalLM; import safetensors' 2>/dev/null; then
  rm -rf "$venv"
  # The new environment sees the PyTorch 2.x one's packages through a .pth file.
  if "$torch2/bin/python" -m venv "$venv" > "$build/py-deepseek.log" 2>&1 &&
     "$torch2/bin/python" -c 'import site; print(site.getsitepackages()[0])' \
       > "$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')/hp-torch2.pth" &&
     "$venv/bin/pip" install -q "transformers==5.25.0" safetensors >> "$build/py-deepseek.log" 2>&1 &&
     "$venv/bin/python" -c 'from transformers import DeepseekV3ForCausalLM' >> "$build/py-deepseek.log" 2>&1; then
    echo "hf_transformers5.sh: made $venv"
  else
    echo "hf_transformers5.sh: SKIP: could not install transformers and safetensors (see $build/py-deepseek.log)"
    exit 77
  fi
fi
exec "$venv/bin/python" "$here/$test" "$logits" "$train" "$build/hf-${test%.py}" "$mpirun"
