#!/usr/bin/env bash
# HSDP 2 x 2 across two "nodes" (scripts/two_nodes.sh) under a bandwidth cap on their link
# (tc's tbf on each end), against the planner's prediction for the same link. For each cap
# (Mbit/s) it prints the measured step time (20 steps of configs/llama_tiny.yaml, the mean
# after the first) and hp-train --plan's step for that layout with the inter-node link at the
# cap per rank, and at the cap shared by the node's 2 ranks; the uncapped run first, as the
# baseline of the same session. Root only; skipped (exit 77) where tc has no tbf.
# Usage: bench/two_nodes_tbf.sh <hp-train> [Mbit/s ...]     (default: 10 4)
set -uo pipefail
bin=$1; shift
caps=("$@"); [ ${#caps[@]} -gt 0 ] || caps=(10 4)
src=$(cd "$(dirname "$0")/.." && pwd)
nodes=$src/scripts/two_nodes.sh name=tb$$; name=${name:0:8}
trap 'bash "$nodes" "$name" destroy' EXIT
[ "$(id -u)" = 0 ] || { echo "two_nodes_tbf: SKIP: not root"; exit 77; }
bash "$nodes" "$name" create || { echo "two_nodes_tbf: SKIP: no namespaces here"; exit 77; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cfg=(--config "$src/configs/llama_tiny.yaml" --set data_parallel=2 --set data_parallel_shard=2)
step_ms() {  # the run's mean step time after the first, from metrics.jsonl
  rm -rf "/tmp/$name-out"
  timeout 600 bash "$nodes" "$name" run 2 "$bin" "${cfg[@]}" --set train_steps=20 --set output_dir="/tmp/$name-out" \
    > /dev/null 2>&1 || { echo "two_nodes_tbf: the run failed" >&2; exit 1; }
  python3 -c "import json, sys; s = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{\"step\"')]
print(round(1e3 * sum(x['step_time_s'] for x in s[1:]) / (len(s) - 1), 1))" "/tmp/$name-out/metrics.jsonl"
}
planned_ms() {  # planned_ms GB_PER_S: --plan's step for dp_replicate=2 dp_shard=2
  "$bin" "${cfg[@]}" --plan --world 4 --link "20:5.8,100:$1:2" 2>&1 |
    sed -n 's/.*dp_replicate=2 dp_shard=2 tp=1 pp=1 .* \([0-9.]*\)ms$/\1/p' | head -1
}
printf '%-10s %12s %16s %18s\n' cap measured_ms planned_per_rank planned_shared_by_2
printf '%-10s %12s %16s %18s\n' none "$(step_ms)" - -
for mbit in "${caps[@]}"; do
  ip netns exec "$name-a" tc qdisc add dev "${name}va" root tbf rate "${mbit}mbit" burst 32kb latency 400ms 2> /dev/null &&
    ip netns exec "$name-b" tc qdisc add dev "${name}vb" root tbf rate "${mbit}mbit" burst 32kb latency 400ms ||
    { echo "two_nodes_tbf: SKIP: tc has no tbf here"; exit 77; }
  gbps=$(python3 -c "print($mbit / 8e3)") half=$(python3 -c "print($mbit / 16e3)")
  printf '%-10s %12s %16s %18s\n' "${mbit}Mbit" "$(step_ms)" "$(planned_ms "$gbps")" "$(planned_ms "$half")"
  ip netns exec "$name-a" tc qdisc del dev "${name}va" root
  ip netns exec "$name-b" tc qdisc del dev "${name}vb" root
done
rm -rf "/tmp/$name-out"
