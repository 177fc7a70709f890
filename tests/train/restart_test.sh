#!/usr/bin/env bash
# Surviving faults (issue 33): scripts/launch.sh relaunches a 60-step run on 4 ranks whose
# ranks are killed with SIGKILL at 5 random steps, and the run ends with every parameter and
# optimizer state bitwise equal to a run never killed (the last checkpoint's files compared
# byte for byte), each step in metrics.jsonl once with the same loss, and each restart
# recorded. A SIGTERM to one rank, or a stop signal to the launcher, stops the job after the
# step in flight with a checkpoint of that step and exit status 75 (not relaunched); the
# same command continues it to the same bits. A second signal 10 ms after the first is the
# same notice (hp-train's 5 s grace): the job saves and stops as for one.
# Usage: restart_test.sh <hp-train> <source dir> <mpirun> [seed]
set -uo pipefail
bin=$1 src=$2 mpirun=$3 seed=${4:-$RANDOM}
work=$(mktemp -d)
killer=""
trap '[ -n "$killer" ] && kill $killer 2> /dev/null; rm -rf "$work"' EXIT
fail() {  # with the errors the jobs printed
  echo "FAIL (seed $seed): $*"
  grep -h "error\|launch.sh:" "$work"/*.log 2> /dev/null | tail -n 12
  exit 1
}
RANDOM=$seed
echo "seed $seed"
# A simulated link of 2 ms per op slows a step to tens of ms (the bits do not change), so
# that a kill lands mid-run.
export HP_SIM_NET=2000:10 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
job() {  # job OUT_DIR: the command the launcher runs
  echo "$mpirun" -np 4 --oversubscribe --bind-to none "$bin" --config "$src/configs/llama_tiny.yaml" \
    --set train_steps=60 --set save_interval=5 --set log_interval=10 --set keep_last_n=3 --set output_dir="$1"
}
last_step() {  # the last step line in a run's metrics (0: none yet)
  local f=$1/metrics.jsonl.partial
  [ -e "$f" ] || f=$1/metrics.jsonl
  grep -o '^{"step":[0-9]*' "$f" 2> /dev/null | tail -n 1 | grep -o '[0-9]*$' || echo 0
}
ranks_of() { pgrep -f "^$bin .*output_dir=$1( |\$)"; }  # the rank processes, not mpirun
final_bits() { (cd "$1/checkpoints/step_00000060" && sha256sum rank*.safetensors); }
check_metrics() {  # every step 1..60 once, in order, with the straight run's loss
  python3 - "$work/straight/metrics.jsonl" "$1/metrics.jsonl" "$2" << 'PY' || fail "$1's metrics: see above"
import json, sys
def read(p):
    steps, resumes = [], []
    for line in open(p):
        j = json.loads(line)
        if "step" in j: steps.append((j["step"], j["loss"]))
        if "resume" in j: resumes.append(j["resume"])
    return steps, resumes
want, _ = read(sys.argv[1])
got, resumes = read(sys.argv[2])
ok = got == want and [s for s, _ in got] == list(range(1, 61))
if not ok: print("steps and losses differ from the straight run's:", [s for s, _ in got])
if len(resumes) != int(sys.argv[3]):
    ok = False
    print("expected", sys.argv[3], "resume records, got", resumes)
for r in resumes:
    print("resumed after step %d, %d step(s) lost: %s" % (r["step"], r["steps_lost"], r["cause"]))
    if not r["from"].endswith("step_%08d" % r["step"]) or r["steps_lost"] < 0:
        ok, _ = False, print("a bad resume record:", r)
sys.exit(0 if ok else 1)
PY
}

# The run never killed.
$(job "$work/straight") > "$work/straight.log" 2>&1 || fail "the straight run failed: $(tail "$work/straight.log")"
want=$(final_bits "$work/straight")

# 1. Killed at 5 random steps, one in each 11-step stretch, a random rank each time.
out=$work/killed
(
  for i in 0 1 2 3 4; do
    target=$((6 + 11 * i + RANDOM % 6))
    until [ "$(last_step "$out")" -ge $target ]; do sleep 0.02; done
    mapfile -t pids < <(ranks_of "$out")
    [ ${#pids[@]} -gt 0 ] || continue
    victim=${pids[$((RANDOM % ${#pids[@]}))]}
    kill -9 "$victim" && echo "killed pid $victim at step $(last_step "$out") (target $target)"
    until [ -z "$(ranks_of "$out" | grep -x "$victim")" ]; do sleep 0.02; done
  done
) > "$work/kills" 2>&1 &
killer=$!
# shellcheck disable=SC2046  # the job's words
timeout 400 bash "$src/scripts/launch.sh" --max-restarts 8 --backoff 0 -- $(job "$out") > "$work/launch.log" 2>&1
rc=$?
wait $killer; killer=""
cat "$work/kills"
[ $rc = 0 ] || fail "the launcher exited $rc: $(tail -20 "$work/launch.log")"
[ "$(grep -c '^killed pid' "$work/kills")" = 5 ] || fail "5 kills expected: $(cat "$work/kills")"
restarts=$(grep -c "launch.sh: the job failed: exit status" "$work/launch.log")
[ "$restarts" -ge 5 ] || fail "expected 5 relaunches, saw $restarts: $(grep launch.sh "$work/launch.log")"
grep -q "launch.sh: the run finished after $restarts restart(s)" "$work/launch.log" || fail "no final line: $(tail "$work/launch.log")"
[ "$(final_bits "$out")" = "$want" ] || fail "the relaunched run's last checkpoint differs from the straight run's"
check_metrics "$out" "$restarts"
grep -q '"cause":"exit status [0-9]*.*restart 1 of 8"' "$out/metrics.jsonl" || fail "no restart cause in the metrics"

# 2. SIGTERM to one rank at step >= 12: stops after the step in flight, saves it, exit 75,
# not relaunched; the same command continues it.
out=$work/preempted
# shellcheck disable=SC2046
bash "$src/scripts/launch.sh" --backoff 0 -- $(job "$out") > "$work/pre.log" 2>&1 &
launcher=$!
until [ "$(last_step "$out")" -ge 12 ]; do sleep 0.02; done
mapfile -t pids < <(ranks_of "$out")
kill -TERM "${pids[$((RANDOM % ${#pids[@]}))]}"
wait $launcher; rc=$?
[ $rc = 75 ] || fail "a preempted job's launcher exited $rc: $(tail "$work/pre.log")"
stopped=$(sed -n 's/.*"stop":{"step":\([0-9]*\),"signal":"SIGTERM".*/\1/p' "$out/metrics.jsonl.partial")
[ -n "$stopped" ] && [ "$stopped" -ge 12 ] || fail "no stop record at step >= 12: $(tail -2 "$out/metrics.jsonl.partial")"
[ "$(cat "$out/checkpoints/latest")" = "$(printf 'step_%08d' "$stopped")" ] || fail "latest is not the stopped step $stopped"
grep -q "launch.sh: the job failed" "$work/pre.log" && fail "a preemption was relaunched"
# shellcheck disable=SC2046
bash "$src/scripts/launch.sh" --backoff 0 -- $(job "$out") > "$work/pre2.log" 2>&1 || fail "continuing failed: $(tail "$work/pre2.log")"
grep -q "resumed from $out/checkpoints/$(printf 'step_%08d' "$stopped") after step $stopped" "$work/pre2.log" || fail "$(head -20 "$work/pre2.log")"
[ "$(final_bits "$out")" = "$want" ] || fail "the preempted run's last checkpoint differs from the straight run's"
check_metrics "$out" 1

# 3. A stop signal to the launcher itself (SLURM signals the batch script): passed on.
out=$work/signalled
# shellcheck disable=SC2046
bash "$src/scripts/launch.sh" --backoff 0 -- $(job "$out") > "$work/sig.log" 2>&1 &
launcher=$!
until [ "$(last_step "$out")" -ge 8 ]; do sleep 0.02; done
kill -TERM $launcher
wait $launcher; rc=$?
[ $rc = 75 ] || fail "a signalled launcher exited $rc: $(tail "$work/sig.log")"
grep -q '"stop":{"step":[0-9]*,"signal":"SIGUSR1"' "$out/metrics.jsonl.partial" || fail "no stop record: $(tail -3 "$work/sig.log")"

# 4. Two signals 10 ms apart (a scheduler signalling twice): the second, within hp-train's
# 5 s grace, is the same notice, so the job saves and exits 75 (before the grace it ended the
# job at once, losing the steps since the last checkpoint; a second signal after the grace
# still does: train_unit_test's Preemption.ASecondSignalAfterTheGraceEndsTheProcessAtOnce);
# 'latest' names a committed checkpoint, from which the run continues to the same bits.
out=$work/twice
$(job "$out") > "$work/twice.log" 2>&1 &
job_pid=$!
until [ "$(last_step "$out")" -ge 7 ]; do sleep 0.02; done
mapfile -t pids < <(ranks_of "$out")
kill -TERM "${pids[0]}"; sleep 0.01; kill -TERM "${pids[0]}" 2> /dev/null
wait $job_pid; rc=$?
[ $rc = 75 ] || fail "two signals 10 ms apart: exit $rc, not 75 (saved): $(tail "$work/twice.log")"
latest=$(cat "$out/checkpoints/latest")
[ -e "$out/checkpoints/$latest/metadata.json" ] || fail "two signals: latest names '$latest', not committed"
# shellcheck disable=SC2046
bash "$src/scripts/launch.sh" --backoff 0 -- $(job "$out") > "$work/twice2.log" 2>&1 || fail "continuing failed: $(tail "$work/twice2.log")"
[ "$(final_bits "$out")" = "$want" ] || fail "after two signals the last checkpoint differs from the straight run's"

# 5. What the launcher refuses, and giving up.
bash "$src/scripts/launch.sh" -- "$bin" --config x --resume > "$work/out" 2>&1; [ $? = 2 ] || fail "--resume accepted"
grep -q "leave '--resume' out" "$work/out" || fail "--resume: $(cat "$work/out")"
bash "$src/scripts/launch.sh" --max-restarts 2 --backoff 0 -- false > "$work/out" 2>&1; rc=$?
[ $rc = 1 ] || fail "a job that always fails: exit $rc"
grep -q "giving up: the job failed 3 time(s), exit statuses 1 1 1; 2 restart(s) allowed" "$work/out" || fail "$(cat "$work/out")"
echo "PASS"
