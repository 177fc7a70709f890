#!/usr/bin/env bash
# Faults injected into the communication seam under every layout (issue 33): an error (a
# failed transport) and a hang at a chosen rank's k-th op of one kind on one group, in
# fully_shard's all-gather and reduce-scatter (FSDP on 2 ranks, HSDP 2 x 2 on 4), tensor
# parallelism's collectives, a pipeline's send and recv, and a checkpoint save's collectives;
# a straggler (a delay past the timeout) in one. Each case is one mpirun of fault_matrix
# (fault_matrix.cpp) on a job communicator with a 4 s timeout (long enough that a loaded
# machine does not time out a healthy op first), and passes when
#   - the fault fired, and every rank ended (no hang: each case has 60 s; no crash: every
#     rank wrote its record) with an hp::Error, none completing (no silent loss);
#   - every message names a rank, an op with its sequence number and a group
#     ("[rank R] OP #SEQ on group 'G'"), and a rank given an error names it, at the op it
#     was hit in (a transport's error is not dropped);
#   - every rank raised well before a hang would be declared: within 30 s of the fault (a
#     bound for hangs, not a timing; each rank's delay is printed: about one timeout, two
#     where a rank's op waits on a peer that is itself waiting for the faulty rank, as in
#     HSDP's all-reduce over every data-parallel rank or a pipeline's recv);
#   - after a fault in a save, `latest` names a committed checkpoint.
# Usage: fault_matrix.sh <fault_matrix> <source dir> <mpirun> [--full | CASE...]
set -uo pipefail
bin=$1 src=$2 mpirun=$3
shift 3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
timeout_ms=4000

# name ranks layout fault [later: the faulty rank may report a later op]; a leading + marks the quick tier ctest runs (about 50 s here),
# --full runs every case (about 80 s).
cases=(
  "+fsdp_all_gather_error 2 fsdp error:rank=1:op=all_gather:nth=5:group=dp_shard"
  "fsdp_all_gather_hang 2 fsdp hang:rank=0:op=all_gather:nth=5:group=dp_shard"
  "fsdp_reduce_scatter_error 2 fsdp error:rank=0:op=reduce_scatter:nth=2:group=dp_shard"
  "+fsdp_reduce_scatter_hang 2 fsdp hang:rank=1:op=reduce_scatter:nth=2:group=dp_shard"
  "+fsdp_all_gather_straggler 2 fsdp delay:rank=1:op=all_gather:nth=2:group=dp_shard:delay_ms=6000"
  "hsdp_all_gather_error 4 hsdp error:rank=2:op=all_gather:nth=5:group=dp_shard"
  "+hsdp_all_gather_hang 4 hsdp hang:rank=1:op=all_gather:nth=2:group=dp_shard"
  "+hsdp_reduce_scatter_error 4 hsdp error:rank=3:op=reduce_scatter:nth=2:group=dp_shard"
  "hsdp_replicate_all_reduce_hang 4 hsdp hang:rank=0:op=all_reduce:nth=1:group=dp_replicate"
  "+tp_all_gather_error 2 tp error:rank=1:op=all_gather:nth=3:group=tp"
  "+tp_reduce_scatter_hang 2 tp hang:rank=0:op=reduce_scatter:nth=10:group=tp"
  "tp_all_reduce_error 2 tp error:rank=0:op=all_reduce:nth=2:group=tp"
  # The failed send is waited for after the stage's next recv, whose timeout the rank reports.
  "+pp_send_error 2 pp error:rank=0:op=send:nth=2:group=pp later"
  "+pp_recv_hang 2 pp hang:rank=1:op=recv:nth=3:group=pp"
  "pp_recv_error 2 pp error:rank=0:op=recv:nth=2:group=pp"
  "+ckpt_all_gather_error 2 ckpt error:rank=1:op=all_gather:nth=3:group=job"
  "+ckpt_all_gather_hang 2 ckpt hang:rank=0:op=all_gather:nth=4:group=job"
  "ckpt_barrier_error 2 ckpt error:rank=1:op=barrier:nth=2:group=job"
)

