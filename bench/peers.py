#!/usr/bin/env python3
"""PyTorch on the CPU, the peer of bench/peers.sh: the bench transformer of fsdp_bench
(tests/fsdp/fsdp_model.h: pre-norm blocks of LayerNorm, causal attention by matmul and
softmax, a 4x GELU MLP; an embedding tied to the output head; vocab 512, dim 256, 4 heads,
4 blocks), fp32, AdamW, one compute thread per rank, the same per-rank batch. One JSON line:

    python3 peers.py eager B T [steps]                           one process
    torchrun-free: MASTER_ADDR/PORT, RANK, WORLD_SIZE set by peers.sh
    python3 peers.py ddp|fsdp1|fsdp2 B T [steps]                 each rank, gloo

The step time is the median over `steps` after 3 warm-up steps, the slowest rank's; peak
memory is the rank's maximum resident set (ru_maxrss), the only figure PyTorch gives for the
CPU allocator.
"""
import json
import math
import os
import resource
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, FFN, LAYERS = 512, 256, 4, 1024, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM)
        self.n2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, FFN)
        self.fc2 = nn.Linear(FFN, DIM)

    def forward(self, x):
        b, t, d = x.shape
        dh = d // HEADS
        q, k, v = self.qkv(self.n1(x)).chunk(3, -1)
        q, k, v = (z.reshape(b, t, HEADS, dh).transpose(1, 2) for z in (q, k, v))
        scores = q.matmul(k.transpose(-2, -1)) / math.sqrt(dh)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        o = scores.masked_fill(mask, -1e9).softmax(-1).matmul(v).transpose(1, 2).reshape(b, t, d)
        h = x + self.proj(o)
        return h + self.fc2(F.gelu(self.fc1(self.n2(h))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.nf = nn.LayerNorm(DIM)

    def forward(self, tokens, targets):
        h = self.emb(tokens)
        for b in self.blocks:
            h = b(h)
        logits = self.nf(h).matmul(self.emb.weight.t())
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def main():
    which, batch, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 15
    torch.set_num_threads(1)
    rank, world = 0, 1
    if which != "eager":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Model()
    if which == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif which == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    elif which == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1 + rank)
    data = torch.randint(VOCAB, (batch, tokens + 1))
    x, y = data[:, :-1], data[:, 1:]

    def step():
        opt.zero_grad()
        model(x, y).backward()
        opt.step()

    for _ in range(3):
        step()
    ms = []
    for _ in range(steps):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t0) * 1e3)
    med = sorted(ms)[len(ms) // 2]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if world > 1:
        t = torch.tensor([med, float(peak)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        med, peak = t[0].item(), int(t[1].item())
    if rank == 0:
        print(json.dumps(dict(impl=which, torch=torch.__version__, ranks=world, batch=batch, tokens=tokens,
                              step_ms=round(med, 2), peak_rss_bytes=peak)))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
