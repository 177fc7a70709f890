#!/usr/bin/env bash
# scripts/launch.sh's decisions, with stand-in jobs (small bash scripts) in place of hp-train
# so that each outcome is exact and fast: what it relaunches and what it does not, what it
# says after a stop signal, the same notice twice, a signal during its back-off, and bounds
# on its options. The relaunch of a real hp-train job is launcher_fault_test's and
# restart_test's.
# Usage: launcher_test.sh <source dir>
set -uo pipefail
src=$1
launch=$src/scripts/launch.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# A job that counts its launches in $work/n and exits with status $1 (the launcher appends
# --auto-resume, which it ignores).
cat > "$work/exits.sh" <<'JOB'
#!/usr/bin/env bash
echo x >> "$WORK/n"
exit "$1"
JOB
export WORK=$work

# 1. Statuses no launch gets past: run once, the status passed on, the reason said.
for st in 2 3 78 127; do
  rm -f "$work/n"
  bash "$launch" --max-restarts 3 --backoff 0 -- bash "$work/exits.sh" $st > "$work/out" 2>&1; rc=$?
  [ $rc = $st ] || fail "status $st: the launcher exited $rc: $(cat "$work/out")"
  [ "$(wc -l < "$work/n")" = 1 ] || fail "status $st was relaunched ($(wc -l < "$work/n") launches): $(cat "$work/out")"
  grep -q "exit status $st: .*; not relaunched" "$work/out" || fail "status $st: no reason given: $(cat "$work/out")"
done
bash "$launch" --max-restarts 3 --backoff 0 -- "$work/no_such_program" > "$work/out" 2>&1; rc=$?
[ $rc = 127 ] && grep -q "the command could not be run" "$work/out" || fail "a missing program: exit $rc: $(cat "$work/out")"
# ... and one it does: relaunched to the limit.
rm -f "$work/n"
bash "$launch" --max-restarts 2 --backoff 0 -- bash "$work/exits.sh" 1 > "$work/out" 2>&1; rc=$?
[ $rc = 1 ] && [ "$(wc -l < "$work/n")" = 3 ] || fail "a failure: exit $rc after $(wc -l < "$work/n") launches"

# 2. Option bounds: an overflowing --max-restarts (bash's arithmetic wrapped it negative:
# relaunched forever) and others are refused, exit 2.
for bad in "--max-restarts 99999999999999999999" "--max-restarts 100001" "--backoff 1e9" "--stop-grace -1" "--rank-grace x"; do
  # shellcheck disable=SC2086  # $bad is a list of words on purpose
  timeout 10 bash "$launch" $bad -- true > "$work/out" 2>&1; rc=$?
  [ $rc = 2 ] && grep -q "launch.sh: ${bad%% *} " "$work/out" || fail "$bad: exit $rc: $(cat "$work/out")"
done

# A job that waits for a stop signal ($1: what it does on SIGUSR1: "save" exits 75 after a
# second, counting the signals it got in $work/usr1; "fail" exits 1, as a stop save on a full
# disk does; "none": no handler, SIGUSR1 kills it). It writes $work/ready when it listens.
cat > "$work/waits.sh" <<'JOB'
#!/usr/bin/env bash
case $1 in
  save) trap 'echo x >> "$WORK/usr1"; [ -e "$WORK/saving" ] || { touch "$WORK/saving"; (sleep 1; touch "$WORK/saved") & }' USR1 ;;
  fail) trap 'exit 1' USR1 ;;
esac
touch "$WORK/ready"
for _ in $(seq 300); do [ -e "$WORK/saved" ] && exit 75; sleep 0.1; done
exit 9
JOB
start_waiting() {  # start_waiting MODE [launcher options...]: the launcher in the background
  local mode=$1; shift
  rm -f "$work/ready" "$work/usr1" "$work/saving" "$work/saved"
  bash "$launch" "$@" -- bash "$work/waits.sh" "$mode" > "$work/out" 2>&1 & launcher=$!
  for _ in $(seq 100); do [ -e "$work/ready" ] && return; sleep 0.05; done
  fail "the job did not start: $(cat "$work/out")"
}

# 3. A stop signal, and the same notice again at once (a scheduler signalling twice): one
# SIGUSR1 reaches the job, whose save finishes; 75, "saved".
start_waiting save --backoff 0
kill -TERM $launcher; sleep 0.2; kill -TERM $launcher
wait $launcher; rc=$?
[ $rc = 75 ] || fail "two stop signals: exit $rc: $(cat "$work/out")"
[ "$(wc -l < "$work/usr1")" = 1 ] || fail "the job got $(wc -l < "$work/usr1") SIGUSR1s (the second cancelled its save)"
grep -q "the same notice; the job's save goes on" "$work/out" && grep -q "and saved (exit status 75)" "$work/out" ||
  fail "two stop signals not told: $(cat "$work/out")"

