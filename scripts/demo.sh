#!/usr/bin/env bash
# README command 1: builds hp-train and trains the tiny DeepSeek-V3-style model for 50
# steps on 4 ranks of this machine, as HSDP 2 x 2 (bf16 parameters, fp32 gradient
# reduction and master weights), with --verify: the same training in one process first,
# then each step's loss difference against it. Extra arguments go to hp-train, e.g.
#   scripts/demo.sh --set train_steps=100
# Outputs: hp-train-out/deepseek_tiny/{metrics.jsonl,loss.svg}.
set -euo pipefail

cd "$(dirname "$0")/.."

bash scripts/build.sh hp-train
bash scripts/mpirun.sh 4 build/hp-train --config configs/deepseek_tiny.yaml --verify "$@"
