#!/usr/bin/env bash
# DualPipeV's paired forward and backward taking turns at the expert exchanges, against the
# same run with the pairs one after the other (pipeline_pair_overlap true / false), each run
# `reps` times, alternating: DeepSeek tiny (4 layers, dim 128) over EP 2 x PP 2 on 4 ranks, 8
# micro-batches a step, under the simulated network given in HP_SIM_NET (default two
# "nodes" of 2 ranks, 0.05 GB/s between them). For each run it prints the mean step time
# after the first step (metrics.jsonl) and, from the trace (HP_TRACE), per step and rank the
# time spent waiting in the plain exchange ("ep wait exchange" spans: what of the all-to-alls
# stayed exposed) and the all-to-alls' own time (the communicator's spans): the rank's mean.
# Usage: bench/pair_turns.sh <hp-train> [reps]     (default 2)
set -uo pipefail
bin=$1
reps=${2:-2}
src=$(cd "$(dirname "$0")/.." && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export HP_SIM_NET=${HP_SIM_NET:-5:100,10:0.05:2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
steps=8
printf '%-14s %12s %22s %20s\n' pairs step_ms exposed_ms_per_step all_to_all_ms_per_step
for ((i = 0; i < reps; ++i)); do
  for on in true false; do
    rm -rf "$work/out" "$work/trace"
    mkdir -p "$work/trace"
    HP_TRACE=$work/trace bash "$src/scripts/mpirun.sh" 4 "$bin" --config "$src/configs/deepseek_tiny.yaml" \
      --set model.layers=4 --set model.dim=128 --set data_parallel=1 --set pipeline_parallel=2 \
      --set pipeline_parallel_interleave_num=2 --set pipeline_schedule=dualpipev --set expert_parallel=2 \
      --set micro_batch_num=8 --set global_batch_size=32 --set seq_length=64 --set train_steps=$steps \
      --set eval_interval=0 --set output_dir="$work/out" --set pipeline_pair_overlap=$on > "$work/log" 2>&1 ||
      { echo "pair_turns: the run failed:"; tail -20 "$work/log"; exit 1; }
    python3 - "$work/out/metrics.jsonl" "$work/trace" "$on" "$steps" <<'EOF'
import glob, json, sys
metrics, trace, on, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
s = [json.loads(l) for l in open(metrics) if l.startswith('{"step"')]
step_ms = 1e3 * sum(x['step_time_s'] for x in s[1:]) / (len(s) - 1)
exposed, a2a = [], []
for f in sorted(glob.glob(trace + '/trace_rank*.json')):
    events = json.load(open(f))
    events = events['traceEvents'] if isinstance(events, dict) else events
    exposed.append(sum(e.get('dur', 0) for e in events if e.get('name') == 'ep wait exchange'))
    # The communicator's spans are async begin/end pairs (they may overlap).
    begin, total = {}, 0
    for e in events:
        if e.get('name') != 'all_to_all' or e.get('cat') != 'comm':
            continue
        if e['ph'] == 'X':
            total += e.get('dur', 0)
        elif e['ph'] == 'b':
            begin[e['id']] = e['ts']
        elif e['ph'] == 'e' and e['id'] in begin:
            total += e['ts'] - begin.pop(e['id'])
    a2a.append(total)
per = lambda v: sum(v) / len(v) / 1e3 / steps if v else float('nan')
print('%-14s %12.1f %22.1f %20.1f' % ('taking turns' if on == 'true' else 'in turn', step_ms, per(exposed), per(a2a)))
EOF
  done
done
