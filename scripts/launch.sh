#!/usr/bin/env bash
# Runs a training job and relaunches it from its last checkpoint when it fails.
#
# Usage: scripts/launch.sh [--max-restarts N] [--backoff SECONDS] [--] COMMAND...
#   COMMAND is the job as you would start it, ending in hp-train's arguments:
#     scripts/launch.sh --max-restarts 3 -- mpirun -np 4 build/hp-train --config c.yaml
#     scripts/launch.sh --max-restarts 3 -- srun build/hp-train --config c.yaml   (in sbatch)
#   --max-restarts N   relaunches after failures, at most (default 3; at most 100000)
#   --backoff S        seconds before the first relaunch, doubled after each (default 10,
#                      at most 300)
#   --stop-grace S     seconds after a stop signal in which another is the same notice
#                      (default 60; below)
#   --rank-grace S     seconds the job may go on after one of its ranks failed (default 30):
#                      then the script ends it (below)
#   --nodes-file F     the hosts the job may run on, one a line: HOST [SLOTS] (ranks on it,
#                      default 1; '#' starts a comment). Read again before every launch, so a
#                      scheduler or an operator can take a host out, or put one back. COMMAND
#                      then says where the ranks go with {ranks} (their sum), {hosts}
#                      (HOST:SLOTS,... as mpirun --host takes them) and {nodes} (the hosts):
#                        --nodes-file nodes -- mpirun -np {ranks} --host {hosts} build/hp-train ...
#   --node-check CMD   before every launch, CMD HOST for each host of the file (20 s each): a
#                      host it fails is left out of that launch (e.g. a script that runs
#                      ssh -o ConnectTimeout=5 "$1" true, or asks the scheduler)
#   --min-ranks N      elastic: a relaunch goes on with the ranks it can have, at least N
#                      (default: every rank of the first launch), and hp-train gets --elastic:
#                      the checkpoint resumes laid out on those ranks (the same global batch,
#                      the tensor and pipeline degrees kept; docs/reliability.md). With fewer
#                      than N, the launch waits its back-off and counts as a restart
#
# Every launch runs COMMAND --auto-resume: from save_dir's newest checkpoint when there is
# one (after a failure, or when SLURM requeues the job), else from the start. The config
# must save (save_interval > 0). Each relaunch tells hp-train why (HP_RESTART_CAUSE), which
# it records in metrics.jsonl with the step it resumed from and the steps lost.
#
# Exit status: the job's own, and the script says what the job did. 0 when the run finished;
# 75 when it stopped on a signal and saved (SIGTERM or SIGUSR1, as a scheduler sends before
# preempting; not a failure, not relaunched: relaunch the same command, or let the scheduler
# requeue it, to continue); a failure is relaunched until N relaunches are spent, then its
# status is the script's. Not relaunched, as no launch can get past them: hp-train's usage
# (2), divergence (3) and config (78) errors (include/hp/train/exit_status.h), and a command
# that cannot be run (126, 127). A stop signal sent to this script is passed to the job as
# SIGUSR1 (mpirun and srun forward it to every rank; mpirun would abort the job on SIGTERM);
# another within --stop-grace seconds is the same notice (a scheduler that signals twice,
# or the job's processes and this script together) and is not passed on, so the save in
# progress finishes; one after that is passed on and ends the job at once. After a stop
# signal the job is not relaunched, whatever its status: the script reports that status
# (75 only when the job saved).
#
# A rank that fails with an error leaves a marker (HP_FAILURE_MARKERS, a folder the script
# makes for each launch) before it exits. mpirun then ends the others, unless it cannot reach
# them (a partition between nodes: it waits for the far node's daemon forever). So once a
# marker is there and the job has not ended --rank-grace seconds later, the script ends it
# (SIGTERM, then SIGKILL after 5 s) and treats it as that failure: relaunched from the last
# committed checkpoint after the back-off.
#
# Why a script around mpirun or srun rather than an option of hp-train: hp-train runs as
# one process per rank inside the MPI job, and MPI cannot replace a dead rank, so a
# failure ends the whole job; only what started it can start it again. The script works
# the same under mpirun, srun and SLURM's --requeue.
set -uo pipefail

