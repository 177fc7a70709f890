#!/usr/bin/env bash
# The GPU check, run on the GPU machine (see the README's "GPU build"): configures against
# the Python package's libtorch (CUDA), builds the library, the GPU tests and gpu_bench,
# runs the tests labelled gpu (the nccl backend; fully_shard's correctness matrix on CUDA
# at world size 1), hp-train on the GPU against the same run on the CPU (the demo config at
# world size 1, device: cuda, in bf16 and in fp32), and both benchmarks (hp::fully_shard and
# PyTorch FSDP2 on the same model), and writes everything to one file.
#
#   scripts/gpu_check.sh [file]     default: $OUT/gpu_check.txt when $OUT is set, else ./gpu_check.txt
#   scripts/gpu_check.sh --prepare  on the CPU machine, before carrying the tree over: copies
#                                   GoogleTest's sources (Debian's /usr/src/googletest) to
#                                   third_party/googletest (ignored by git), for a machine
#                                   without a GoogleTest package
# HP_GPU_JOBS sets the build's parallel jobs (default: all cores).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
  rm -rf third_party/googletest
  mkdir -p third_party
  cp -r /usr/src/googletest third_party/googletest
  echo "copied GoogleTest to third_party/googletest"
  exit 0
fi

out=${1:-${OUT:-.}/gpu_check.txt}
exec > >(tee "$out") 2>&1
status=0
step() { echo; echo "== $* ($(date +%T))"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'

step "configure"
prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
# The NCCL PyTorch loads (the nvidia-nccl wheel) when there is one, else the system's.
nccl_root=$(python3 -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
# libtorch's CMake config looks for nvcc through CUDACXX or PATH.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDACXX=/usr/local/cuda/bin/nvcc; fi
extra=(-DHP_REQUIRE_NCCL=ON)
[ -n "$nccl_root" ] && extra+=(-DNCCL_ROOT="$nccl_root")
[ -d third_party/googletest ] && extra+=(-DHP_GTEST_SOURCE_DIR="$PWD/third_party/googletest")
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" -DHP_WITH_MPI=OFF \
  "${extra[@]}" || { echo "RESULT: configure failed"; exit 1; }

step "build"
cmake --build build-gpu -j "${HP_GPU_JOBS:-$(nproc)}" --target nccl_test fully_shard_test gpu_bench hp-train ||
  { echo "RESULT: build failed"; exit 1; }

# Time limits keep the whole check within one 10-minute device command (the build takes
# a few minutes of it).
step "tests (ctest -L gpu)"
(cd build-gpu && timeout 180 ctest -L gpu --output-on-failure --timeout 170) || status=1

step "hp-train: the demo config on the GPU against the CPU, world size 1"
# Each step's loss on cuda against cpu. fp32: the same arithmetic in another summation
# order, 1e-4 relative over 10 steps (TF32 is off for matmuls by default). bf16 (the demo's
# dtypes): each rounding is up to 2^-8 relative and the kernels round differently, so
# 2e-2 relative (five bf16 units) over 20 steps.
hp_train_vs_cpu() {  # name bound steps --set...
  local name=$1 bound=$2 steps=$3; shift 3
  local common=(--config configs/deepseek_tiny.yaml --set data_parallel=1 --set train_steps="$steps" "$@")
  timeout 120 build-gpu/hp-train "${common[@]}" --set device=cpu --set output_dir="$OUT_DIR/$name-cpu" > /dev/null &&
    timeout 120 build-gpu/hp-train "${common[@]}" --set device=cuda --set output_dir="$OUT_DIR/$name-cuda" |
      grep -E "^hp-train:|dtypes|^done" || { echo "hp-train $name: the run failed"; return 1; }
  python3 - "$OUT_DIR/$name-cpu/metrics.jsonl" "$OUT_DIR/$name-cuda/metrics.jsonl" "$bound" <<'PY'
import json, sys
# Each step's loss, then each validation's (the demo config validates every 10 steps).
load = lambda p: ([json.loads(l)["loss"] for l in open(p) if l.startswith('{"step"')] +
                  [json.loads(l)["eval"]["loss"] for l in open(p) if l.startswith('{"eval"')])
cpu, gpu, bound = load(sys.argv[1]), load(sys.argv[2]), float(sys.argv[3])
worst = max(abs(a - b) / abs(a) for a, b in zip(cpu, gpu))
print(f"hp-train cuda vs cpu: {len(gpu)} losses (steps and validations), loss {gpu[0]:.4f} -> {gpu[-1]:.4f}, "
      f"largest relative difference {worst:.2e} (bound {bound:g})")
sys.exit(0 if len(cpu) == len(gpu) > 0 and worst <= bound else 1)
PY
}
OUT_DIR=$(mktemp -d)
hp_train_vs_cpu fp32 1e-4 10 --set params_dtype=float32 --set compute_dtype=float32 || status=1
hp_train_vs_cpu bf16 2e-2 20 || status=1

step "benchmark: hp::fully_shard vs PyTorch FSDP2, world size 1"
for c in small large; do
  HP_BACKEND=nccl timeout 60 build-gpu/gpu_bench "$c" 8 || status=1
  timeout 75 python3 bench/fsdp2_bench.py "$c" 8 || status=1
done

step "done"
echo "RESULT: $([ $status = 0 ] && echo passed || echo FAILED)"
exec >&- 2>&-  # let tee write the last lines before the script ends
wait
exit $status
