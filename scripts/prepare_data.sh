#!/usr/bin/env bash
# Tokenizes a corpus for hp-train with a model's own tokenizer (tools/prepare_data.py):
# text files, directories of them or JSON Lines -> PREFIX.train.bin, PREFIX.valid.bin and
# PREFIX.json. Runs in a virtual environment made once, with PyPI's tokenizers (and
# sentencepiece for a tokenizer.model); the first run needs PyPI.
#
# Usage: scripts/prepare_data.sh --tokenizer MODEL_DIR --out PREFIX [options] INPUT...
#        scripts/prepare_data.sh --help
# Environment:
#   HP_DATA_VENV   the virtual environment (default $HOME/.cache/hyperparallel/prepare-data)
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
venv=${HP_DATA_VENV:-$HOME/.cache/hyperparallel/prepare-data}
need=(tokenizers)
for arg in "$@"; do
  case $arg in
    *.model) need+=(sentencepiece) ;;
  esac
done
# A model folder holding only a tokenizer.model needs sentencepiece too.
prev=
for arg in "$@"; do
  if [ "$prev" = --tokenizer ] && [ -d "$arg" ] && [ ! -f "$arg/tokenizer.json" ] && [ -f "$arg/tokenizer.model" ]; then
    need+=(sentencepiece)
  fi
  prev=$arg
done
imports=$(IFS=,; echo "${need[*]}")
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import $imports" 2>/dev/null; then
  mkdir -p "$(dirname "$venv")"
  log=$venv.log
  if ! { python3 -m venv "$venv" && "$venv/bin/pip" install -q "${need[@]}"; } > "$log" 2>&1; then
    echo "prepare_data.sh: could not make $venv with ${need[*]} (PyPI needed the first time; see $log)" >&2
    exit 1
  fi
fi
exec "$venv/bin/python" "$here/tools/prepare_data.py" "$@"
