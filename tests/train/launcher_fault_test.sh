#!/usr/bin/env bash
# Surviving faults (issue 33): a rank killed (SIGKILL) inside a collective, fully_shard's
# 20th reduce-scatter over dp_shard (step 7 of 20: 3 a step, the two blocks' and the
# root's), injected by the test-only hp_train_fault (tests/train/fault_env.cpp) under
# scripts/launch.sh. The job fails, the launcher relaunches it once (the fault fired: the
# relaunch runs clean), it resumes from the last committed checkpoint (step 5), and its
# last checkpoint is bitwise a run never killed; the kill and the restart are recorded.
# Usage: launcher_fault_test.sh <hp-train> <hp_train_fault> <source dir> <mpirun>
set -uo pipefail
bin=$1 fault_bin=$2 src=$3 mpirun=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() {
  echo "FAIL: $*"
  grep -h "error\|launch.sh:\|SIGKILL\|resumed" "$work"/*.log 2> /dev/null | tail -n 12
  exit 1
}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
args=(--config "$src/configs/llama_tiny.yaml" --set train_steps=20 --set save_interval=5 --set log_interval=5)
"$mpirun" -np 2 --oversubscribe --bind-to none "$bin" "${args[@]}" --set output_dir="$work/straight" \
  > "$work/straight.log" 2>&1 || fail "the straight run failed"
want=$(cd "$work/straight/checkpoints/step_00000020" && sha256sum rank*.safetensors)

export HP_TEST_FAULT="kill:rank=1:op=reduce_scatter:nth=20:group=dp_shard" HP_TEST_FAULT_ONCE=$work/fired
# shellcheck disable=SC2068
timeout 300 bash "$src/scripts/launch.sh" --max-restarts 2 --backoff 0 -- "$mpirun" -np 2 --oversubscribe \
  --bind-to none "$fault_bin" ${args[@]} --set output_dir="$work/killed" > "$work/launch.log" 2>&1
rc=$?
[ $rc = 0 ] || fail "the launcher exited $rc"
grep -q "^reduce_scatter #[0-9]* on .*dp_shard" "$work/fired" 2> /dev/null || fail "the fault did not fire: $(cat "$work/fired" 2> /dev/null)"
[ "$(grep -c "launch.sh: the job failed: exit status" "$work/launch.log")" = 1 ] || fail "expected one relaunch"
grep -q "launch.sh: the run finished after 1 restart(s)" "$work/launch.log" || fail "no final line"
grep -q "resumed from $work/killed/checkpoints/step_00000005 after step 5" "$work/launch.log" || fail "not resumed from step 5"
got=$(cd "$work/killed/checkpoints/step_00000020" && sha256sum rank*.safetensors)
[ "$got" = "$want" ] || fail "the relaunched run's last checkpoint differs from the straight run's"
grep -q '"resume":{"step":5,.*"cause":"exit status 137' "$work/killed/metrics.jsonl" || fail "no resume record: $(grep resume "$work/killed/metrics.jsonl")"
echo "PASS ($(cat "$work/fired"))"
