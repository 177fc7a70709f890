#!/usr/bin/env bash
# The library and its tests built with AddressSanitizer and UndefinedBehaviorSanitizer
# (libtorch and Open MPI stay uninstrumented) in build-sanitize/, then the unit tests and
# the distributed tests at 1, 2 and 4 ranks.
#
# Usage: scripts/sanitize.sh [ctest args...]    e.g. scripts/sanitize.sh -L unit
# Findings stop the test that makes them (halt_on_error). A finding inside libtorch or Open
# MPI is suppressed in scripts/sanitize/*.supp with the reason beside it; the project's own
# are fixed, never suppressed. Exits with ctest's status.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/deps.sh
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"

flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
if [ ! -f build-sanitize/build.ninja ]; then
  cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHP_BUILD_BENCH=OFF \
    -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined"
fi
# Time limits scaled for the sanitizers' slowdown (about 3-10x; more with several ranks per
# core): ctest's TIMEOUT of each entry and its communicators' timeout (HP_TEST_TIMEOUT_SCALE).
cmake -S . -B build-sanitize -DHP_TEST_TIMEOUT_SCALE="${HP_SANITIZE_TIMEOUT_SCALE:-8}" > /dev/null
cmake --build build-sanitize -j "${HP_BUILD_JOBS:-2}"

supp="$PWD/scripts/sanitize"
# Leaks are reported at exit; Open MPI's and libtorch's own allocations that live until
# exit are suppressed by library (lsan.supp says which and why).
# fast_unwind_on_malloc=0: Open MPI is built without frame pointers, so the fast unwinder
# stops inside it and leaves allocation stacks too short for the suppressions to match.
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:abort_on_error=0:detect_odr_violation=0:fast_unwind_on_malloc=0${ASAN_EXTRA:+:$ASAN_EXTRA}"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
# Open MPI and PMIx unload their components (mca_*.so) at finalize, so their leaks would
# have no module name to match; kept loaded, their frames are named.
export OMPI_MCA_mca_base_component_disable_dlclose=1 PMIX_MCA_mca_base_component_disable_dlclose=1
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp"
# Sanitized runs are slower: the communicator's timeouts get room (ctest entries set their
# own, scaled above).
export HP_COMM_TIMEOUT_S="${HP_COMM_TIMEOUT_S:-300}"

cd build-sanitize
set +e
# 3 and 8 ranks are left to the plain suite (time); the interop tests need PyPI's packages.
# Arguments replace the default selection (e.g. -E 'np[348]|interop' for the 1- and 2-rank
# entries alone).
if [ $# -eq 0 ]; then set -- -E 'np3|np8|interop'; fi
ctest --output-on-failure -j1 "$@"
status=$?
set -e
echo "sanitize.sh: ctest exited with status $status"
exit "$status"
