#!/usr/bin/env bash
# hyperparallel as another project uses it:
#   1. `cmake --install` of the build into a temporary prefix, then tests/consumer built
#      against it with find_package(hyperparallel) and run on 2 ranks (1 without mpirun);
#   2. the same consumer built with add_subdirectory of this checkout, and run.
# Usage: scripts/cmake_package_check.sh [build dir] [mpirun]
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$src/build}
mpirun=${2:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$src}"

run() {  # run <exe>
  if [ -n "$mpirun" ]; then
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "$mpirun" -np 2 --oversubscribe --bind-to none "$1"
  else
    "$1"
  fi
}

# The libtorch (and NCCL) the build was configured with, found again by the consumer.
torch_prefix=$(sed -n 's/^CMAKE_PREFIX_PATH:[A-Z]*=//p' "$build/CMakeCache.txt")
nccl_root=$(sed -n 's/^NCCL_ROOT:[A-Z]*=//p' "$build/CMakeCache.txt")
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/lib/cmake/hyperparallel/hyperparallelConfig.cmake"
test -f "$work/prefix/lib/cmake/hyperparallel/hyperparallelConfigVersion.cmake"
test -f "$work/prefix/include/hp/config.h"
cmake -S "$src/tests/consumer" -B "$work/pkg" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix${torch_prefix:+;$torch_prefix}" ${nccl_root:+-DNCCL_ROOT="$nccl_root"} > "$work/pkg.log"
cmake --build "$work/pkg" > "$work/pkg-build.log"
run "$work/pkg/consumer"
echo "find_package consumer: ok"

# Its build folder sits beside build/ (one level under the checkout, as build/ is), so that
# ccache, with CCACHE_BASEDIR the checkout, sees the library's sources under the same
# relative paths as the main build's and reuses its objects where the flags are the same.
sub="$src/build-consumer-sub.$$"
trap 'rm -rf "$work" "$sub"' EXIT
# Without precompiled headers: this folder's name changes with every run ($$), and a
# precompiled header names it, so no compile would come from the cache (366 s instead of 25).
cmake -S "$src/tests/consumer" -B "$sub" -G Ninja -DCMAKE_BUILD_TYPE=Release -DHP_PRECOMPILED_HEADERS=OFF \
  -DHP_CONSUMER_SUBDIR="$src" ${torch_prefix:+-DCMAKE_PREFIX_PATH="$torch_prefix"} ${nccl_root:+-DNCCL_ROOT="$nccl_root"} \
  > "$work/sub.log"
cmake --build "$sub" --target consumer -j "${HP_BUILD_JOBS:-2}" > "$work/sub-build.log"
run "$sub/consumer"
echo "add_subdirectory consumer: ok"
