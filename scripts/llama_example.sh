#!/usr/bin/env bash
# A real, small end-to-end run (README, "From a Hugging Face model and a corpus"):
#   1. a BPE tokenizer trained on this repository's docs and sources, and a random Llama
#      made by transformers (LlamaConfig, saved as a Hugging Face folder);
#   2. the same files tokenized by that tokenizer (tools/prepare_data.py): training and
#      validation documents;
#   3. hp-train started from the folder (model.from_hf), 200 steps on 4 ranks as FSDP 2 x
#      TP 2, validated every 25 steps (configs/llama_example.yaml);
#   4. the last checkpoint exported to a Hugging Face folder (with the tokenizer), which
#      transformers loads: its validation loss must equal hp-train's, and it generates.
# Python runs in a virtual environment made once over Debian's PyTorch (transformers 4.40,
# the last release for PyTorch 1.13; PyPI needed the first time). Nothing is downloaded
# but packages.
#
# Usage: scripts/llama_example.sh [--out DIR] [hp-train options, e.g. --set train_steps=400]
#   --out DIR   where everything goes (default hp-train-out/llama_example); must not exist
# Environment:
#   HP_EXAMPLE_VENV  the virtual environment (default $HOME/.cache/hyperparallel/example)
#   HP_TRAIN         an hp-train binary to use instead of building build/hp-train
# Exit status: 0 done, 1 failed, 77 the Python packages could not be installed.
set -euo pipefail

# shellcheck source=scripts/example_common.sh
source "$(dirname "$0")/example_common.sh"
example_init llama_example "$@"

venv=${HP_EXAMPLE_VENV:-$HOME/.cache/hyperparallel/example}
py=/usr/bin/python3  # Debian's interpreter, for its python3-torch
if ! $py -c 'import torch' 2>/dev/null; then
  echo "llama_example.sh: Debian's python3-torch is not installed (scripts/deps.sh installs it)" >&2
  exit 77
fi
if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
  echo "llama_example.sh: '$venv' exists but is not a virtual environment (HP_EXAMPLE_VENV names another folder)" >&2
  exit 1
fi
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import transformers, tokenizers, safetensors, yaml' 2>/dev/null; then
  mkdir -p "$(dirname "$venv")"
  if ! { { [ -x "$venv/bin/python" ] || $py -m venv --system-site-packages "$venv"; } &&
         "$venv/bin/pip" install -q "transformers==4.40.2" safetensors; } > "$venv.log" 2>&1; then
    echo "llama_example.sh: could not install transformers 4.40 into $venv (PyPI needed the first time; see $venv.log)" >&2
    exit 77
  fi
fi
example_run llama "$here/configs/llama_example.yaml" "$venv/bin/python"
