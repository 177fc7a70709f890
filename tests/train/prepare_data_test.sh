#!/usr/bin/env bash
# tools/prepare_data.py on a small corpus, against the tokenizer called directly: a BPE
# tokenizer trained here (PyPI's tokenizers) in a model folder, and a sentencepiece model
# trained here; text files, a directory and JSON Lines in; each part's tokens and document boundaries checked against encoding every
# document here with the split rule written here; the sidecar; bad inputs named, nothing
# half-written; then hp-train trains on the result and reports its validation loss.
# Skipped (77) where the virtual environment cannot be made (no PyPI).
# Usage: prepare_data_test.sh <hp-train> <source dir> <build dir>
set -uo pipefail
bin=$1 src=$2 build=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
export HP_DATA_VENV=$build/py-data
if [ ! -x "$HP_DATA_VENV/bin/python" ] || ! "$HP_DATA_VENV/bin/python" -c 'import tokenizers, sentencepiece' 2>/dev/null; then
  if ! { python3 -m venv "$HP_DATA_VENV" && "$HP_DATA_VENV/bin/pip" install -q tokenizers sentencepiece; } > "$build/py-data.log" 2>&1; then
    echo "SKIP: could not install tokenizers and sentencepiece (see $build/py-data.log)"
    exit 77
  fi
fi
py=$HP_DATA_VENV/bin/python
prep=$src/scripts/prepare_data.sh

# The corpus: a directory of three text files (one with multi-byte UTF-8, one in a
# subfolder), a JSON Lines file of four documents, a loose text file.
mkdir -p "$work/docs/sub" "$work/model"
for i in 1 2 3 4 5 6; do echo "The quick brown fox number $i jumps over the lazy dog."; done > "$work/docs/a.txt"
printf 'Grüße aus Köln — naïve café, %s\n' 1 2 3 4 > "$work/docs/b.txt"
for i in $(seq 1 20); do echo "sharded data parallel step $i reduces gradients"; done > "$work/docs/sub/c.txt"
"$py" - "$work/docs.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(4):
        f.write(json.dumps({"text": f"document {i}: " + "tensor parallel splits the heads. " * (3 + i), "id": i}) + "\n")
PY
echo "A loose file at the end." > "$work/loose.txt"

# A BPE tokenizer trained on it, saved as a model folder would hold it.
"$py" - "$work" <<'PY' || fail "training the tokenizer"
import json, os, sys
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
w = sys.argv[1]
tk = Tokenizer(models.BPE(unk_token="<unk>"))
tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tk.decoder = decoders.ByteLevel()
texts = [open(os.path.join(w, p), encoding="utf-8").read() for p in ("docs/a.txt", "docs/b.txt", "docs/sub/c.txt", "loose.txt")]
texts += [json.loads(l)["text"] for l in open(os.path.join(w, "docs.jsonl"))]
trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tk.train_from_iterator(texts, trainer)
tk.save(os.path.join(w, "model", "tokenizer.json"))
json.dump({"eos_token": "</s>"}, open(os.path.join(w, "model", "tokenizer_config.json"), "w"))
json.dump({"model_type": "llama", "vocab_size": 512}, open(os.path.join(w, "model", "config.json"), "w"))
PY

inputs=("$work/docs" "$work/docs.jsonl" "$work/loose.txt")
bash "$prep" --tokenizer "$work/model" --out "$work/out/corpus" --valid-fraction 0.3 --seed 7 "${inputs[@]}" \
  > "$work/log" 2>&1 || fail "prepare_data failed: $(cat "$work/log")"
grep -q '^  valid_path: ' "$work/log" || fail "no hp-train keys printed: $(cat "$work/log")"

