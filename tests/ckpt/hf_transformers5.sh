#!/usr/bin/env bash
# Runs a test of tests/ckpt/ (hf_deepseek_test.py, hf_llama_rope_test.py) with Hugging Face's
# transformers 5 (DeepseekV3ForCausalLM, Llama 3.1's rotary scaling), which needs PyTorch 2.x: a virtual environment under the build folder that sees the PyTorch
# 2.x one scripts/torch2_check.sh installs (HP_TORCH2_VENV, default
# ~/.cache/hyperparallel/torch-2.11) and adds transformers and safetensors from PyPI (once,
# scripts/transformers5_venv.sh).
# Where either cannot be had, the test is skipped (exit 77) with the reason printed.
# Usage: hf_transformers5.sh <test.py> <hf_logits> <hp-train> <build dir> [mpirun]
set -uo pipefail
test=$1 logits=$2 train=$3 build=$4 mpirun=${5:-}
here=$(cd "$(dirname "$0")" && pwd)
torch2=${HP_TORCH2_VENV:-$HOME/.cache/hyperparallel/torch-2.11}
venv=$build/py-deepseek
# The environment (scripts/transformers5_venv.sh); skipped with its reason where it cannot be had.
if ! msg=$(bash "$here/../../scripts/transformers5_venv.sh" "$venv" "$torch2" "$build/py-deepseek.log"); then
  echo "hf_transformers5.sh: SKIP: $msg"
  exit 77
fi
[ -z "$msg" ] || echo "$msg"
exec "$venv/bin/python" "$here/$test" "$logits" "$train" "$build/hf-${test%.py}" "$mpirun"
