"""A reader of hyperparallel's distributed checkpoints written from the format that
docs/ckpt.md describes, with Python's standard library alone: it shares no code with the
library, so a test can hold what the library wrote against it.

  ckpt = Checkpoint(folder)          # reads metadata.json, verifies every file's checksums
  dtype, shape, data = ckpt.tensor(name)   # the whole tensor, row-major little-endian bytes

The folder holds metadata.json (format "hyperparallel-checkpoint-2": per tensor its dtype,
global shape and chunks, each a box `offsets`/`lengths` stored under `key` in `file`; per
file its size and 1 MiB block checksums; a checksum of the document itself) and
rank<R>.safetensors files. Format "hyperparallel-checkpoint-1" (before the document's
checksum) is read too. Everything read is checked: the format tag, the document's checksum,
each file's size and block checksums, each chunk's dtype and shape in its file, and that a
tensor's chunks cover it exactly once. A violation raises CheckpointError naming the file and
tensor.

python3 hp_checkpoint.py FOLDER prints each tensor's dtype, shape and chunk count.
"""
import itertools
import json
import os
import struct
import sys

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1}
_MASK = (1 << 64) - 1
_PRIME = 1099511628211


class CheckpointError(Exception):
    pass


def block_hash(block):
    """The checksum of one block (docs/ckpt.md): four 64-bit lanes fold the little-endian
    words of each 32-byte step by xor, multiply by the FNV prime and xor-shift by 29; the
    lanes are folded into one by xor and multiply, then the tail bytes one by one."""
    n = len(block)
    lanes = [(1469598103934665603 ^ n) & _MASK, 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9]
    full = n - n % 32
    words = struct.unpack_from("<%dQ" % (full // 8), block, 0)
    for k in range(0, len(words), 4):
        for lane in range(4):
            x = ((lanes[lane] ^ words[k + lane]) * _PRIME) & _MASK
            lanes[lane] = x ^ (x >> 29)
    out = lanes[0]
    for lane in lanes[1:]:
        out = ((out ^ lane) * _PRIME) & _MASK
    for byte in block[full:]:
        out = ((out ^ byte) * _PRIME) & _MASK
    return out


def metadata_checksum(meta):
    """The checksum metadata.json carries under "checksum" (decimal text): block_hash of the
    document without it, dumped compact with its keys sorted, UTF-8."""
    rest = {k: v for k, v in meta.items() if k != "checksum"}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return block_hash(text.encode("utf-8"))


def read_safetensors(path):
    """(header dict without __metadata__, the file's bytes, the data section's start)."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise CheckpointError(f"'{path}': {len(raw)} bytes, too short for a safetensors header")
    (header_len,) = struct.unpack_from("<Q", raw, 0)
    if 8 + header_len > len(raw):
        raise CheckpointError(f"'{path}': header length {header_len} runs past the file's {len(raw)} bytes")
    header = json.loads(raw[8:8 + header_len].decode("utf-8"))
    header.pop("__metadata__", None)
    return header, raw, 8 + header_len


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


class Checkpoint:
    def __init__(self, folder):
        self.folder = folder
        path = os.path.join(folder, "metadata.json")
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("format") not in ("hyperparallel-checkpoint-1", "hyperparallel-checkpoint-2"):
            raise CheckpointError(f"'{path}': format {meta.get('format')!r} is not "
                                  "'hyperparallel-checkpoint-2' (or -1)")
        if meta["format"] == "hyperparallel-checkpoint-2":
            if metadata_checksum(meta) != int(meta["checksum"]):
                raise CheckpointError(f"'{path}' was altered or damaged: its contents hash to "
                                      f"{metadata_checksum(meta)}, its checksum is {meta['checksum']}")
        self.values = meta.get("values", {})
        self.tensors = meta["tensors"]
        self._files = {}
        self.blocks_checked = 0
        for name, info in meta.get("files", {}).items():
            self._verify(name, info)

    def _verify(self, name, info):
        if "/" in name or name in ("", ".", ".."):
            raise CheckpointError(f"file '{name}' is not a file name inside the checkpoint")
        path = os.path.join(self.folder, name)
        if os.path.islink(path):
            raise CheckpointError(f"'{path}' is a symbolic link (a checkpoint's files are its own)")
        size = os.path.getsize(path)
        if info is None:
            return  # written before checksums
        if size != info["bytes"]:
            raise CheckpointError(f"'{path}' has {size} bytes, metadata.json says {info['bytes']}")
        block = info["block"]
        with open(path, "rb") as f:
            for k, expected in enumerate(info["checksums"]):
                data = f.read(block)
                if block_hash(data) != int(expected):
                    raise CheckpointError(f"'{path}': bytes {k * block}-{k * block + len(data)} do not match "
                                          "their checksum")
                self.blocks_checked += 1
        if len(info["checksums"]) != (size + block - 1) // block:
            raise CheckpointError(f"'{path}': {len(info['checksums'])} checksums for {size} bytes")

    def _file(self, name):
        if name not in self._files:
            if "/" in name or name.startswith(".") or not name:
                raise CheckpointError(f"chunk file '{name}' is not a file name inside the checkpoint")
            if os.path.islink(os.path.join(self.folder, name)):
                raise CheckpointError(f"chunk file '{name}' is a symbolic link (a checkpoint's files are its own)")
            self._files[name] = read_safetensors(os.path.join(self.folder, name))
        return self._files[name]

    def tensor(self, name):
        """(dtype string, global shape, bytes of the whole tensor in row-major order)."""
        t = self.tensors[name]
        dtype, shape = t["dtype"], list(t["shape"])
        es = DTYPE_BYTES[dtype]
        out = bytearray(_numel(shape) * es)
        covered = bytearray(_numel(shape))
        # Row-major strides (in elements) of the global tensor.
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        for c in t["chunks"]:
            header, raw, start = self._file(c["file"])
            entry = header.get(c["key"])
            off, lens = list(c["offsets"]), list(c["lengths"])
            if entry is None or entry["dtype"] != dtype or list(entry["shape"]) != lens:
                raise CheckpointError(f"'{c['file']}' lacks chunk '{c['key']}' of '{name}' as {dtype} {lens}")
            if len(off) != len(shape) or any(o < 0 or o + n > s for o, n, s in zip(off, lens, shape)):
                raise CheckpointError(f"chunk '{c['key']}' of '{name}' ({off} + {lens}) is outside {shape}")
            data = raw[start + entry["data_offsets"][0]:start + entry["data_offsets"][1]]
            if not shape:  # a 0-d tensor: one element
                out[:] = data
                covered[0] += 1
                continue
            row = lens[-1]
            outer = [range(n) for n in lens[:-1]]
            src = 0
            for idx in itertools.product(*outer):
                dst = sum((o + i) * st for o, i, st in zip(off, idx, strides)) + off[-1]
                out[dst * es:(dst + row) * es] = data[src * es:(src + row) * es]
                for e in range(dst, dst + row):
                    covered[e] += 1
                src += row
        if any(v != 1 for v in covered):
            raise CheckpointError(f"the chunks of '{name}' do not cover it exactly once")
        return dtype, shape, bytes(out)


if __name__ == "__main__":
    ck = Checkpoint(sys.argv[1])
    for n in sorted(ck.tensors):
        t = ck.tensors[n]
        print(f"{n}: {t['dtype']} {t['shape']} in {len(t['chunks'])} chunk(s)")
    print(f"{ck.blocks_checked} checksummed blocks verified")
