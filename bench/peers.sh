#!/usr/bin/env bash
# hyperparallel beside what a user would otherwise run on a CPU cluster, in one run: the
# bench transformer (fsdp_bench's), the same per-rank batch, one compute thread per rank,
# 2 ranks; medians of 15 steps. Prints one JSON line per run, then the ratios.
#
#   bench/peers.sh [build dir] [BxT ...]        (default batches: 16x64 2x64)
#
# Peers:
#   - PyTorch 1.13 (Debian 12's python3-torch): eager in one process, DistributedDataParallel
#     over gloo (its FSDP does not import on Debian's Python 3.11).
#   - PyTorch from PyPI (a virtual environment under the build dir, made when missing; 2.11
#     when this was written): eager, DDP, FSDP1 (FullyShardedDataParallel) and FSDP2
#     (fully_shard) over gloo on the CPU.
# A peer that cannot be installed or run is reported and skipped.
set -uo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$src/build}
shift || true
batches=("$@")
[ ${#batches[@]} -eq 0 ] && batches=(16x64 2x64)
out=$(mktemp)
trap 'rm -f "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 HP_NUM_THREADS=1 OMP_NUM_THREADS=1
venv=${HP_PEER_VENV:-$build/py-torch-peer}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  echo "peers.sh: installing PyTorch from PyPI into $venv (once; large)"
  python3 -m venv "$venv" && "$venv/bin/pip" install -q torch numpy > "$build/py-torch-peer.log" 2>&1 ||
    echo "peers.sh: could not install PyTorch from PyPI (see $build/py-torch-peer.log): its peers are skipped"
fi

# run_py PYTHON IMPL B T RANKS
# Each process of a peer gets HP_PEER_TIMEOUT seconds (default 900): a rank left waiting
# for a peer that died at its rendezvous is stopped, and the peer reported as failed.
run_py() {
  local py=$1 impl=$2 b=$3 t=$4 n=$5 port=$((29500 + RANDOM % 1000)) pids=()
  local limit=${HP_PEER_TIMEOUT:-900}
  if [ "$n" = 1 ]; then
    timeout "$limit" "$py" "$src/bench/peers.py" "$impl" "$b" "$t" >> "$out" 2> "$out.err" ||
      echo "peers.sh: $impl ($py) failed or ran past ${limit} s: $(tail -1 "$out.err")"
    return
  fi
  for r in $(seq 0 $((n - 1))); do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=$n \
      timeout "$limit" "$py" "$src/bench/peers.py" "$impl" "$b" "$t" >> "$out" 2> "$out.err.$r" &
    pids+=($!)
  done
  local ok=1
  for p in "${pids[@]}"; do wait "$p" || ok=0; done
  [ $ok = 1 ] || echo "peers.sh: $impl ($py) failed or ran past ${limit} s: $(tail -1 "$out.err.0")"
}

for bt in "${batches[@]}"; do
  b=${bt%x*} t=${bt#*x}
  mpirun -np 2 --oversubscribe --bind-to none -x HP_NUM_THREADS "$build/fsdp_bench" peer "$bt" >> "$out"
  if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
    run_py /usr/bin/python3 eager "$b" "$t" 1
    run_py /usr/bin/python3 ddp "$b" "$t" 2
  else
    echo "peers.sh: Debian's python3-torch is not installed: its peers are skipped"
  fi
  if [ -x "$venv/bin/python" ]; then
    for impl in eager ddp fsdp1 fsdp2; do run_py "$venv/bin/python" "$impl" "$b" "$t" $([ $impl = eager ] && echo 1 || echo 2); done
  fi
done
cat "$out"
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for key in sorted({(r["batch"], r["tokens"]) for r in rows}):
    rs = [r for r in rows if (r["batch"], r["tokens"]) == key]
    hp = next((r for r in rs if r["impl"] == "hyperparallel"), None)
    if not hp:
        continue
    print(f"batch {key[0]} x {key[1]} per rank: hyperparallel fully_shard {hp['step_ms']:.1f} ms "
          f"(overlap {hp['overlap']}, peak tensors {hp['peak_tensor_bytes'] / 1e6:.1f} MB, "
          f"peak RSS {hp['peak_rss_bytes'] / 1e6:.0f} MB per rank; "
          f"model FLOP utilization {hp['mfu']:.2f} of {hp['matmul_gflops_measured']:.0f} GFLOP/s measured)")
    for r in rs:
        if r is hp:
            continue
        print(f"  PyTorch {r['torch']:<12} {r['impl']:<6} {r['ranks']} rank(s): {r['step_ms']:7.1f} ms; "
              f"hyperparallel / it = {hp['step_ms'] / r['step_ms']:.2f} (its peak RSS {r['peak_rss_bytes'] / 1e6:.0f} MB)")
PY
