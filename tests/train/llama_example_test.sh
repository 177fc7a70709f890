#!/usr/bin/env bash
# scripts/llama_example.sh end to end (the README's third command): a Llama made by
# transformers, a corpus tokenized by a tokenizer trained in the script, 200 steps on 4
# ranks (FSDP 2 x TP 2), export; the script itself checks that the validation loss fell and
# that transformers computes the same validation loss from the export (1e-5 relative) and
# generates from it. Then a second run into the same folder must be refused, leaving it
# as it was. Skipped (77) where the Python packages cannot be installed.
# Usage: llama_example_test.sh <hp-train> <source dir> <build dir>
set -uo pipefail
train=$1 src=$2 build=$3
out=$build/llama-example
rm -rf "$out"
export HP_TRAIN=$train HP_EXAMPLE_VENV=$build/py-example
bash "$src/scripts/llama_example.sh" --out "$out"
rc=$?
[ $rc -eq 0 ] || exit $rc
for f in export/config.json export/tokenizer.json run/metrics.jsonl run/loss.svg data/corpus.json; do
  [ -s "$out/$f" ] || { echo "llama_example_test: FAIL: $out/$f is missing or empty"; exit 1; }
done
before=$(find "$out" -type f -exec sha256sum {} + | sort)
if msg=$(bash "$src/scripts/llama_example.sh" --out "$out" 2>&1); then
  echo "llama_example_test: FAIL: a second run into $out was not refused"; exit 1
fi
case $msg in
  *"exists; nothing is overwritten"*) ;;
  *) echo "llama_example_test: FAIL: the refusal does not say why: $msg"; exit 1 ;;
esac
after=$(find "$out" -type f -exec sha256sum {} + | sort)
[ "$before" = "$after" ] || { echo "llama_example_test: FAIL: the refused run changed $out"; exit 1; }
echo "llama_example_test: PASS"
