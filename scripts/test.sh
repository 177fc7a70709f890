#!/usr/bin/env bash
# README command 2: builds everything, then runs the test suite with ctest: every entry but
# the long tier (label long: scripts/long_tier.sh runs it), two at a time where each needs
# one core (an entry of N ranks holds both cores: its PROCESSORS).
#
# Usage: scripts/test.sh [ctest args...]    e.g. scripts/test.sh -L unit (args replace -LE long)
# Exits with ctest's status.
set -euo pipefail

cd "$(dirname "$0")/.."

bash scripts/build.sh

cd build
set +e
if [ $# -eq 0 ]; then set -- -LE long; fi
ctest --output-on-failure -j2 "$@"
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
