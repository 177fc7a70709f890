#!/usr/bin/env bash
# The first seed's configuration end to end (configs/deepseek_seed_pp.yaml): 8 ranks as
# pipeline_parallel 2 x data_parallel_shard 2 x tensor_parallel 2 with sequence parallel,
# bf16 with the reduce dtype unset, comm fusion; with 1 and 2 stages per pipeline rank.
# Each run trains without error, its loss falls, and --verify stays within bf16 tolerance of
# one process. Bound: 1e-2 relative on the loss. Both runs round the same values to bf16 at
# different points (each rank's matmuls cover part of a dim and part of the batch; partial
# sums are reduced in bf16, gradients too, since the reduce dtype is unset), each rounding
# 2^-9 relative; the loss is a mean over 512 tokens of a 4-block model after a few AdamW
# steps in bf16, where those differences stay well under 1e-2 (the same bound and reason as
# trainer_test's Bf16Tp). The float64 form of the layout is trainer_test's np8 pipeline case
# (1e-10).
# Usage: seed_config_test.sh <hp-train> <source dir> <mpirun>
set -uo pipefail
bin=$1 src=$2 mpirun=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
steps=8
for v in 1 2; do
  "$mpirun" -np 8 --oversubscribe --bind-to none "$bin" --config "$src/configs/deepseek_seed_pp.yaml" --verify \
    --set pipeline_parallel_interleave_num=$v --set train_steps=$steps --set output_dir= > "$work/out" 2>&1 ||
    fail "interleave $v: the run failed: $(cat "$work/out")"
  cat "$work/out"
  grep -q "pipeline_parallel 2 (FSDP + TP, sequence_parallel on, loss parallel)" "$work/out" ||
    fail "interleave $v: no layout line naming the pipeline: $(cat "$work/out")"
  rel=$(sed -n "s/^verify: largest |loss - single-process loss| over $steps steps: .* (relative \([0-9.e+-]*\))/\1/p" "$work/out")
  [ -n "$rel" ] || fail "interleave $v: no verify line"
  python3 -c "import sys; sys.exit(0 if float('$rel') < 1e-2 else 1)" || fail "interleave $v: verify relative difference $rel >= 1e-2"
  read -r first last < <(sed -n 's/^done: .* | loss \([0-9.]*\) -> \([0-9.]*\) .*/\1 \2/p' "$work/out")
  [ -n "${first:-}" ] || fail "interleave $v: no summary line"
  python3 -c "import sys; sys.exit(0 if float('$last') < float('$first') - 0.05 else 1)" ||
    fail "interleave $v: the loss did not fall ($first -> $last)"
done
echo "seed config: ok"
