#!/usr/bin/env bash
# Runs that cannot overwrite each other (issue 33, items 1, 2, 3, 7), as a user meets them:
# a second run into a folder holding checkpoints is refused and changes nothing; a lock
# names a live holder and a stale one is taken over; --overwrite starts over; --resume
# keeps the metrics of the steps before its checkpoint, once each; resuming a finished run
# changes no file; folders that cannot be written fail before the first step; flags given
# to some ranks only fail at once instead of hanging.
# Usage: run_folders_test.sh <hp-train> <source dir> [mpirun]
set -uo pipefail
bin=$1 src=$2 mpirun=${3:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
cfg=$src/configs/llama_tiny.yaml
out=$work/out
# 6 steps saving every 2, one validation at the end: steps, an eval line and a summary.
base=(--config "$cfg" --set train_steps=6 --set lr_warmup_steps=2 --set save_interval=2 --set log_interval=1
      --set eval_interval=6 --set eval_steps=1)
args=("${base[@]}" --set output_dir="$out")
state() { (cd "$out" && find . -type f | sort | xargs sha256sum); }  # every file and its bytes
steps_of() { python3 -c "
import json, sys
for l in open(sys.argv[1]):
    j = json.loads(l)
    if 'step' in j: print('step', j['step'], j['loss'])
    elif 'eval' in j: print('eval', j['eval']['step'])
    elif 'resume' in j: print('resume', j['resume']['step'], 'lost', j['resume']['steps_lost'], j['resume']['cause'])
    else: print('summary')" "$1"; }

"$bin" "${args[@]}" > "$work/a" 2>&1 || fail "the first run failed: $(cat "$work/a")"
[ "$(cat "$out/checkpoints/latest")" = step_00000006 ] || fail "no latest after the first run"
[ ! -e "$out/hp-train.lock" ] && [ ! -e "$out/checkpoints/hp-train.lock" ] || fail "a lock was left after a clean run"
steps_of "$out/metrics.jsonl" > "$work/a.steps" || fail "metrics.jsonl does not parse"
cp "$out/metrics.jsonl" "$work/a.metrics"
before=$(state)

# 1. The same command again (another seed): refused, nothing changed.
"$bin" "${args[@]}" --set seed=7 > "$work/b" 2>&1; rc=$?
[ $rc = 1 ] || fail "a second run into a save_dir with checkpoints exited $rc: $(cat "$work/b")"
grep -q "save_dir='$out/checkpoints' holds the checkpoints of an earlier run" "$work/b" ||
  fail "the earlier run's checkpoints were not named: $(cat "$work/b")"
grep -q -- "--resume.*--overwrite" "$work/b" || fail "the ways on were not given: $(cat "$work/b")"
grep -q "^step 1/" "$work/b" && fail "the refused run trained"
[ "$(state)" = "$before" ] || fail "the refused run changed files"

# 1. A live holder of the lock (this shell) refuses a second job, naming it.
printf 'host %s\npid %s\nsince 2026-01-01T00:00:00Z\n' "$(hostname)" $$ > "$out/hp-train.lock"
"$bin" "${args[@]}" --resume > "$work/c" 2>&1; rc=$?
[ $rc = 1 ] || fail "a locked output_dir was accepted (exit $rc): $(cat "$work/c")"
grep -q "output_dir='$out' is in use by another run: pid $$ on host $(hostname) since 2026-01-01T00:00:00Z" "$work/c" ||
  fail "the lock's holder was not named: $(cat "$work/c")"
grep -q "^step " "$work/c" && fail "the locked run trained"
# A holder that has exited but is not yet reaped (a zombie: a launcher that exits as its
# ranks die leaves them so for a moment, and a relaunch at once must not be refused).
( sh -c 'exit 0' & echo $! > "$work/zombie"; exec sleep 30 ) & parent=$!
for _ in $(seq 100); do [ "$(ps -o stat= -p "$(cat "$work/zombie" 2> /dev/null)" 2> /dev/null)" = Z ] && break; sleep 0.05; done
zombie=$(cat "$work/zombie")
[ "$(ps -o stat= -p "$zombie")" = Z ] || fail "no zombie process to test with"
printf 'host %s\npid %s\nsince 2026-01-01T00:00:00Z\n' "$(hostname)" "$zombie" > "$out/hp-train.lock"
"$bin" "${args[@]}" --resume > "$work/z" 2>&1; rc=$?
kill $parent 2> /dev/null; wait $parent 2> /dev/null
[ $rc = 0 ] || fail "an exited holder's lock refused the run (exit $rc): $(cat "$work/z")"
grep -q "took over the stale lock '$out/hp-train.lock' of pid $zombie" "$work/z" || fail "exited holder: $(cat "$work/z")"
[ ! -e "$out/hp-train.lock" ] || fail "the run after an exited holder left its lock"
# A lock naming a live process that is not its holder: the pid was given to another process
# (its start time is not the lock's), or the lock was written before a reboot (another boot
# id). The holder is gone: taken over (it was "in use by another run"). The same pid with
# its own start time is in use.
sleep 60 & other=$!
printf 'host %s\npid %s\nsince 2026-01-01T00:00:00Z\nstart 1\n' "$(hostname)" $other > "$out/hp-train.lock"
"$bin" "${args[@]}" --resume > "$work/reused" 2>&1; rc=$?
[ $rc = 0 ] && grep -q "took over the stale lock '$out/hp-train.lock' of pid $other" "$work/reused" ||
  fail "a reused pid's lock (exit $rc): $(cat "$work/reused")"
start=$(awk '{ sub(/.*\) /, ""); print $20 }' "/proc/$other/stat")
printf 'host %s\npid %s\nsince 2026-01-01T00:00:00Z\nstart %s\nboot 00000000-0000-0000-0000-000000000000\n' \
  "$(hostname)" $other "$start" > "$out/hp-train.lock"
"$bin" "${args[@]}" --resume > "$work/reboot" 2>&1; rc=$?
[ $rc = 0 ] && grep -q "took over the stale lock" "$work/reboot" || fail "a lock from another boot (exit $rc): $(cat "$work/reboot")"
printf 'host %s\npid %s\nsince 2026-01-01T00:00:00Z\nstart %s\nboot %s\n' "$(hostname)" $other "$start" \
  "$(cat /proc/sys/kernel/random/boot_id)" > "$out/hp-train.lock"
"$bin" "${args[@]}" --resume > "$work/live" 2>&1; rc=$?
kill $other 2> /dev/null; wait $other 2> /dev/null
rm -f "$out/hp-train.lock"
[ $rc = 1 ] && grep -q "is in use by another run: pid $other" "$work/live" || fail "a live holder with its start (exit $rc): $(cat "$work/live")"
# A lock that is not a regular file (a FIFO would block a reader): refused, naming it.
mkfifo "$out/hp-train.lock"
timeout 60 "$bin" "${args[@]}" --resume > "$work/fifo" 2>&1; rc=$?
rm -f "$out/hp-train.lock"
[ $rc = 1 ] || fail "a FIFO lock: exit $rc: $(cat "$work/fifo")"
grep -q "is locked by '$out/hp-train.lock', which does not name its holder" "$work/fifo" || fail "FIFO lock: $(cat "$work/fifo")"
# Two real jobs at once: the second is refused while the first holds the folder.
long=$work/long
"$bin" --config "$cfg" --set train_steps=3000 --set eval_interval=0 --set output_dir="$long" > "$work/long.log" 2>&1 &
first=$!
for _ in $(seq 200); do [ -e "$long/hp-train.lock" ] && break; sleep 0.05; done
[ -e "$long/hp-train.lock" ] || fail "the first job took no lock: $(cat "$work/long.log")"
"$bin" --config "$cfg" --set train_steps=6 --set eval_interval=0 --set output_dir="$long" > "$work/second" 2>&1; rc=$?
kill $first 2> /dev/null; wait $first 2> /dev/null
[ $rc = 1 ] || fail "a second job in a folder in use exited $rc: $(cat "$work/second")"
grep -q "output_dir='$long' is in use by another run: pid $first on host" "$work/second" ||
  fail "the second job did not name the first: $(cat "$work/second")"

# 2. A run cut off after its step-4 save: the partial metrics hold steps 1-5 and half a line.
# A dead process's lock is left too (that of a process that has exited).
head -n 5 "$work/a.metrics" > "$out/metrics.jsonl.partial"
printf '{"step":6,"loss":5.1' >> "$out/metrics.jsonl.partial"
rm "$out/metrics.jsonl" "$out/loss.svg"
sh -c 'exit 0' & dead=$!; wait $dead
printf 'host %s\npid %s\nsince 2026-01-01T00:00:00Z\n' "$(hostname)" $dead > "$out/hp-train.lock"
"$bin" "${args[@]}" --resume "$out/checkpoints/step_00000004" > "$work/d" 2>&1 || fail "--resume failed: $(cat "$work/d")"
grep -q "took over the stale lock '$out/hp-train.lock' of pid $dead" "$work/d" || fail "stale lock not taken over: $(cat "$work/d")"
[ ! -e "$out/hp-train.lock" ] || fail "the resumed run left its lock"
[ ! -e "$out/metrics.jsonl.partial" ] || fail "a partial metrics file is left"
steps_of "$out/metrics.jsonl" > "$work/d.steps" || fail "the resumed metrics.jsonl does not parse"
# Every step once, in order, with the straight run's losses; its eval and one summary; and
# the resume recorded after step 4 (step 5 of the earlier run lost: its torn line does not count).
grep -v '^resume' "$work/d.steps" | diff "$work/a.steps" - > /dev/null ||
  fail "resumed metrics differ from the straight run's: $(diff "$work/a.steps" "$work/d.steps")"
[ "$(grep '^resume' "$work/d.steps")" = "resume 4 lost 1 --resume" ] || fail "the resume record: $(cat "$work/d.steps")"
[ "$(sed -n 5p "$work/d.steps")" = "resume 4 lost 1 --resume" ] || fail "the resume record is not after step 4: $(cat "$work/d.steps")"
[ "$(head -n 4 "$out/metrics.jsonl")" = "$(head -n 4 "$work/a.metrics")" ] || fail "the lines of steps 1-4 were not kept as written"
grep -q '<svg' "$out/loss.svg" || fail "no loss.svg after resuming"

# 2. Resuming a finished run changes nothing and says so.
before=$(state)
"$bin" "${args[@]}" --resume > "$work/e" 2>&1 || fail "--resume of a finished run failed: $(cat "$work/e")"
grep -q "nothing to train: .*no checkpoint was changed" "$work/e" || fail "a finished run's resume said: $(cat "$work/e")"
[ "$(state)" = "$before" ] || fail "resuming a finished run changed files"

# 1. --overwrite starts over: the earlier checkpoints go, the new run's take their place.
"$bin" "${args[@]}" --resume --overwrite > "$work/f" 2>&1 && fail "--resume with --overwrite was accepted"
grep -q -- "--resume continues the earlier run, --overwrite deletes it" "$work/f" || fail "--resume --overwrite: $(cat "$work/f")"
touch "$out/checkpoints/step_00000008.tmp"  # a save cut off at a later step: the earlier run's too
"$bin" "${args[@]}" --set seed=7 --overwrite > "$work/g" 2>&1 || fail "--overwrite failed: $(cat "$work/g")"
grep -q -- "--overwrite: deleted the earlier run's 5 checkpoint entries in $out/checkpoints" "$work/g" ||
  fail "--overwrite did not say what it deleted: $(cat "$work/g")"
[ ! -e "$out/checkpoints/step_00000008.tmp" ] || fail "--overwrite left the earlier run's step_00000008.tmp"
[ "$(cat "$out/checkpoints/latest")" = step_00000006 ] || fail "no latest after --overwrite"
steps_of "$out/metrics.jsonl" > "$work/g.steps"
[ "$(wc -l < "$work/g.steps")" = 8 ] || fail "the overwriting run's metrics: $(cat "$work/g.steps")"
diff -q "$work/a.steps" "$work/g.steps" > /dev/null && fail "seed 7 wrote the same losses: the metrics were not replaced"

# 3. Folders that cannot be written fail before the first step, naming the key.
echo x > "$work/afile"
"$bin" "${base[@]}" --set output_dir= --set save_dir="$work/afile" > "$work/h" 2>&1 && fail "save_dir on a file was accepted"
grep -q "save_dir='$work/afile' cannot be created: .*'$work/afile' is not a folder" "$work/h" ||
  fail "save_dir on a file not named: $(cat "$work/h")"
grep -q "^step " "$work/h" && fail "a run whose save_dir cannot be made trained"
"$bin" --config "$cfg" --set output_dir="$work/afile/run" > "$work/h" 2>&1 && fail "output_dir under a file was accepted"
grep -q "output_dir='$work/afile/run' cannot be created" "$work/h" || fail "output_dir under a file: $(cat "$work/h")"
grep -q "^step " "$work/h" && fail "a run whose output_dir cannot be made trained"
[ "$(cat "$work/afile")" = x ] || fail "the file in the way was changed"

# 7. Flags given to some ranks only: one clear error at once, no wait for the timeout.
if [ -n "$mpirun" ]; then
  for flag in --resume --verify --overwrite; do
    start=$(date +%s)
    HP_COMM_TIMEOUT_S=120 timeout 100 "$mpirun" --oversubscribe --bind-to none -np 1 "$bin" "${args[@]}" --set data_parallel=1 $flag \
      : -np 1 "$bin" "${args[@]}" --set data_parallel=1 > "$work/i" 2>&1; rc=$?
    [ $rc != 0 ] && [ $rc != 124 ] || fail "$flag on rank 0 only: exit $rc: $(cat "$work/i")"
    [ "$(grep -c "different command lines: $flag=no on rank 1 but $flag=yes on rank 0" "$work/i")" = 1 ] ||
      fail "$flag on rank 0 only not named once: $(cat "$work/i")"
    [ $(($(date +%s) - start)) -lt 60 ] || fail "$flag on rank 0 only took $(($(date +%s) - start)) s"
  done
fi

# A relaunch that ends before training (a failed start) is recorded too, by the next one,
# marked ended_before_training: the resume records count every relaunch (there were fewer).
# Launch 1 is killed after step 3 (a checkpoint at step 2), relaunch 1 fails at once,
# relaunch 2 trains to the end.
cat > "$work/flaky.sh" <<'JOB'
#!/usr/bin/env bash
n=$(( $(cat "$WORK/launches" 2> /dev/null || echo 0) + 1 )); echo $n > "$WORK/launches"
case $n in
  1) "$@" > /dev/null 2>&1 & job=$!
     for _ in $(seq 1200); do grep -q '"step":3,' "$WORK/flaky/metrics.jsonl.partial" 2> /dev/null && break; sleep 0.05; done
     kill -9 $job; wait $job; exit 137 ;;
  2) exit 1 ;;
  *) exec "$@" ;;
