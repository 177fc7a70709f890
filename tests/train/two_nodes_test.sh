#!/usr/bin/env bash
# A job across two "nodes" (scripts/two_nodes.sh: two network namespaces joined by a veth
# pair, each its own host to Open MPI), and a partition of their link:
#   1. HSDP with dp_replicate across the nodes and dp_shard within, 4 ranks: hp-train finds 2
#      ranks per node, and --verify matches one process;
#   2. a short partition (2 s, well under HP_COMM_TIMEOUT_S): the run completes, exit 0;
#   3. a partition past the timeout in the middle of a run: both ranks of the reachable node
#      raise an error naming the op, the group and the ranks on the other node, within the
#      timeout and a margin; `latest` stays a committed checkpoint that resumes;
#   4. a node lost (its processes all killed mid-run): the job ends (mpirun sees its daemon
#      gone), non-zero, within seconds; `latest` resumes;
#   5. the partition of 3 under scripts/launch.sh: the launcher sees the failed ranks' markers
#      and ends the mpirun that cannot end them, within the timeout + 60 s; with the link back
#      it relaunches, and the run ends bitwise equal to a run never disturbed;
#   6. a bandwidth cap on the link (tc's tbf, 10 Mbit/s; skipped, saying why, where tc has
#      none): the run completes, slower (bench/two_nodes_tbf.sh measures it against --plan);
#   7. (before 6) elastic relaunch onto fewer ranks: node b lost for good at step 7 of 20, the
#      launcher relaunches on node a's 2 ranks and hp-train --elastic lays the checkpoint out
#      on them; equal, bit for bit, to the same checkpoint resumed on 2 ranks by hand.
# Skipped (77), saying why, where namespaces cannot be made (not root, no ip or unshare).
# Leaves no namespace or link behind, however it ends.
# Usage: two_nodes_test.sh <hp-train> <source dir>
set -uo pipefail
bin=$1 src=$2
nodes=$src/scripts/two_nodes.sh
name=t$$
name=${name:0:8}
work=$(mktemp -d)
cleanup() { bash "$nodes" "$name" destroy; rm -rf "$work"; }
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() { echo "FAIL: $*"; exit 1; }
[ "$(id -u)" = 0 ] || { echo "SKIP: not root (network namespaces need it)"; exit 77; }
for tool in ip unshare mpirun; do
  command -v $tool > /dev/null || { echo "SKIP: no $tool on this machine"; exit 77; }