# Against the tokenizer called directly: the documents in input order (the directory's
# files sorted by path, then each JSON line, then the loose file), each encoded without
# special tokens and followed by </s>; document i in validation when the first 8 bytes of
# sha256("7:i"), little-endian, over 2^64 fall below 0.3.
"$py" - "$work" <<'PY' || fail "the outputs do not match the tokenizer"
import array, hashlib, json, os, sys
from tokenizers import Tokenizer
w = sys.argv[1]
tk = Tokenizer.from_file(os.path.join(w, "model", "tokenizer.json"))
eod = tk.token_to_id("</s>")
docs = [open(os.path.join(w, p), encoding="utf-8").read() for p in ("docs/a.txt", "docs/b.txt", "docs/sub/c.txt")]
docs += [json.loads(l)["text"] for l in open(os.path.join(w, "docs.jsonl"))]
docs.append(open(os.path.join(w, "loose.txt"), encoding="utf-8").read())
want = {"train": [], "valid": []}
count = {"train": 0, "valid": 0}
for i, d in enumerate(docs):
    h = int.from_bytes(hashlib.sha256(f"7:{i}".encode()).digest()[:8], "little")
    part = "valid" if h / 2.0**64 < 0.3 else "train"
    want[part] += tk.encode(d, add_special_tokens=False).ids + [eod]
    count[part] += 1
assert count["valid"] > 0 and count["train"] > 0, count
for part in ("train", "valid"):
    got = array.array("H")
    with open(os.path.join(w, "out", f"corpus.{part}.bin"), "rb") as f:
        got.frombytes(f.read())
    assert list(got) == want[part], (part, len(got), len(want[part]))
    assert got.count(eod) == count[part], part
meta = json.load(open(os.path.join(w, "out", "corpus.json")))
assert meta["dtype"] == "uint16" and meta["vocab_size"] == tk.get_vocab_size() and meta["eod_id"] == eod, meta
assert meta["documents"] == count, (meta["documents"], count)
assert meta["tokens"] == {p: len(want[p]) for p in want}, meta["tokens"]
print("prepare_data_test: train", count["train"], "documents,", len(want["train"]), "tokens; valid",
      count["valid"], "documents,", len(want["valid"]), "tokens")
PY

# A sentencepiece model (a folder holding only tokenizer.model, trained here), its
# end-of-sequence id from the model itself: the same documents against sp.EncodeAsIds.
"$py" - "$work" <<'PY' || fail "training the sentencepiece model"
import os, sys
import sentencepiece as spm
w = sys.argv[1]
os.makedirs(os.path.join(w, "spm"))
spm.SentencePieceTrainer.train(input=os.path.join(w, "docs", "sub", "c.txt") + "," + os.path.join(w, "docs", "a.txt"),
                               model_prefix=os.path.join(w, "spm", "tokenizer"), vocab_size=60, model_type="bpe",
                               unk_id=0, bos_id=1, eos_id=2, minloglevel=2)
os.remove(os.path.join(w, "spm", "tokenizer.vocab"))
PY
bash "$prep" --tokenizer "$work/spm" --out "$work/out/sp" --valid-fraction 0.3 --seed 7 "${inputs[@]}" \
  > "$work/log" 2>&1 || fail "prepare_data with sentencepiece failed: $(cat "$work/log")"
"$py" - "$work" <<'PY' || fail "the sentencepiece outputs do not match the model"
import array, hashlib, json, os, sys
import sentencepiece as spm
w = sys.argv[1]
sp = spm.SentencePieceProcessor(model_file=os.path.join(w, "spm", "tokenizer.model"))
docs = [open(os.path.join(w, p), encoding="utf-8").read() for p in ("docs/a.txt", "docs/b.txt", "docs/sub/c.txt")]
docs += [json.loads(l)["text"] for l in open(os.path.join(w, "docs.jsonl"))]
docs.append(open(os.path.join(w, "loose.txt"), encoding="utf-8").read())
want = {"train": [], "valid": []}
for i, d in enumerate(docs):
    h = int.from_bytes(hashlib.sha256(f"7:{i}".encode()).digest()[:8], "little")
    want["valid" if h / 2.0**64 < 0.3 else "train"] += sp.encode(d) + [2]
for part in ("train", "valid"):
    got = array.array("H")
    with open(os.path.join(w, "out", f"sp.{part}.bin"), "rb") as f:
        got.frombytes(f.read())
    assert list(got) == want[part], (part, len(got), len(want[part]))
meta = json.load(open(os.path.join(w, "out", "sp.json")))
assert meta["tokenizer_kind"] == "sentencepiece" and meta["vocab_size"] == 60 and meta["eod_id"] == 2, meta
print("prepare_data_test: sentencepiece", len(want["train"]), "+", len(want["valid"]), "tokens")
PY