max_restarts=3 backoff=10 grace=60 rank_grace=30 nodes_file="" node_check="" min_ranks=""
while [ $# -gt 0 ]; do
  case $1 in
    --nodes-file)
      [ -n "${2:-}" ] && [ -r "$2" ] && [ -f "$2" ] || { echo "launch.sh: --nodes-file '${2:-}': not a readable file" >&2; exit 2; }
      nodes_file=$2; shift 2 ;;
    --node-check)
      [ -n "${2:-}" ] || { echo "launch.sh: --node-check: expected a command (run as: COMMAND HOST)" >&2; exit 2; }
      node_check=$2; shift 2 ;;
    --min-ranks)
      [[ ${2:-} =~ ^[1-9][0-9]{0,6}$ ]] || { echo "launch.sh: --min-ranks '${2:-}': expected a whole number from 1 to 9999999" >&2; exit 2; }
      min_ranks=$2; shift 2 ;;
    --max-restarts)
      # Bounded, so that bash's arithmetic cannot overflow it (which relaunched forever).
      [[ ${2:-} =~ ^[0-9]{1,6}$ ]] && [ "$((10#$2))" -le 100000 ] ||
        { echo "launch.sh: --max-restarts '${2:-}': expected a whole number from 0 to 100000" >&2; exit 2; }
      max_restarts=$((10#$2)); shift 2 ;;
    --backoff)
      [[ ${2:-} =~ ^[0-9]{1,4}([.][0-9]+)?$ ]] || { echo "launch.sh: --backoff '${2:-}': expected seconds (below 10000)" >&2; exit 2; }
      backoff=$2; shift 2 ;;
    --stop-grace)
      [[ ${2:-} =~ ^[0-9]{1,5}$ ]] || { echo "launch.sh: --stop-grace '${2:-}': expected whole seconds (below 100000)" >&2; exit 2; }
      grace=$((10#$2)); shift 2 ;;
    --rank-grace)
      [[ ${2:-} =~ ^[0-9]{1,5}$ ]] || { echo "launch.sh: --rank-grace '${2:-}': expected whole seconds (below 100000)" >&2; exit 2; }
      rank_grace=$((10#$2)); shift 2 ;;
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
if [ -z "$nodes_file" ]; then
  [ -z "$node_check$min_ranks" ] || { echo "launch.sh: --node-check and --min-ranks need --nodes-file (the hosts to choose from)" >&2; exit 2; }
else
  case "$*" in
    *"{ranks}"*|*"{hosts}"*|*"{nodes}"*) ;;
    *) echo "launch.sh: --nodes-file: the command names none of {ranks}, {hosts}, {nodes}: it would not change with the hosts" >&2; exit 2 ;;
  esac
fi
read -ra check_cmd <<< "$node_check"
# The nodes file's hosts that pass --node-check: hosts ("h:k,..."), ranks, nodes and the hosts
# left out (left_out). A line that is not HOST [SLOTS] is the operator's to mend: exit 2.
read_nodes() {
  hosts="" ranks=0 nodes=0 left_out=""
  local line host slots extra n=0
  [ -r "$nodes_file" ] || { say "--nodes-file $nodes_file: cannot be read"; exit 2; }
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    line=${line%%#*}
    read -r host slots extra <<< "$line"
    [ -n "$host" ] || continue
    slots=${slots:-1}
    if ! [[ $host =~ ^[A-Za-z0-9._-]{1,253}$ ]] || ! [[ $slots =~ ^[1-9][0-9]{0,4}$ ]] || [ -n "$extra" ]; then
      say "--nodes-file $nodes_file line $n: '$line': expected HOST [SLOTS] (SLOTS from 1 to 99999)"
      exit 2
    fi
    if [ ${#check_cmd[@]} -gt 0 ] && ! timeout 20 "${check_cmd[@]}" "$host" > /dev/null 2>&1; then
      left_out+="${left_out:+ }$host"
      continue
    fi
    hosts+="${hosts:+,}$host:$slots" ranks=$((ranks + slots)) nodes=$((nodes + 1))
  done < "$nodes_file"
}
cause_of() {  # an exit status in words
  local rc=$1 name
  if [ "$rc" -gt 128 ] && [ "$rc" -lt 160 ] && name=$(kill -l $((rc - 128)) 2> /dev/null); then
    echo "exit status $rc (a process killed by SIG$name)"
  else
    echo "exit status $rc"
  fi
}

stop_signal="" stop_at=0
child=""
forward() {  # a stop signal for this script: the job saves and exits 75
  if [ -n "$stop_signal" ] && [ $((SECONDS - stop_at)) -lt "$grace" ]; then
    say "SIG$1 again within ${grace} s of SIG$stop_signal: the same notice; the job's save goes on"
    return
  fi
  [ -n "$stop_signal" ] && say "SIG$1 after the ${grace} s grace: passed on; the job ends at once"
  stop_signal=$1 stop_at=$SECONDS
  [ -n "$child" ] && kill -USR1 "$child" 2> /dev/null
}
no_relaunch() {  # a status that no launch can get past
  case $1 in
    2) echo "a usage error" ;;
    3) echo "the training diverged" ;;
    78) echo "the config, its data or its folders were refused" ;;
    126|127) echo "the command could not be run" ;;
    *) return 1 ;;
  esac
}
trap 'forward TERM' TERM
trap 'forward USR1' USR1
trap 'forward INT' INT

