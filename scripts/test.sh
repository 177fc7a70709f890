#!/usr/bin/env bash
# README command 2: builds everything, then runs the whole test suite with ctest.
#
# Usage: scripts/test.sh [ctest args...]    e.g. scripts/test.sh -L unit
# Exits with ctest's status.
set -euo pipefail

cd "$(dirname "$0")/.."

bash scripts/build.sh

cd build
set +e
ctest --output-on-failure -j1 "$@"
status=$?
set -e
# ctest prints its summary ("N% tests passed, ...", then any failed tests) as its last
# lines above; this line only repeats the outcome.
if [ "$status" -eq 0 ]; then
  echo "test.sh: all selected tests passed"
else
  echo "test.sh: ctest exited with status $status"
fi
exit "$status"
