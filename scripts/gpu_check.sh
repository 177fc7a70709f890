#!/usr/bin/env bash
# The GPU check, run on the GPU machine (see the README's "GPU build"): configures against
# the Python package's libtorch (CUDA), builds the library, the GPU tests and gpu_bench,
# runs the tests labelled gpu (the nccl backend; fully_shard's correctness matrix on CUDA
# at world size 1) and both benchmarks (hp::fully_shard and PyTorch FSDP2 on the same
# model), and writes everything to one file.
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
gtest=()
[ -d third_party/googletest ] && gtest=(-DHP_GTEST_SOURCE_DIR="$PWD/third_party/googletest")
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" -DHP_WITH_MPI=OFF \
  "${gtest[@]}" || { echo "RESULT: configure failed"; exit 1; }

step "build"
cmake --build build-gpu -j "${HP_GPU_JOBS:-$(nproc)}" --target nccl_test fully_shard_test gpu_bench ||
  { echo "RESULT: build failed"; exit 1; }

step "tests (ctest -L gpu)"
(cd build-gpu && timeout 300 ctest -L gpu --output-on-failure) || status=1

step "benchmark: hp::fully_shard vs PyTorch FSDP2, world size 1"
for c in small large; do
  HP_BACKEND=nccl timeout 150 build-gpu/gpu_bench "$c" 10 || status=1
  timeout 200 python3 bench/fsdp2_bench.py "$c" 10 || status=1
done

step "done"
echo "RESULT: $([ $status = 0 ] && echo passed || echo FAILED)"
exit $status
