#!/usr/bin/env python3
"""Tokenizes a corpus for hp-train with a model's own tokenizer.

Reads text files, directories of them, and JSON Lines files (one document per line, its
text in a field, `text` by default), tokenizes each document with the tokenizer of a
Hugging Face model folder (`tokenizer.json`, through the `tokenizers` package, or
`tokenizer.model`, through `sentencepiece`), puts an end-of-document token after each
document, splits the documents into a training and a validation part, and writes each part
as hp-train's binary format (little-endian token ids, uint16 when the vocabulary fits in
it, else uint32) with a JSON sidecar describing both:

    PREFIX.train.bin  PREFIX.valid.bin  PREFIX.json

The split is by document and deterministic: a document goes to validation when a hash of
(seed, its index in input order) falls below --valid-fraction. Documents are tokenized
without the tokenizer's own special tokens (no BOS); the end-of-document token is the
tokenizer's end-of-sequence token (from the folder's tokenizer_config.json or
config.json) unless --eod names one. Every file is written under a temporary name and
renamed into place when complete; an existing output is refused unless --overwrite.

scripts/prepare_data.sh runs this in a virtual environment it makes (with the packages).
"""

import argparse
import array
import hashlib
import json
import os
import sys


class InputError(Exception):
    """Bad input: printed as one line naming the offending file or value, exit 1."""


