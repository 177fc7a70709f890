#!/usr/bin/env bash
# Muon's optimizer step inside hp-train against AdamW's: DeepSeek tiny-wide
# (configs/deepseek_tiny_wide.yaml: 74 Muon matrices) under fully_shard over N ranks
# (default 4), 30 steps each of AdamW, Muon with the owner scheme, Muon gathering every
# matrix everywhere, and Muon's owner scheme iterating in float32; then each run's median
# step, optimizer step (and its share of the rest of the step) and bytes sent per step,
# from its metrics.jsonl (scripts/compare_runs.py). BENCHMARKS.md, "Muon inside hp-train".
#
# Usage: bench/muon_train.sh [N] [OUT_DIR]   (default 4 and /tmp/hp-muon-train; build first)
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-4}"
out="${2:-/tmp/hp-muon-train}"
[[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "usage: $0 [N] [OUT_DIR]" >&2; exit 2; }
[ -x build/hp-train ] || { echo "$0: build/hp-train is missing: run scripts/build.sh" >&2; exit 2; }
mkdir -p "$out"
run() {  # label, then hp-train --set arguments
  local label="$1"
  shift
  rm -rf "${out:?}/$label"
  scripts/mpirun.sh "$n" build/hp-train --config configs/deepseek_tiny_wide.yaml --set output_dir="$out/$label" "$@" \
    > "$out/$label.log" 2>&1 || { echo "$0: the $label run failed:" >&2; tail -20 "$out/$label.log" >&2; exit 1; }
  grep '^done:' "$out/$label.log"
}
run adamw --set optimizer=adamw
run muon_owner --set optimizer=muon
run muon_gather --set optimizer=muon --set muon_scheme=gather_everywhere
run muon_owner_fp32 --set optimizer=muon --set muon_ns_dtype=float32
python3 scripts/compare_runs.py "$out/loss.svg" adamw="$out/adamw" muon_owner="$out/muon_owner" \
  muon_gather="$out/muon_gather" muon_owner_fp32="$out/muon_owner_fp32"
