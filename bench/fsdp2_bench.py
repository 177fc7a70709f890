#!/usr/bin/env python3
"""PyTorch FSDP2 baseline for bench/gpu_bench.cpp, on the GPU machine.

The same transformer as tests/fsdp/fsdp_model.h (pre-norm blocks: LayerNorm, causal
multi-head attention computed with matmul + softmax, 4x GELU MLP; an 8192-token embedding
tied to the output head), the same batch, fp32 parameters with bf16 compute and fp32
gradient reduction, AdamW, each block and the root under fully_shard, world size 1.
Also times the plain model with autocast (no FSDP) for reference. One JSON line per run:

    python3 bench/fsdp2_bench.py small|large [steps]
"""
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

CONFIGS = {"small": dict(dim=256, layers=32, batch=8, seq=256), "large": dict(dim=4096, layers=4, batch=8, seq=2048)}
VOCAB = 8192


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.n1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.n2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        dh = d // self.heads
        q, k, v = self.qkv(self.n1(x)).chunk(3, -1)
        q, k, v = (z.reshape(b, t, self.heads, dh).transpose(1, 2) for z in (q, k, v))
        scores = q.matmul(k.transpose(-2, -1)) / math.sqrt(dh)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        o = scores.masked_fill(mask, -1e9).softmax(-1).matmul(v).transpose(1, 2).reshape(b, t, d)
        h = x + self.proj(o)
        return h + self.fc2(F.gelu(self.fc1(self.n2(h))))


class Model(nn.Module):
    def __init__(self, dim, layers):
        super().__init__()
        heads = min(32, dim // 64)
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.nf = nn.LayerNorm(dim)

    def forward(self, tokens, targets):
        h = self.emb(tokens)
        for b in self.blocks:
            h = b(h)
        logits = self.nf(h).matmul(self.emb.weight.t())
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def timed(step, steps):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    ms.sort()
    return ms[len(ms) // 2], ms[0], torch.cuda.max_memory_allocated()


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    if which not in CONFIGS:
        sys.exit("usage: fsdp2_bench.py small|large [steps]")
    cfg = CONFIGS[which]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    tokens = torch.randint(VOCAB, (cfg["batch"], cfg["seq"] + 1), device=dev)
    x, y = tokens[:, :-1], tokens[:, 1:]
    results = []

    # FSDP2: each block, then the root; bf16 compute, fp32 reduce.
    model = Model(cfg["dim"], cfg["layers"]).to(dev)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def fsdp_step():
        opt.zero_grad()
        model(x, y).backward()
        opt.step()

    med, best, peak = timed(fsdp_step, steps)
    results.append(dict(impl="fsdp2", config=which, step_ms_median=med, step_ms_min=best, peak_bytes=peak, **cfg))
    del model, opt
    torch.cuda.empty_cache()

    # Plain eager with autocast (no FSDP), for reference.
    plain = Model(cfg["dim"], cfg["layers"]).to(dev)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-4)

    def plain_step():
        popt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = plain(x, y)
        loss.backward()
        popt.step()

    med, best, peak = timed(plain_step, steps)
    results.append(dict(impl="eager+autocast", config=which, step_ms_median=med, step_ms_min=best, peak_bytes=peak, **cfg))
    for r in results:
        print(json.dumps(r), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