# 4. A stop signal whose save failed (exit 1): reported as the job's failure, not "saved",
# and not relaunched.
start_waiting fail --backoff 0
kill -TERM $launcher; wait $launcher; rc=$?
[ $rc = 1 ] || fail "a failed stop save: exit $rc: $(cat "$work/out")"
grep -q "saved" "$work/out" && ! grep -q "without saving" "$work/out" && fail "a failed stop save reported as saved: $(cat "$work/out")"
grep -q "ended with exit status 1 without saving on the signal" "$work/out" || fail "a failed stop save: $(cat "$work/out")"

# 5. A stop signal before the job listens for it (before hp-train's first step): SIGUSR1
# ends it; the launcher says so and exits with its status (138), not 75.
start_waiting none --backoff 0
kill -TERM $launcher; wait $launcher; rc=$?
[ $rc = 138 ] || fail "a job killed by the passed-on signal: exit $rc: $(cat "$work/out")"
grep -q "exit status 138 (a process killed by SIGUSR1) without saving" "$work/out" || fail "not told: $(cat "$work/out")"

# 6. A stop signal during the back-off before a relaunch: the launcher ends at once (it slept
# through it before), nothing relaunched.
rm -f "$work/n"
bash "$launch" --max-restarts 3 --backoff 60 -- bash "$work/exits.sh" 1 > "$work/out" 2>&1 & launcher=$!
for _ in $(seq 100); do grep -q "from the last committed checkpoint in 60 s" "$work/out" && break; sleep 0.05; done
t0=$(date +%s)
kill -TERM $launcher; wait $launcher; rc=$?
[ $rc = 75 ] && [ $(( $(date +%s) - t0 )) -le 5 ] || fail "a stop during the back-off: exit $rc after $(( $(date +%s) - t0 )) s"
[ "$(wc -l < "$work/n")" = 1 ] || fail "relaunched after a stop signal"
grep -q "while waiting to relaunch" "$work/out" || fail "not told: $(cat "$work/out")"

# 7. A job whose rank failed (its marker left) but whose launcher does not return (mpirun
# across a partition): ended --rank-grace seconds later and relaunched; the relaunch runs
# clean and finishes.
cat > "$work/stuck.sh" <<'JOB'
#!/usr/bin/env bash
echo x >> "$WORK/n"
[ "$(wc -l < "$WORK/n")" -gt 1 ] && exit 0               # the relaunch: clean
echo "exit status 1: all_reduce #9 on group 'world' failed: timed out" > "$HP_FAILURE_MARKERS/rank0"
exec sleep 300                                            # the launcher that never returns
JOB
rm -f "$work/n"
t0=$(date +%s)
timeout 60 bash "$launch" --rank-grace 1 --backoff 0 -- bash "$work/stuck.sh" > "$work/out" 2>&1; rc=$?
[ $rc = 0 ] && [ "$(wc -l < "$work/n")" = 2 ] || fail "a stuck job after a rank's failure: exit $rc, $(wc -l < "$work/n") launches: $(cat "$work/out")"
[ $(( $(date +%s) - t0 )) -le 15 ] || fail "a stuck job was ended only after $(( $(date +%s) - t0 )) s (grace 1 s)"
grep -q "rank0 failed (exit status 1: all_reduce #9" "$work/out" && grep -q "outlived its failed rank by 1 s" "$work/out" ||
  fail "not told: $(cat "$work/out")"