failed=0
total_start=$(date +%s.%N)
full=0
if [ "${1:-}" = --full ]; then full=1; shift; fi
for c in "${cases[@]}"; do
  read -r name np layout fault victim <<< "$c"
  quick=0
  [ "${name:0:1}" = + ] && quick=1 name=${name:1}
  if [ $# -gt 0 ]; then
    printf '%s\n' "$@" | grep -qx "$name" || continue
  elif [ $full = 0 ] && [ $quick = 0 ]; then
    continue
  fi
  out=$work/$name
  mkdir -p "$out"
  start=$(date +%s.%N)
  timeout -s KILL 60 "$mpirun" -np "$np" --oversubscribe --bind-to none "$bin" --config "$src/configs/llama_tiny.yaml" \
    --layout "$layout" --fault "$fault" --out "$out" --timeout-ms $timeout_ms > "$out/log" 2>&1
  rc=$?
  secs=$(echo "$(date +%s.%N) - $start" | bc)
  verdict=$(python3 - "$out" "$np" "$timeout_ms" "$rc" "${victim:-own}" << 'PY'
import json, os, re, sys
out, np, timeout_ms, rc, victim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
problems = []
if rc == 137:
    problems.append("the case hung: killed after 60 s")
fired = json.load(open(out + "/fired.json")) if os.path.exists(out + "/fired.json") else None
if fired is None:
    problems.append("the fault never fired")
margin = 30000  # a hang bound, not a timing: the delays are printed
worst = 0
for r in range(np):
    p = "%s/rank%d.json" % (out, r)
    if not os.path.exists(p):
        problems.append("rank %d wrote no record (crashed or hung)" % r)
        continue
    j = json.load(open(p))
    if j.get("outcome") != "error":
        problems.append("rank %d completed its run: %s" % (r, j.get("outcome")))
        continue
    what = j["what"]
    if j["type"] == "other":
        problems.append("rank %d raised something other than hp::Error: %s" % (r, what))
    m = re.search(r"\[(?:world rank \d+, )?rank \d+(?: of group '[^']+')?\] (\w+) #(\d+) on group '([^']+)'", what)
    if not m:
        problems.append("rank %d's error names no rank, op #seq and group: %s" % (r, what))
    elif fired and r == fired["rank"] and j["fault"].startswith("error") and victim == "own":
        # The faulty rank reports its own failure, at the op it was hit in.
        if "injected fault" not in what or (m.group(1), int(m.group(2)), m.group(3)) != (fired["op"], fired["seq"], fired["group"]):
            problems.append("rank %d's error names %s #%s on '%s', the fault hit %s #%d on '%s'" % (
                r, m.group(1), m.group(2), m.group(3), fired["op"], fired["seq"], fired["group"]))
    if fired:
        late = j["end_ms"] - fired["at_ms"]
        worst = max(worst, late)
        if late > margin:
            problems.append("rank %d ended %d ms after the fault (more than %d): %s" % (r, late, margin, what))
    print("  rank %d: +%d ms %s: %s" % (r, j["end_ms"] - (fired["at_ms"] if fired else j["start_ms"]), j["type"], what[:200]))
r0 = "%s/rank0.json" % out
if os.path.exists(r0) and "ckpt" in out.rsplit("/", 1)[-1]:
    j = json.load(open(r0))
    if "resume_from" not in j:
        problems.append("latest names no committed checkpoint: %s" % j.get("resume_error"))
    else:
        print("  latest: %s" % j["resume_from"])
for p in problems:
    print("  PROBLEM: " + p)
print("RESULT %s %d" % ("fail" if problems else "pass", worst))
PY
)
  echo "$name ($np ranks, $fault): $(echo "$verdict" | tail -1 | cut -d' ' -f2), last rank +$(echo "$verdict" | tail -1 | cut -d' ' -f3) ms after the fault, case ${secs}s"
  echo "$verdict" | sed '$d'
  if ! echo "$verdict" | tail -1 | grep -q "^RESULT pass"; then
    failed=$((failed + 1))
    grep -v "^\s*$" "$out/log" | tail -n 15
  fi
done
echo "fault_matrix: $failed failed, $(echo "$(date +%s.%N) - $total_start" | bc) s"
[ $failed = 0 ]
