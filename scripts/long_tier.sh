#!/usr/bin/env bash
# The long tier, two parts, each timed (the last lines print their seconds):
#   1. the ctest entries labelled long, which scripts/test.sh (and so .ci/run) leaves out to
#      keep CI within its time. Each repeats, at more ranks, code an entry of the fast tier
#      already runs (tests/CMakeLists.txt says which and why);
#   2. the ThreadSanitizer tier (scripts/tsan.sh: comm_test, fully_shard_test and pp_test at
#      2 ranks, in build-tsan/). It is here rather than in .ci/run: from a cold ccache its
#      build alone takes about 4 minutes, more than .ci/run's room under 40 minutes.
# BENCHMARKS.md ("The suite's own time", "The ThreadSanitizer tier (issue 45)") records what
# each takes.
#
# Usage: scripts/long_tier.sh [ctest args...]    the args go to part 1's ctest
# Exits 0 when both parts pass (the TSan part skipping, saying why, counts as passing), else
# with the status of the first that failed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
start=$(date +%s)
set +e
(cd build && ctest --output-on-failure -j2 -L long "$@")
status=$?
set -e
long_s=$(( $(date +%s) - start ))
echo "long_tier.sh: ctest exited with status $status after $long_s s"

start=$(date +%s)
set +e
bash scripts/tsan.sh
tsan_status=$?
set -e
if [ "$tsan_status" -eq 77 ]; then tsan_status=0; fi
tsan_s=$(( $(date +%s) - start ))
echo "long_tier.sh: scripts/tsan.sh exited with status $tsan_status after $tsan_s s"
printf '%-8s %5d s\n' long "$long_s" tsan "$tsan_s"
if [ "$status" -ne 0 ]; then exit "$status"; fi
exit "$tsan_status"