done
bash "$nodes" "$name" create || { echo "SKIP: the namespaces or their link cannot be made here"; exit 77; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cfg=(--config "$src/configs/llama_tiny.yaml" --set data_parallel=2 --set data_parallel_shard=2 --set lr_warmup_steps=1)

# 1. HSDP across the nodes against one process.
timeout 120 bash "$nodes" "$name" run 2 "$bin" "${cfg[@]}" --set train_steps=3 --set output_dir= --verify \
  > "$work/verify" 2>&1 || fail "the run across two nodes failed: $(tail -5 "$work/verify")"
grep -q "on 4 rank(s), 2 per node" "$work/verify" || fail "2 ranks per node not found: $(head -2 "$work/verify")"
grep -q "data_parallel 2 x data_parallel_shard 2 (HSDP)" "$work/verify" || fail "not HSDP: $(grep layout "$work/verify")"
rel=$(sed -n 's/^verify: largest |loss - single-process loss| over 3 steps: .*(relative \([0-9.e+-]*\)).*/\1/p' "$work/verify")
# fp32, 3 steps, the gradients summed over 4 ranks in another order than one process sums
# them: cli_test's bound for the same --verify under tensor parallelism (measured: 1.5e-7).
[ -n "$rel" ] && python3 -c "import sys; sys.exit(0 if float('$rel') < 1e-5 else 1)" ||
  fail "across two nodes, relative difference to one process '$rel' (fp32: < 1e-5)"

# A run of many steps in the background, its log at $work/$1.log.
start_run() {
  local tag=$1; shift
  HP_COMM_TIMEOUT_S=10 timeout 300 bash "$nodes" "$name" run 2 "$bin" "${cfg[@]}" --set log_interval=1 \
    --set save_interval=2 --set output_dir="$work/$tag" "$@" > "$work/$tag.log" 2>&1 &
  job=$!
}
wait_step() {  # wait_step TAG K: until step K is logged
  for _ in $(seq 600); do grep -q "^step *$2/" "$work/$1.log" && return 0; sleep 0.1; done
  fail "$1: step $2 never came: $(tail -5 "$work/$1.log")"
}

# 2. A 2 s partition: TCP carries the ops over it; the run completes.
start_run short --set train_steps=40
wait_step short 3
bash "$nodes" "$name" down; sleep 2; bash "$nodes" "$name" up
wait $job; rc=$?
[ $rc = 0 ] || fail "a 2 s partition: exit $rc: $(grep -E "error|^step" "$work/short.log" | tail -5)"
grep -q "^step 40/40" "$work/short.log" || fail "a 2 s partition: the run did not end: $(tail -3 "$work/short.log")"

# 3. A partition past the 10 s timeout, in the middle of the run.
start_run long --set train_steps=100000
wait_step long 5
t0=$(date +%s.%N)
bash "$nodes" "$name" down
# Counted where they appear in a line: two ranks' lines could interleave (hp-train writes each
# in one write now, but mpirun forwards each rank's output on its own).
failed_ranks() { grep -o "hp-train: error (rank [01])" "$work/long.log" | sort -u | wc -l; }
for _ in $(seq 400); do
  [ "$(failed_ranks)" -ge 2 ] && break
  sleep 0.1
done
took=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
errors=$(grep "hp-train: error (rank [01])" "$work/long.log")
[ "$(failed_ranks)" -ge 2 ] || fail "the reachable node's ranks did not both fail: $(tail -8 "$work/long.log")"
echo "$errors" | grep -q "timed out after 10000 ms" || fail "no timeout named: $errors"
echo "$errors" | grep -q "on group '" || fail "no group named: $errors"
echo "$errors" | grep -q "rank(s) on other nodes could not be checked" || fail "the other node's ranks not named: $errors"
python3 -c "import sys; sys.exit(0 if $took <= 25 else 1)" || fail "the errors came $took s after the partition (timeout 10 s)"
echo "two_nodes_test: partition: both reachable ranks failed $took s after it"
# mpirun cannot reach the far node's daemon and does not return: ended here.
kill "$job" 2> /dev/null; wait "$job" 2> /dev/null
bash "$nodes" "$name" up
latest=$(cat "$work/long/checkpoints/latest")
[ -e "$work/long/checkpoints/$latest/metadata.json" ] || fail "latest names '$latest', which is not committed"
timeout 120 bash "$nodes" "$name" run 2 "$bin" "${cfg[@]}" --set train_steps=$(( ${latest#step_} + 1 )) \
  --set save_interval=0 --set output_dir="$work/long" --resume --resume-changes train_steps > "$work/resume.log" 2>&1 ||
  fail "latest ($latest) does not resume: $(grep error "$work/resume.log" | head -3)"

# 4. A node lost: node b's processes all killed (SIGKILL) mid-run.
start_run lost --set train_steps=100000
wait_step lost 5
t0=$(date +%s.%N)
kill -9 $(ip netns pids "$name-b") 2> /dev/null
for _ in $(seq 600); do kill -0 "$job" 2> /dev/null || break; sleep 0.1; done
took=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
kill -0 "$job" 2> /dev/null && fail "the job did not end within 60 s of losing a node: $(tail -5 "$work/lost.log")"
wait "$job"; rc=$?
[ $rc != 0 ] || fail "the job that lost a node exited 0"
echo "two_nodes_test: a node lost: the job ended $took s after, exit $rc"
latest=$(cat "$work/lost/checkpoints/latest")
timeout 120 bash "$nodes" "$name" run 2 "$bin" "${cfg[@]}" --set train_steps=$(( ${latest#step_} + 1 )) \
  --set save_interval=0 --set output_dir="$work/lost" --resume --resume-changes train_steps > "$work/resume.log" 2>&1 ||
  fail "after a node lost, latest ($latest) does not resume: $(grep error "$work/resume.log" | head -3)"

# 5. The partition under the launcher, against an undisturbed run of the same 20 steps.
steps=(--set train_steps=20 --set save_interval=5 --set log_interval=1)
timeout 300 bash "$nodes" "$name" run 2 "$bin" "${cfg[@]}" "${steps[@]}" --set output_dir="$work/straight" \
  > "$work/straight.log" 2>&1 || fail "the undisturbed run failed: $(tail -3 "$work/straight.log")"
want=$(cd "$work/straight/checkpoints/step_00000020" && sha256sum rank*.safetensors)
HP_COMM_TIMEOUT_S=10 timeout 300 bash "$src/scripts/launch.sh" --rank-grace 5 --backoff 2 --max-restarts 3 -- \
  bash "$nodes" "$name" run 2 "$bin" "${cfg[@]}" "${steps[@]}" --set output_dir="$work/relaunched" \
  > "$work/relaunched.log" 2>&1 & launcher=$!
wait_step relaunched 7
t0=$(date +%s.%N)
bash "$nodes" "$name" down
for _ in $(seq 900); do grep -q "outlived its failed rank" "$work/relaunched.log" && break; sleep 0.1; done
took=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
grep -q "outlived its failed rank" "$work/relaunched.log" || fail "the launcher did not end the job: $(tail -5 "$work/relaunched.log")"
python3 -c "import sys; sys.exit(0 if $took <= 70 else 1)" || fail "the launcher ended the job $took s after the partition"
bash "$nodes" "$name" up
wait $launcher; rc=$?
[ $rc = 0 ] || fail "the relaunched run: exit $rc: $(grep -E "launch.sh|error" "$work/relaunched.log" | tail -5)"
got=$(cd "$work/relaunched/checkpoints/step_00000020" && sha256sum rank*.safetensors)
[ "$got" = "$want" ] || fail "the relaunched run's last checkpoint differs from the undisturbed run's"
grep -q '"resume":{"step":[0-9]*,.*"cause":"exit status 1' "$work/relaunched/metrics.jsonl" ||
  fail "no resume record: $(grep resume "$work/relaunched/metrics.jsonl")"
echo "two_nodes_test: under the launcher: the job ended $took s after the partition, relaunched, bitwise"

# 7. Elastic relaunch onto fewer ranks (the launcher's --nodes-file, --node-check and
# --min-ranks; hp-train --elastic): node b lost for good at step 7 of 20, the job relaunched on
# node a's 2 ranks, laid out by the planner with the same global batch. Against the same
# checkpoint of an undisturbed run resumed on 2 ranks by hand in that layout: the same losses
# and the same last checkpoint, bit for bit (the same computation); every step once in
# metrics.jsonl, the relaunch recorded with its ranks.
printf 'a 2\nb 2\n' > "$work/nodes"
HP_COMM_TIMEOUT_S=10 timeout 300 bash "$src/scripts/launch.sh" --nodes-file "$work/nodes" --min-ranks 2 \
  --node-check "bash $nodes $name check" --rank-grace 5 --backoff 1 --max-restarts 2 -- \
  bash "$nodes" "$name" run-on {hosts} "$bin" "${cfg[@]}" "${steps[@]}" --set output_dir="$work/elastic" \
  > "$work/elastic.log" 2>&1 & launcher=$!
wait_step elastic 7
bash "$nodes" "$name" lose b
wait $launcher; rc=$?
[ $rc = 0 ] || fail "the elastic relaunch: exit $rc: $(grep -E "launch.sh|error" "$work/elastic.log" | tail -5)"
grep -q "launching on 2 rank(s) (a:2), left out: b (--node-check failed)" "$work/elastic.log" ||
  fail "the relaunch's hosts not said: $(grep launch.sh "$work/elastic.log")"
chose=$(sed -n 's/^elastic: .* on 2 rank(s) now: dp_replicate=\([0-9]*\) dp_shard=\([0-9]*\) tp=1 pp=1, micro_batch_num=\([0-9]*\), .*/\1 \2 \3/p' \
  "$work/elastic.log")
read -r rep shard mbn <<< "$chose"
# 2 data-parallel ranks (tp and pp 1), 16 samples in micro-batches of 4: 2 micro-batches each.
[ -n "$mbn" ] && [ $((rep * shard)) = 2 ] && [ "$mbn" = 2 ] ||
  fail "the elastic layout '$chose' keeps neither 2 ranks nor micro-batches of 4: $(grep elastic: "$work/elastic.log")"
python3 - "$work/elastic/metrics.jsonl" > "$work/elastic.resumed" <<'PY' || fail "elastic metrics: $(cat "$work/elastic.resumed")"
import json, sys
steps, resumes = [], []
for line in open(sys.argv[1]):
    e = json.loads(line)
    if "resume" in e: resumes.append(e["resume"])
    elif "step" in e: steps.append(e["step"])
assert steps == list(range(1, 21)), f"steps {steps}"
assert len(resumes) == 1 and resumes[0]["ranks"] == 2 and "on 2 rank(s) (a:2), left out: b" in resumes[0]["cause"], resumes
print(resumes[0]["step"])
PY
k=$(cat "$work/elastic.resumed")
# The undisturbed run of 5 (the same config on 4 ranks): its checkpoint of step k resumed on
# node a by hand.
timeout 300 bash "$nodes" "$name" run-on a:2 "$bin" "${cfg[@]:0:2}" --set lr_warmup_steps=1 "${steps[@]}" --set output_dir="$work/by_hand" \
  --set data_parallel=$rep --set data_parallel_shard=$shard --set micro_batch_num=$mbn \
  --resume "$work/straight/checkpoints/$(printf 'step_%08d' "$k")" > "$work/by_hand.log" 2>&1 ||
  fail "the resume by hand failed: $(grep error "$work/by_hand.log" | head -3)"
losses() { python3 -c "import json,sys; [print(e['step'], e['loss']) for e in map(json.loads, open(sys.argv[1])) if 'loss' in e and e['step'] > $k]" "$1"; }
[ "$(losses "$work/elastic/metrics.jsonl")" = "$(losses "$work/by_hand/metrics.jsonl")" ] ||
  fail "after the relaunch the losses differ from the resume by hand: $(losses "$work/elastic/metrics.jsonl" | head -3) vs $(losses "$work/by_hand/metrics.jsonl" | head -3)"
# And against the undisturbed run on 4 ranks itself: the same samples in each step and the same
# optimizer state, summed in another order (2 micro-batches of 4 on 2 ranks, not 1 on 4); fp32
# over 15 steps, the bound of --verify's 3 steps (1e-5) taken 10 times for the steps (a data
# position off by one batch moves the loss by about 1e-2).
python3 - "$work/elastic/metrics.jsonl" "$work/straight/metrics.jsonl" "$k" > "$work/elastic.rel" <<'PY' ||
import json, sys
loss = lambda f: {e["step"]: e["loss"] for e in map(json.loads, open(f)) if "loss" in e}
a, b, k = loss(sys.argv[1]), loss(sys.argv[2]), int(sys.argv[3])
rel = max(abs(a[s] - b[s]) / abs(b[s]) for s in range(k + 1, 21))
print(f"{rel:.2e}")
sys.exit(0 if rel < 1e-4 else 1)
PY
  fail "the elastic run's losses after step $k differ from the undisturbed run's by $(cat "$work/elastic.rel") relative (< 1e-4)"
[ "$(cd "$work/elastic/checkpoints/step_00000020" && sha256sum rank*.safetensors)" = \
  "$(cd "$work/by_hand/checkpoints/step_00000020" && sha256sum rank*.safetensors)" ] ||
  fail "the elastic run's last checkpoint differs from the resume by hand's"
bash "$nodes" "$name" destroy && bash "$nodes" "$name" create || fail "the nodes cannot be made again"  # b back
echo "two_nodes_test: elastic: node b lost at step 7, relaunched on 2 ranks (dp_replicate=$rep dp_shard=$shard," \
  "micro_batch_num=$mbn) from step $k; losses and last checkpoint equal to the resume by hand; losses within" \
  "$(cat "$work/elastic.rel") relative of the undisturbed run's"

# 6. A bandwidth cap on the link.
if ip netns exec "$name-a" tc qdisc add dev "${name}va" root tbf rate 10mbit burst 32kb latency 400ms 2> /dev/null &&
   ip netns exec "$name-b" tc qdisc add dev "${name}vb" root tbf rate 10mbit burst 32kb latency 400ms 2> /dev/null; then
  timeout 300 bash "$nodes" "$name" run 2 "$bin" "${cfg[@]}" --set train_steps=5 --set output_dir= > "$work/capped.log" 2>&1 ||
    fail "under a 10 Mbit/s cap: $(tail -3 "$work/capped.log")"
  echo "two_nodes_test: under a 10 Mbit/s cap: $(grep '^done' "$work/capped.log")"
else
  echo "two_nodes_test: the bandwidth cap skipped: tc has no tbf here"
fi
echo "two_nodes_test: all checks passed"
