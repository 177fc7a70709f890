#!/usr/bin/env bash
# Float8.AgreesWithPyTorch against PyTorch 2.11's float8_e4m3fn: PyTorch (the environment
# scripts/torch2_check.sh installs, HP_TORCH2_VENV, default ~/.cache/hyperparallel/torch-2.11)
# writes every byte as F8_E4M3 with its float32 value, and 4000 float32 values (random, the
# midpoints between codes, within +-448) with their float8_e4m3fn bytes; the test decodes and
# encodes the same and compares bit for bit. Skipped (77), saying why, without PyTorch 2.x.
# Usage: float8_torch.sh <ckpt_unit_test> <build dir>
set -uo pipefail
bin=$1 build=$2
py=${HP_TORCH2_VENV:-$HOME/.cache/hyperparallel/torch-2.11}/bin/python
if ! "$py" -c 'import torch; torch.float8_e4m3fn' 2> /dev/null; then
  echo "float8_torch.sh: SKIP: no PyTorch 2.x at $py (scripts/torch2_check.sh installs it)"
  exit 77
fi
ref=$build/float8_reference.safetensors
"$py" - "$ref" <<'PY' || exit 1
import json
import struct
import sys

import torch


def save_file(tensors, path):  # safetensors' layout, written here (F8_E4M3 as PyTorch's bytes)
    names = {torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32", torch.uint8: "U8"}
    header, data = {}, b""
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)

codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
g = torch.Generator().manual_seed(11)
x = torch.cat([
    (torch.rand(2000, generator=g) * 2 - 1) * 448,                   # the whole range
    torch.exp(torch.rand(1000, generator=g) * 20 - 16) * torch.sign(torch.randn(1000, generator=g)),  # every binade
])
vals = codes[:0x7E].to(torch.float32)
mids = (vals[:-1] + vals[1:]) / 2                                     # ties: to the even code
x = torch.cat([x, mids, -mids, vals, -vals]).to(torch.float32)
save_file({"codes": codes, "decoded": codes.to(torch.float32), "x": x,
           "x_codes": x.to(torch.float8_e4m3fn).view(torch.uint8)}, sys.argv[1])
PY
HP_TEST_FLOAT8_REFERENCE=$ref exec "$bin" --gtest_filter='Float8.AgreesWithPyTorch'