markers=$(mktemp -d "${TMPDIR:-/tmp}/hp-launch-markers.XXXXXX") || { say "cannot make a folder for the ranks' failure markers"; exit 1; }
trap 'rm -rf "$markers"' EXIT
export HP_FAILURE_MARKERS=$markers
restarts=0 statuses=() causes=() wait_s=$backoff pending="" first_ranks=""
elastic=()
[ -z "$min_ranks" ] || elastic=(--elastic)
# Runs the job once (cmd), polled (a trapped signal is handled between polls) until it ends
# or a rank's failure marker is --rank-grace seconds old; sets rc.
run_job() {
  "${cmd[@]}" --auto-resume "${elastic[@]}" &
  child=$!
  local failed_at="" ended_here="" first
  while kill -0 "$child" 2> /dev/null; do
    if [ -z "$failed_at" ] && first=$(ls "$markers" 2> /dev/null | head -1) && [ -n "$first" ]; then
      failed_at=$SECONDS
      say "$first failed ($(head -c 300 "$markers/$first")); the job ends it, or this script does in ${rank_grace} s"
    fi
    if [ -n "$failed_at" ] && [ $((SECONDS - failed_at)) -ge "$rank_grace" ]; then
      say "the job outlived its failed rank by ${rank_grace} s (its launcher cannot reach every rank?): ending it"
      kill -TERM "$child" 2> /dev/null
      for _ in $(seq 50); do kill -0 "$child" 2> /dev/null || break; sleep 0.1; done
      kill -KILL "$child" 2> /dev/null
      ended_here=1
      break
    fi
    sleep 0.2
  done
  wait "$child"; rc=$?
  [ -z "$ended_here" ] || rc=1  # the failed rank's status, not the one the kill gave
  child=""
}
while :; do
  rm -f "$markers"/rank*
  cmd=("$@") where="" short=""
  if [ -n "$nodes_file" ]; then
    read_nodes
    first_ranks=${first_ranks:-$ranks}
    need=${min_ranks:-$first_ranks}
    where="on $ranks rank(s) ($hosts)${left_out:+, left out: $left_out (--node-check failed)}"
    if [ "$ranks" -lt "$need" ] || [ "$ranks" = 0 ]; then
      short="only $ranks rank(s) to be had${left_out:+ (left out: $left_out)}, ${min_ranks:+--min-ranks }$need needed"
    else
      cmd=()
      for a in "$@"; do a=${a//\{ranks\}/$ranks}; a=${a//\{hosts\}/$hosts}; a=${a//\{nodes\}/$nodes}; cmd+=("$a"); done
    fi
  fi
  if [ -n "$short" ]; then
    # Not launched: too few ranks pass. Counted as a failed launch; the hosts are read again
    # after the back-off.
    rc=1 status="(too few ranks)"
    say "not launched: $short"
  else
    if [ -n "$pending" ]; then
      # Why this is a relaunch, and where it runs, for hp-train's resume record.
      cause=$pending${where:+, $where}
      export HP_RESTART_CAUSE="$cause"
      causes+=("$cause")
      HP_RESTART_CAUSES=$(printf '%s\n' "${causes[@]}")
      export HP_RESTART_CAUSES
    fi
    [ -z "$where" ] || say "launching $where"
    run_job
    status=$rc
    if [ $rc = 0 ]; then
      [ $restarts = 0 ] || say "the run finished after $restarts restart(s): ${statuses[*]}"
      [ -z "$stop_signal" ] || say "SIG$stop_signal came as the run ended: it finished"
      exit 0
    fi
    if [ $rc = 75 ]; then
      say "the job stopped on a signal${stop_signal:+ (SIG$stop_signal to this script)} and saved (exit status 75); run the same command, or let the scheduler requeue it, to continue"
      exit 75
    fi
    if [ -n "$stop_signal" ]; then
      # Asked to stop: not relaunched, and the job's own outcome reported (it did not save).
      say "after SIG$stop_signal to this script the job ended with $(cause_of "$rc") without saving on the signal: the last committed checkpoint (save_dir's 'latest') is where it continues; not relaunched"
      exit "$rc"
    fi
    if why=$(no_relaunch "$rc"); then
      say "the job failed with exit status $rc: $why; not relaunched (no launch of the same command can succeed)"
      exit "$rc"
    fi
  fi
  statuses+=("$status")
  if [ $restarts -ge "$max_restarts" ]; then
    say "giving up: the job failed $((restarts + 1)) time(s), exit statuses ${statuses[*]}; $max_restarts restart(s) allowed (--max-restarts). Its last committed checkpoint is save_dir's 'latest'; run this command again to continue from it"
    exit "$rc"
  fi
  restarts=$((restarts + 1))
  if [ -z "$short" ]; then
    pending="$(cause_of "$rc"), restart $restarts of $max_restarts"
    say "the job failed: $pending, from the last committed checkpoint in ${wait_s} s"
  else
    pending="${pending:-too few ranks to launch}"
    pending="${pending%%, restart *}, restart $restarts of $max_restarts"
    say "restart $restarts of $max_restarts: the hosts read again in ${wait_s} s"
  fi
  # In the background and waited for: a stop signal ends the wait at once (a foreground
  # sleep held the trap until it was over).
  sleep "$wait_s" & sleeper=$!
  while kill -0 "$sleeper" 2> /dev/null && [ -z "$stop_signal" ]; do wait "$sleeper"; done
  kill "$sleeper" 2> /dev/null; wait "$sleeper" 2> /dev/null
  wait_s=$(awk -v w="$wait_s" 'BEGIN { w *= 2; print (w > 300 ? 300 : w) }')
  [ -z "$stop_signal" ] || { say "stopped by SIG$stop_signal while waiting to relaunch: nothing running; the last committed checkpoint is save_dir's 'latest'"; exit 75; }
done
