#!/usr/bin/env bash
# Runs a training job and relaunches it from its last checkpoint when it fails.
#
# Usage: scripts/launch.sh [--max-restarts N] [--backoff SECONDS] [--] COMMAND...
#   COMMAND is the job as you would start it, ending in hp-train's arguments:
#     scripts/launch.sh --max-restarts 3 -- mpirun -np 4 build/hp-train --config c.yaml
#     scripts/launch.sh --max-restarts 3 -- srun build/hp-train --config c.yaml   (in sbatch)
#   --max-restarts N   relaunches after failures, at most (default 3)
#   --backoff S        seconds before the first relaunch, doubled after each (default 10,
#                      at most 300)
#
# Every launch runs COMMAND --auto-resume: from save_dir's newest checkpoint when there is
# one (after a failure, or when SLURM requeues the job), else from the start. The config
# must save (save_interval > 0). Each relaunch tells hp-train why (HP_RESTART_CAUSE), which
# it records in metrics.jsonl with the step it resumed from and the steps lost.
#
# Exit status: 0 when the run finished; 75 when it stopped on a signal and saved (SIGTERM or
# SIGUSR1, as a scheduler sends before preempting; not a failure, not relaunched: relaunch
# the same command, or let the scheduler requeue it, to continue); otherwise the last
# failed launch's status once N relaunches are spent. A stop signal sent to this script is
# passed to the job as SIGUSR1 (mpirun and srun forward it to every rank; mpirun would
# abort the job on SIGTERM).
#
# Why a script around mpirun or srun rather than an option of hp-train: hp-train runs as
# one process per rank inside the MPI job, and MPI cannot replace a dead rank, so a
# failure ends the whole job; only what started it can start it again. The script works
# the same under mpirun, srun and SLURM's --requeue.
set -uo pipefail

max_restarts=3 backoff=10
while [ $# -gt 0 ]; do
  case $1 in
    --max-restarts)
      [[ ${2:-} =~ ^[0-9]+$ ]] || { echo "launch.sh: --max-restarts '${2:-}': expected a whole number" >&2; exit 2; }
      max_restarts=$2; shift 2 ;;
    --backoff)
      [[ ${2:-} =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "launch.sh: --backoff '${2:-}': expected seconds" >&2; exit 2; }
      backoff=$2; shift 2 ;;
    --) shift; break ;;
    -*) echo "launch.sh: unknown option '$1' (the job's command goes after --)" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { sed -n '2,12p' "$0" >&2; exit 2; }
for a in "$@"; do
  case $a in
    --resume|--resume=*|--overwrite|--auto-resume)
      echo "launch.sh: leave '$a' out: every launch continues from the last checkpoint (--auto-resume)" >&2
      exit 2 ;;
  esac
done

say() { echo "launch.sh: $*" >&2; }
cause_of() {  # an exit status in words
  local rc=$1 name
  if [ "$rc" -gt 128 ] && [ "$rc" -lt 160 ] && name=$(kill -l $((rc - 128)) 2> /dev/null); then
    echo "exit status $rc (a process killed by SIG$name)"
  else
    echo "exit status $rc"
  fi
}

stop_signal=""
child=""
forward() {  # a stop signal for this script: the job saves and exits 75
  stop_signal=$1
  [ -n "$child" ] && kill -USR1 "$child" 2> /dev/null
}
trap 'forward TERM' TERM
trap 'forward USR1' USR1
trap 'forward INT' INT

restarts=0 statuses=() wait_s=$backoff
while :; do
  "$@" --auto-resume &
  child=$!
  # wait returns early when a trapped signal arrives: wait again until the job has ended.
  while :; do
    wait "$child"; rc=$?
    kill -0 "$child" 2> /dev/null || break
  done
  child=""
  if [ $rc = 0 ]; then
    [ $restarts = 0 ] || say "the run finished after $restarts restart(s): ${statuses[*]}"
    exit 0
  fi
  if [ $rc = 75 ] || [ -n "$stop_signal" ]; then
    say "the job stopped on a signal${stop_signal:+ (SIG$stop_signal to this script)} and saved (exit status $rc); run the same command, or let the scheduler requeue it, to continue"
    exit 75
  fi
  statuses+=("$rc")
  if [ $restarts -ge "$max_restarts" ]; then
    say "giving up: the job failed $((restarts + 1)) time(s), exit statuses ${statuses[*]}; $max_restarts restart(s) allowed (--max-restarts). Its last committed checkpoint is save_dir's 'latest'; run this command again to continue from it"
    exit "$rc"
  fi
  restarts=$((restarts + 1))
  cause="$(cause_of "$rc"), restart $restarts of $max_restarts"
  say "the job failed: $cause, from the last committed checkpoint in ${wait_s} s"
  export HP_RESTART_CAUSE="$cause"
  sleep "$wait_s"
  wait_s=$(awk -v w="$wait_s" 'BEGIN { w *= 2; print (w > 300 ? 300 : w) }')
  [ -z "$stop_signal" ] || { say "stopped by SIG$stop_signal while waiting to relaunch"; exit 75; }
done