def documents(paths, json_key, skipped):
    """Yields (source, text) per document, in input order: a text file whole, each line of a
    .jsonl file; a directory contributes its files (recursively, sorted by path). An empty
    document (an empty file, an empty text field) holds nothing to learn: it is counted in
    skipped[0], not yielded (it became a document of the end-of-document token alone)."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            found = []
            for root, dirs, names in os.walk(p):
                dirs.sort()
                for n in sorted(names):
                    if not n.startswith("."):
                        found.append(os.path.join(root, n))
            if not found:
                raise InputError(f"input directory '{p}' holds no files")
            files.extend(found)
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise InputError(f"input '{p}' is neither a file nor a directory")
    for f in files:
        if f.endswith(".jsonl"):
            with open(f, "rb") as fh:
                for line_no, raw in enumerate(fh, 1):
                    if not raw.strip():
                        continue
                    where = f"{f}:{line_no}"
                    try:
                        obj = json.loads(raw.decode("utf-8"))
                    except (UnicodeDecodeError, json.JSONDecodeError) as e:
                        raise InputError(f"{where}: not a JSON object: {e}") from None
                    if not isinstance(obj, dict) or json_key not in obj:
                        raise InputError(f"{where}: no '{json_key}' field (--json-key names another)")
                    text = obj[json_key]
                    if not isinstance(text, str):
                        raise InputError(f"{where}: '{json_key}' is a {type(text).__name__}, not a string")
                    if not text:
                        skipped[0] += 1
                        continue
                    yield where, text
        else:
            with open(f, "rb") as fh:
                data = fh.read()
            if not data:
                skipped[0] += 1
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{f}: not valid UTF-8 at byte offset {e.start}") from None
            yield f, text


class Tokenizer:
    """A model folder's tokenizer (or a tokenizer file): encode(text) -> ids, vocab_size,
    eos_id (or None)."""

    def __init__(self, path):
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        self.folder = folder
        if os.path.isdir(path):
            for name in ("tokenizer.json", "tokenizer.model"):
                if os.path.isfile(os.path.join(path, name)):
                    path = os.path.join(path, name)
                    break
            else:
                raise InputError(f"tokenizer folder '{folder}' has no tokenizer.json or tokenizer.model")
        if not os.path.isfile(path):
            raise InputError(f"tokenizer '{path}' does not exist")
        self.path = path
        if path.endswith(".model"):
            try:
                import sentencepiece
            except ImportError:
                raise InputError("a tokenizer.model needs the sentencepiece package "
                                 "(scripts/prepare_data.sh installs it)") from None
            sp = sentencepiece.SentencePieceProcessor()
            try:
                sp.Load(path)
            except (OSError, RuntimeError) as e:
                raise InputError(f"tokenizer '{path}' cannot be read by sentencepiece: {e}") from None
            self.kind = "sentencepiece"
            self.vocab_size = sp.GetPieceSize()
            self._encode = lambda text: sp.EncodeAsIds(text)

            def sp_id(piece):  # sentencepiece answers unk_id for a piece it does not hold
                i = sp.PieceToId(piece)
                return None if i == sp.unk_id() and piece != sp.IdToPiece(i) else i

            self._id_of = sp_id
            self.eos_id = sp.eos_id() if sp.eos_id() >= 0 else None
        else:
            try:
                import tokenizers
            except ImportError:
                raise InputError("a tokenizer.json needs the tokenizers package "
                                 "(scripts/prepare_data.sh installs it)") from None
            try:
                tk = tokenizers.Tokenizer.from_file(path)
            except Exception as e:  # the package raises its own exception types
                raise InputError(f"tokenizer '{path}' cannot be read by tokenizers: {e}") from None
            self.kind = "tokenizers"
            self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
            self._encode = lambda text: tk.encode(text, add_special_tokens=False).ids
            self._id_of = tk.token_to_id
            self.eos_id = None
        # The model folder's own end-of-sequence token, where it names one.
        eos = self._folder_eos()
        if eos is not None:
            self.eos_id = eos

    def _folder_eos(self):
        cfg = os.path.join(self.folder, "tokenizer_config.json")
        if os.path.isfile(cfg):
            tok = read_json(cfg).get("eos_token")
            if isinstance(tok, dict):
                tok = tok.get("content")
            if isinstance(tok, str):
                i = self._id_of(tok)
                if i is None:
                    raise InputError(f"{cfg}: eos_token '{tok}' is not in the tokenizer's vocabulary")
                return i
        model_cfg = os.path.join(self.folder, "config.json")
        if os.path.isfile(model_cfg):
            i = read_json(model_cfg).get("eos_token_id")
            if isinstance(i, list) and i:
                i = i[0]
            if isinstance(i, int) and not isinstance(i, bool):
                return i
        return None

    def id_of(self, token):
        return self._id_of(token)

    def encode(self, text):
        return self._encode(text)


def read_json(path):
    try:
        with open(path, "rb") as fh:
            obj = json.loads(fh.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: not a readable JSON file: {e}") from None
    if not isinstance(obj, dict):
        raise InputError(f"{path}: not a JSON object")
    return obj


def goes_to_validation(seed, index, fraction):
    h = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2.0**64 < fraction


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="prepare_data",
        description="Tokenize text or JSON Lines documents into hp-train's binary format, "
        "split into training and validation by document.")
    p.add_argument("inputs", nargs="+", help="text files, directories of them, .jsonl files")
    p.add_argument("--tokenizer", required=True,
                   help="a Hugging Face model folder (tokenizer.json or tokenizer.model), or the file")
    p.add_argument("--out", required=True, help="output prefix: PREFIX.train.bin, PREFIX.valid.bin, PREFIX.json")
    p.add_argument("--valid-fraction", type=float, default=0.05,
                   help="share of the documents for validation (default 0.05; 0 = none)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the split (default 1234)")
    p.add_argument("--eod", help="end-of-document token (its text or id; default: the tokenizer's end-of-sequence)")
    p.add_argument("--json-key", default="text", help="the field holding a .jsonl document's text (default text)")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    return p.parse_args(argv)


def main(argv):
    a = parse_args(argv)
    if not (0.0 <= a.valid_fraction < 1.0):
        raise InputError(f"--valid-fraction={a.valid_fraction} is not in [0, 1)")
    tok = Tokenizer(a.tokenizer)
    vocab = tok.vocab_size
    model_cfg = os.path.join(tok.folder, "config.json")
    if os.path.isfile(model_cfg):
        model_vocab = read_json(model_cfg).get("vocab_size")
        if isinstance(model_vocab, int) and vocab > model_vocab:
            raise InputError(f"the tokenizer '{tok.path}' has {vocab} tokens, more than the model's "
                             f"vocab_size={model_vocab} in '{model_cfg}'")
    if a.eod is None:
        if tok.eos_id is None:
            raise InputError(f"the tokenizer '{tok.path}' names no end-of-sequence token: give --eod")
        eod = tok.eos_id
    elif a.eod.isdigit():
        eod = int(a.eod)
    else:
        eod = tok.id_of(a.eod)
        if eod is None:
            raise InputError(f"--eod '{a.eod}' is not in the tokenizer's vocabulary")
    if not (0 <= eod < vocab):
        raise InputError(f"the end-of-document token {eod} is not in [0, {vocab}) (the tokenizer's vocabulary)")
    dtype, code = ("uint16", "H") if vocab <= 65536 else ("uint32", "I")
    assert array.array("H").itemsize == 2 and array.array("I").itemsize == 4
    outs = {part: f"{a.out}.{part}.bin" for part in ("train", "valid")}
    meta_path = f"{a.out}.json"
    for path in list(outs.values()) + [meta_path]:
        if os.path.exists(path) and not a.overwrite:
            raise InputError(f"'{path}' exists (--overwrite replaces it)")
    out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(out_dir, exist_ok=True)
    docs = {"train": 0, "valid": 0}
    skipped = [0]
    tokens = {"train": 0, "valid": 0}
    partial = {part: path + ".partial" for part, path in outs.items()}
    try:
        with open(partial["train"], "wb") as train_f, open(partial["valid"], "wb") as valid_f:
            files = {"train": train_f, "valid": valid_f}
            for index, (_source, text) in enumerate(documents(a.inputs, a.json_key, skipped)):
                ids = array.array(code, tok.encode(text))
                ids.append(eod)
                part = "valid" if goes_to_validation(a.seed, index, a.valid_fraction) else "train"
                if sys.byteorder != "little":
                    ids.byteswap()
                ids.tofile(files[part])
                docs[part] += 1
                tokens[part] += len(ids)
            for f in files.values():
                f.flush()
                os.fsync(f.fileno())
        if docs["train"] + docs["valid"] == 0:
            raise InputError("the inputs hold no documents" + (f" ({skipped[0]} empty)" if skipped[0] else ""))
        if docs["train"] == 0:
            raise InputError(f"every document went to validation: lower --valid-fraction={a.valid_fraction}")
        if a.valid_fraction > 0 and docs["valid"] == 0:
            raise InputError(f"no document went to validation out of {docs['train']}: raise "
                             f"--valid-fraction={a.valid_fraction} or give more documents")
    except BaseException:
        for path in partial.values():  # nothing half-written stays behind
            if os.path.exists(path):
                os.remove(path)
        raise
    meta = {
        "format": "hp-train binary tokens",
        "tokenizer": os.path.abspath(tok.path),
        "tokenizer_kind": tok.kind,
        "vocab_size": vocab,
        "dtype": dtype,
        "eod_id": eod,
        "inputs": [os.path.abspath(p) for p in a.inputs],
        "json_key": a.json_key,
        "valid_fraction": a.valid_fraction,
        "seed": a.seed,
        "documents": docs,
        "empty_documents_skipped": skipped[0],
        "tokens": tokens,
        "files": {part: os.path.abspath(path) for part, path in outs.items()},
    }
    with open(meta_path + ".partial", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    for part, path in outs.items():
        os.replace(partial[part], path)
    os.replace(meta_path + ".partial", meta_path)
    print(f"prepare_data: {docs['train']} training documents ({tokens['train']} tokens), "
          f"{docs['valid']} validation documents ({tokens['valid']} tokens), {dtype} ids of a vocabulary of {vocab}"
          + (f"; {skipped[0]} empty document(s) skipped" if skipped[0] else ""))
    print("hp-train keys:")
    print("data:")
    print("  type: binary")
    print(f"  path: {os.path.abspath(outs['train'])}")
    if docs["valid"]:
        print(f"  valid_path: {os.path.abspath(outs['valid'])}")
    print(f"  token_dtype: {dtype}")
    print(f"model.vocab: at least {vocab}" + ("" if not docs["valid"] else "; eval_interval > 0 to evaluate"))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except InputError as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:  # a file that cannot be read or written: named, not a traceback
        where = f"{e.filename}: " if e.filename else ""
        print(f"prepare_data: error: {where}{e.strerror or e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("prepare_data: interrupted; nothing half-written was left", file=sys.stderr)
        sys.exit(130)