# Bad input: each named, exit 1, nothing half-written, the earlier outputs untouched.
expect_error() {  # expect_error "expected text" args...
  local want=$1; shift
  bash "$prep" "$@" > "$work/err" 2>&1 && fail "accepted: $*"
  grep -q -- "$want" "$work/err" || fail "expected '$want', got: $(cat "$work/err")"
  ! ls "$work"/out/*.partial > /dev/null 2>&1 || fail "a partial file was left behind by: $*"
}
sum_before=$(cat "$work"/out/corpus.* | md5sum)
expect_error "corpus.train.bin' exists (--overwrite replaces it)" --tokenizer "$work/model" --out "$work/out/corpus" "${inputs[@]}"
echo '{"body": "no text field"}' > "$work/bad.jsonl"
expect_error "bad.jsonl:1: no 'text' field" --tokenizer "$work/model" --out "$work/out/bad" "$work/bad.jsonl"
printf 'ok\xff\xfe' > "$work/bad.txt"
expect_error "bad.txt: not valid UTF-8 at byte offset 2" --tokenizer "$work/model" --out "$work/out/bad" "$work/loose.txt" "$work/bad.txt"
mkdir -p "$work/small"
cp "$work/model/tokenizer.json" "$work/model/tokenizer_config.json" "$work/small/"
echo '{"vocab_size": 100}' > "$work/small/config.json"
expect_error "more than the model's vocab_size=100" --tokenizer "$work/small" --out "$work/out/bad" "$work/loose.txt"
expect_error "no document went to validation" --tokenizer "$work/model" --out "$work/out/bad" --valid-fraction 0.01 "$work/loose.txt"
expect_error "--eod 'nope' is not in the tokenizer's vocabulary" --tokenizer "$work/model" --eod nope --out "$work/out/bad" "$work/loose.txt"
# Files that cannot be read or written: named, not a Python traceback (there was one).
expect_error "prepare_data: error: $work/loose.txt: File exists" --tokenizer "$work/model" --out "$work/loose.txt/x" "$work/loose.txt"
grep -q Traceback "$work/err" && fail "a traceback: $(cat "$work/err")"
mkdir -p "$work/unreadable.txt"
expect_error "input directory '$work/unreadable.txt' holds no files" --tokenizer "$work/model" --out "$work/out/bad" "$work/unreadable.txt"
# Empty documents (an empty file, an empty text field) are skipped and counted (each became a
# document of the end-of-document token alone).
: > "$work/empty.txt"
printf '{"text": ""}\n{"text": "one short document here."}\n' > "$work/some_empty.jsonl"
bash "$prep" --tokenizer "$work/model" --out "$work/out/empties" --valid-fraction 0 "$work/empty.txt" "$work/some_empty.jsonl" \
  "$work/loose.txt" > "$work/log" 2>&1 || fail "empty documents: $(cat "$work/log")"
grep -q "prepare_data: 2 training documents .*; 2 empty document(s) skipped" "$work/log" || fail "empties: $(cat "$work/log")"
"$py" -c "import json, sys; m = json.load(open(sys.argv[1])); sys.exit(0 if m['documents']['train'] == 2 and m['empty_documents_skipped'] == 2 else 1)" \
  "$work/out/empties.json" || fail "the sidecar: $(cat "$work/out/empties.json")"
expect_error "the inputs hold no documents (1 empty)" --tokenizer "$work/model" --out "$work/out/bad" "$work/empty.txt"
[ "$(cat "$work"/out/corpus.* | md5sum)" = "$sum_before" ] || fail "a refused run changed the earlier outputs"
[ ! -e "$work/out/bad.json" ] || fail "a refused run left a sidecar"

# hp-train reads the result: a tiny Llama over the tokenizer's vocabulary, validating.
"$bin" --config "$src/configs/llama_tiny.yaml" --set model.vocab=512 --set data.type=binary \
  --set data.path="$work/out/corpus.train.bin" --set data.valid_path="$work/out/corpus.valid.bin" \
  --set seq_length=16 --set global_batch_size=4 --set train_steps=4 --set lr_warmup_steps=1 --set eval_interval=2 \
  --set eval_steps=0 --set output_dir= > "$work/log" 2>&1 || fail "hp-train on the prepared data failed: $(cat "$work/log")"
grep -q '^validation after step 4/4 | loss ' "$work/log" || fail "no validation line: $(cat "$work/log")"
echo "prepare_data_test: passed"
