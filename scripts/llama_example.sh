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

here=$(cd "$(dirname "$0")/.." && pwd)
out=hp-train-out/llama_example
if [ "${1:-}" = --out ]; then
  out=${2:?--out needs a folder}
  shift 2
fi
if [ -e "$out" ]; then
  echo "llama_example.sh: '$out' exists; nothing is overwritten: remove it or give --out another folder" >&2
  exit 1
fi
config=$here/configs/llama_example.yaml

if [ -z "${HP_TRAIN:-}" ]; then
  bash "$here/scripts/build.sh" hp-train
  HP_TRAIN=$here/build/hp-train
fi

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
vpy=$venv/bin/python

mkdir -p "$out"
corpus=("$here/docs" "$here/include" "$here/src" "$here/apps" "$here/README.md")
echo "== 1. tokenizer and model"
"$vpy" "$here/tools/llama_example.py" model --out "$out/model" "${corpus[@]}"
echo "== 2. corpus"
"$vpy" "$here/tools/prepare_data.py" --tokenizer "$out/model" --out "$out/data/corpus" --valid-fraction 0.1 \
  "${corpus[@]}"
echo "== 3. training"
paths=(--set "model.from_hf=$out/model" --set "data.path=$out/data/corpus.train.bin"
       --set "data.valid_path=$out/data/corpus.valid.bin" --set "output_dir=$out/run"
       --set "save_dir=$out/checkpoints")
bash "$here/scripts/mpirun.sh" 4 "$HP_TRAIN" --config "$config" "${paths[@]}" "$@"
echo "== 4. export, and transformers"
"$HP_TRAIN" --export-hf "$out/checkpoints" "$out/export"  # the checkpoint its latest names
cp "$out/model/tokenizer.json" "$out/model/tokenizer_config.json" "$out/model/special_tokens_map.json" "$out/export/"
sets=()
for arg in "$@"; do
  case $arg in
    seq_length=* | global_batch_size=* | eval_steps=*) sets+=(--set "$arg") ;;
  esac
done
"$vpy" "$here/tools/llama_example.py" check --run "$out/run" --export "$out/export" \
  --valid "$out/data/corpus.valid.bin" --config "$config" "${sets[@]}"
echo "llama_example.sh: done; the trained model, with its tokenizer, is in $out/export"
