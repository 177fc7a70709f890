#!/usr/bin/env bash
# The libtorch 2.x and CUDA guard, on a CPU machine: installs the PyTorch wheel of the GPU
# machine's version (2.11, CUDA 13) into a virtual environment (cached across runs), builds
# the whole project against its libtorch with the CUDA path on (the nccl backend against the
# wheel's NCCL, CUDA allocations, gpu_bench, compiled and linked with the CUDA toolkit's
# nvcc), and runs the CPU tests there. A compile error the GPU machine would hit is caught
# here. Skipped (exit 0, saying why) where PyPI or nvcc cannot be had.
#
#   scripts/torch2_check.sh [ctest args...]     default: the fast tier (below)
#
# HP_TORCH2_VENV: the virtual environment (default ~/.cache/hyperparallel/torch-2.11);
# HP_TORCH2_BUILD: the build folder (default build-torch2).
set -uo pipefail
cd "$(dirname "$0")/.."
version=2.11
venv=${HP_TORCH2_VENV:-$HOME/.cache/hyperparallel/torch-$version}
build=${HP_TORCH2_BUILD:-build-torch2}
step() { echo "== torch2_check: $* ($(date +%T))"; }

if ! command -v nvcc >/dev/null; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; else
    echo "torch2_check: SKIP: no nvcc (the CUDA toolkit) on this machine"; exit 0; fi
fi
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch; assert torch.__version__.startswith('$version')" 2>/dev/null; then
  step "installing torch $version from PyPI into $venv (once; about 5 GB)"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  if ! { python3 -m venv "$venv" && "$venv/bin/pip" install -q "torch==$version.*" numpy; } > "$venv.log" 2>&1; then
    echo "torch2_check: SKIP: could not install torch $version from PyPI (see $venv.log)"
    exit 0
  fi
fi
py=$venv/bin/python
prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')
nccl_root=$("$py" -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
"$py" -c 'import torch; print("torch_check: torch", torch.__version__, "cuda", torch.version.cuda)'

step "configure $build"
extra=(-DHP_REQUIRE_NCCL=ON)
[ -n "$nccl_root" ] && extra+=(-DNCCL_ROOT="$nccl_root")
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" "${extra[@]}" \
  > "$build.configure.log" 2>&1 || { tail -30 "$build.configure.log"; echo "torch2_check: configure FAILED"; exit 1; }
grep -E "NCCL:|warning" "$build.configure.log" | head -5

step "build (everything, the CUDA path included)"
cmake --build "$build" -j "${HP_BUILD_JOBS:-2}" > "$build.build.log" 2>&1 ||
  { grep -E "error|FAILED" "$build.build.log" | head -30; echo "torch2_check: build FAILED (see $build.build.log)"; exit 1; }
for t in hp hp-train nccl_test gpu_bench; do
  [ -n "$(find "$build" -name "lib$t.a" -o -name "$t" -type f | head -1)" ] ||
    { echo "torch2_check: $t was not built"; exit 1; }
done

step "CPU tests against libtorch $version"
cd "$build"
# The fast tier by default: every test at 1 and 2 ranks (the unit tests, each distributed
# test's np1 and np2 entries, the program tests), which exercise every code path libtorch
# 2.x could change. Left to the main suite (scripts/test.sh), which runs them against
# libtorch 1.13: the 3-, 4- and 8-rank entries and the timing assertions (the same code
# under more ranks); the communicator's np2 entry (byte moves over MPI, no libtorch op its
# np1 entry does not make); and the tests of processes and files rather than tensors
# (injected faults, the launcher, kills and restarts, the run folders' locks, the installed
# CMake package): together about 6 minutes. All of them here: scripts/torch2_check.sh -LE gpu
if [ $# -eq 0 ]; then
  set -- -LE 'gpu|dist_timing|fuzz' \
    -E '\.np[348]|^comm_test\.np2$|^fault_matrix_test$|^launcher_fault_test$|^restart_test$|^ckpt_kill_test$|^run_folders_test$|^cmake_package_test$'
fi
ctest --output-on-failure -j2 "$@"
