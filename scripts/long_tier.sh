#!/usr/bin/env bash
# The long tier, three parts, each timed (the last lines print their seconds):
#   1. the ctest entries labelled long, which scripts/test.sh (and so .ci/run) leaves out to
#      keep CI within its time. Each repeats, at more ranks or chained end to end, code
#      entries of the fast tier already run (tests/CMakeLists.txt says which and why):
#      comm_test.np4, train_test.np8_tp and llama_example_test (the README's third command);
#   2. the ThreadSanitizer tier (scripts/tsan.sh: comm_test, fully_shard_test and pp_test at
#      2 ranks, in build-tsan/). It is here rather than in .ci/run: from a cold ccache its
#      build alone takes about 4 minutes, more than .ci/run's room under 40 minutes;
#   3. every target built against libtorch 2.11 (scripts/torch2_check.sh --build-all): .ci/run's
#      torch2 tier builds only the programs its tests run, so the benches and the other tests
#      compile against 2.x here.
# BENCHMARKS.md ("The suite's own time", "The ThreadSanitizer tier (issue 45)") records what
# each takes.
#
# Usage: scripts/long_tier.sh [ctest args...]    the args go to part 1's ctest
# Exits 0 when every part passes (the TSan and torch2 parts skipping, saying why, count as
# passing), else with the status of the first that failed.
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

start=$(date +%s)
set +e
bash scripts/torch2_check.sh --build-all
torch2_status=$?
set -e
torch2_s=$(( $(date +%s) - start ))
echo "long_tier.sh: scripts/torch2_check.sh --build-all exited with status $torch2_status after $torch2_s s"
printf '%-8s %5d s\n' long "$long_s" tsan "$tsan_s" torch2 "$torch2_s"
if [ "$status" -ne 0 ]; then exit "$status"; fi
if [ "$tsan_status" -ne 0 ]; then exit "$tsan_status"; fi
exit "$torch2_status"