# 8. Elastic relaunch (--nodes-file, --node-check, --min-ranks): the hosts are read again before
# every launch, a host the check fails is left out, {ranks} and {hosts} follow, hp-train gets
# --elastic; below --min-ranks nothing is launched and the wait counts as a restart.
printf 'h1 2   # the first node\n\nh2 2\n' > "$work/nodes"
cat > "$work/check.sh" <<'JOB'
#!/usr/bin/env bash
! grep -qx "$1" "$WORK/down" 2> /dev/null
JOB
# A job that records its arguments; its first launch loses h2 for good (and fails), later ones
# finish, or fail while $WORK/failing exists.
cat > "$work/loses.sh" <<'JOB'
#!/usr/bin/env bash
echo "$*" >> "$WORK/args"
[ "$(wc -l < "$WORK/args")" -gt 1 ] && { [ -e "$WORK/failing" ] && exit 1; exit 0; }
echo h2 > "$WORK/down"
exit 137
JOB
elastic_run() {  # elastic_run [launcher options...]: $work/out, $work/args; sets rc
  rm -f "$work/args" "$work/down"
  timeout 60 bash "$launch" --backoff 0 --nodes-file "$work/nodes" --node-check "bash $work/check.sh" "$@" -- \
    bash "$work/loses.sh" -np {ranks} --host {hosts} --nodes {nodes} > "$work/out" 2>&1; rc=$?
}
elastic_run --min-ranks 2
[ $rc = 0 ] || fail "elastic: exit $rc: $(cat "$work/out")"
[ "$(sed -n 1p "$work/args")" = "-np 4 --host h1:2,h2:2 --nodes 2 --auto-resume --elastic" ] &&
  [ "$(sed -n 2p "$work/args")" = "-np 2 --host h1:2 --nodes 1 --auto-resume --elastic" ] ||
  fail "elastic: the launches were: $(cat "$work/args")"
grep -q "launching on 2 rank(s) (h1:2), left out: h2 (--node-check failed)" "$work/out" ||
  fail "elastic: the relaunch's hosts not said: $(cat "$work/out")"
# Fewer ranks than --min-ranks: not launched, each wait a restart, then given up.
elastic_run --min-ranks 3 --max-restarts 2
[ $rc = 1 ] && [ "$(wc -l < "$work/args")" = 1 ] || fail "below --min-ranks: exit $rc, launches: $(cat "$work/args")"
grep -q "not launched: only 2 rank(s) to be had (left out: h2), --min-ranks 3 needed" "$work/out" &&
  grep -q "giving up: the job failed 3 time(s), exit statuses 137 (too few ranks) (too few ranks)" "$work/out" ||
  fail "below --min-ranks: not told: $(cat "$work/out")"
# Without --min-ranks: every rank of the first launch is needed, and --elastic is not passed.
elastic_run --max-restarts 1
[ $rc = 1 ] && grep -q "only 2 rank(s) to be had (left out: h2), 4 needed" "$work/out" ||
  fail "without --min-ranks: exit $rc: $(cat "$work/out")"
[ "$(sed -n 1p "$work/args")" = "-np 4 --host h1:2,h2:2 --nodes 2 --auto-resume" ] || fail "without --min-ranks: $(cat "$work/args")"
# The resume record's cause says where the relaunch ran (HP_RESTART_CAUSE).
cat > "$work/cause.sh" <<'JOB'
#!/usr/bin/env bash
echo "${HP_RESTART_CAUSE:-none}" >> "$WORK/causes"
[ -e "$WORK/down" ] && exit 0
echo h2 > "$WORK/down"
exit 1
JOB
rm -f "$work/down" "$work/causes"
timeout 60 bash "$launch" --backoff 0 --nodes-file "$work/nodes" --node-check "bash $work/check.sh" --min-ranks 1 -- \
  bash "$work/cause.sh" -np {ranks} > "$work/out" 2>&1 || fail "the cause: $(cat "$work/out")"
[ "$(sed -n 2p "$work/causes")" = "exit status 1, restart 1 of 3, on 2 rank(s) (h1:2), left out: h2 (--node-check failed)" ] ||
  fail "the relaunch's cause: $(cat "$work/causes")"
# What the options refuse (exit 2): --min-ranks without a nodes file, a command without
# placeholders, a bad line.
bash "$launch" --min-ranks 2 -- true > "$work/out" 2>&1; rc=$?
[ $rc = 2 ] && grep -q "need --nodes-file" "$work/out" || fail "--min-ranks alone: exit $rc: $(cat "$work/out")"
bash "$launch" --nodes-file "$work/nodes" -- true > "$work/out" 2>&1; rc=$?
[ $rc = 2 ] && grep -q "names none of {ranks}" "$work/out" || fail "no placeholder: exit $rc: $(cat "$work/out")"
printf 'h1 0\n' > "$work/bad_nodes"
bash "$launch" --nodes-file "$work/bad_nodes" -- echo {ranks} > "$work/out" 2>&1; rc=$?
[ $rc = 2 ] && grep -q "line 1: 'h1 0': expected HOST \[SLOTS\]" "$work/out" || fail "a bad nodes line: exit $rc: $(cat "$work/out")"
echo "launcher_test: all checks passed"
