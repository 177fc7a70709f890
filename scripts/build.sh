#!/usr/bin/env bash
# Builds hyperparallel in build/ (Release, Ninja), installing missing packages first.
#
# Usage: scripts/build.sh [target...]      no target = everything
# Environment:
#   HP_CMAKE_ARGS   extra arguments for the first configure (word-split), e.g.
#                   HP_CMAKE_ARGS="-DHP_BUILD_BENCH=OFF". Used only when build/ is not yet
#                   configured; delete build/ to configure again with other arguments.
#   HP_BUILD_JOBS   parallel compile jobs (default 2)
#   CCACHE_DIR      ccache's cache (default $HOME/.cache/ccache)
set -euo pipefail

cd "$(dirname "$0")/.."

bash scripts/deps.sh

# Cache hits across checkouts in different folders (a fresh CI clone reuses the cache).
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
if [ -z "${CCACHE_DIR:-}" ]; then
  export CCACHE_DIR="$HOME/.cache/ccache"
fi

if [ ! -f build/build.ninja ]; then
  # shellcheck disable=SC2086  # HP_CMAKE_ARGS is a list of words on purpose
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release ${HP_CMAKE_ARGS:-}
fi

targets=()
for t in "$@"; do
  targets+=(--target "$t")
done
cmake --build build -j "${HP_BUILD_JOBS:-2}" "${targets[@]}"
