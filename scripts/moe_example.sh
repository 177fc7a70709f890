#!/usr/bin/env bash
# The same end-to-end run as scripts/llama_example.sh for a mixture of experts:
#   1. a BPE tokenizer trained on this repository's docs and sources, and a random
#      Qwen3-MoE made by transformers (Qwen3MoeConfig: 8 experts, 2 a token, per-head q/k
#      norms), saved as a Hugging Face folder;
#   2. the same files tokenized by that tokenizer (tools/prepare_data.py);
#   3. hp-train started from the folder (model.from_hf), 200 steps on 4 ranks with expert
#      parallelism 2 (each rank 4 of the 8 experts, each expert sharded over the 2 ranks
#      holding it) under fully_shard over 4, validated every 25 steps
#      (configs/moe_example.yaml);
#   4. the last checkpoint exported to a Hugging Face folder, which transformers loads: its
#      validation loss must equal hp-train's, and it generates.
# Python runs in a virtual environment with transformers 5.25 (Qwen3-MoE needs it, and it
# needs PyTorch 2.x) over the PyTorch 2.11 one scripts/torch2_check.sh uses, installed here
# from PyPI the first time where absent (about 5 GB). Nothing is downloaded but packages.
#
# Usage: scripts/moe_example.sh [--out DIR] [hp-train options, e.g. --set train_steps=400]
#   --out DIR   where everything goes (default hp-train-out/moe_example); must not exist
# Environment:
#   HP_MOE_EXAMPLE_VENV  the transformers 5 environment (default
#                        $HOME/.cache/hyperparallel/moe-example)
#   HP_TORCH2_VENV       the PyTorch 2.x one (default $HOME/.cache/hyperparallel/torch-2.11)
#   HP_TRAIN             an hp-train binary to use instead of building build/hp-train
# Exit status: 0 done, 1 failed, 77 the Python packages could not be installed.
set -euo pipefail

# shellcheck source=scripts/example_common.sh
source "$(dirname "$0")/example_common.sh"
example_init moe_example "$@"

venv=${HP_MOE_EXAMPLE_VENV:-$HOME/.cache/hyperparallel/moe-example}
torch2=${HP_TORCH2_VENV:-$HOME/.cache/hyperparallel/torch-2.11}
if ! "$torch2/bin/python" -c 'import torch; assert int(torch.__version__.split(".")[0]) >= 2' 2>/dev/null; then
  if [ -e "$torch2" ] && [ ! -f "$torch2/pyvenv.cfg" ]; then
    echo "moe_example.sh: '$torch2' exists but is not a virtual environment (HP_TORCH2_VENV names another folder)" >&2
    exit 1
  fi
  echo "moe_example.sh: installing PyTorch 2.11 from PyPI into $torch2 (once; about 5 GB)"
  rm -rf "$torch2"
  mkdir -p "$(dirname "$torch2")"
  if ! { python3 -m venv "$torch2" && "$torch2/bin/pip" install -q "torch==2.11.*" numpy; } > "$torch2.log" 2>&1; then
    echo "moe_example.sh: could not install PyTorch 2.11 into $torch2 (PyPI needed the first time; see $torch2.log)" >&2
    exit 77
  fi
fi
if ! bash "$here/scripts/transformers5_venv.sh" "$venv" "$torch2" "$venv.log" >&2; then
  echo "moe_example.sh: the transformers 5 environment could not be made" >&2
  exit 77
fi

example_run qwen3_moe "$here/configs/moe_example.yaml" "$venv/bin/python"