esac
JOB
WORK=$work timeout 300 bash "$src/scripts/launch.sh" --backoff 0 --max-restarts 3 -- bash "$work/flaky.sh" "$bin" \
  --config "$cfg" --set train_steps=8 --set save_interval=2 --set eval_interval=0 --set output_dir="$work/flaky" \
  > "$work/flaky.log" 2>&1 || fail "the flaky job did not finish: $(tail -5 "$work/flaky.log")"
[ "$(cat "$work/launches")" = 3 ] || fail "the flaky job was launched $(cat "$work/launches") times, not 3"
[ "$(grep -c '^{"resume"' "$work/flaky/metrics.jsonl")" = 2 ] || fail "not 2 resume records: $(grep resume "$work/flaky/metrics.jsonl")"
grep -q '"cause":"exit status 137 (a process killed by SIGKILL), restart 1 of 3","ended_before_training":true' \
  "$work/flaky/metrics.jsonl" || fail "relaunch 1 not recorded: $(grep resume "$work/flaky/metrics.jsonl")"
grep -q '"cause":"exit status 1, restart 2 of 3","ranks":1}' "$work/flaky/metrics.jsonl" ||
  fail "relaunch 2 not recorded: $(grep resume "$work/flaky/metrics.jsonl")"
echo "PASS"
