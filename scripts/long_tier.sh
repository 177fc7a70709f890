#!/usr/bin/env bash
# The long tier: the ctest entries labelled long, which scripts/test.sh (and so .ci/run)
# leaves out to keep CI within its time. Each repeats, at more ranks, code an entry of the
# fast tier already runs (tests/CMakeLists.txt says which and why); BENCHMARKS.md ("The
# suite's own time") records what the tier takes.
#
# Usage: scripts/long_tier.sh [ctest args...]    Exits with ctest's status.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
cd build
start=$(date +%s)
set +e
ctest --output-on-failure -j2 -L long "$@"
status=$?
set -e
echo "long_tier.sh: ctest exited with status $status after $(( $(date +%s) - start )) s"
exit "$status"
