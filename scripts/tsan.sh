#!/usr/bin/env bash
# The ThreadSanitizer tier: the communicator's, fully_shard's and the pipeline's tests
# (comm_test, fully_shard_test, pp_test) at 2 ranks, every object of the project built with
# -fsanitize=thread by clang (libtorch, Open MPI, libgomp, OpenBLAS and the standard library
# stay uninstrumented), in build-tsan/. Its own folder: TSan cannot share objects with the
# ASan + UBSan build (build-fuzz/).
#
# It runs in the long tier (scripts/long_tier.sh), not in .ci/run: a cold build of the three
# programs takes longer than .ci/run's remaining room (BENCHMARKS.md, "The ThreadSanitizer
# tier (issue 45)", records the times).
#
# Usage: scripts/tsan.sh                   the three programs' 2-rank entries
#        scripts/tsan.sh [ctest args...]   other entries of build-tsan/, e.g. -R 'comm_test\.np3'
# A report stops the rank that makes it (halt_on_error) and so fails its entry. Reports that
# TSan makes only because libtorch's and Open MPI's own synchronization is invisible to it
# (they are uninstrumented) are suppressed in tests/tsan.supp, each with its reason; a race in
# the project's own code is fixed, never suppressed. Exits with ctest's status; 77 (saying
# why) where clang cannot build or run a ThreadSanitizer program on this machine.
# Environment: HP_BUILD_JOBS (default 2), CCACHE_DIR (as scripts/build.sh),
# HP_SANITIZE_TIMEOUT_SCALE (default 8, as scripts/sanitized_build.sh: the factor on each
# test's time limit and its communicators' timeout, HP_TEST_TIMEOUT_SCALE), TSAN_EXTRA (more
# TSAN_OPTIONS, ':'-joined; e.g. halt_on_error=0:log_path=/tmp/tsan to collect every report).
set -euo pipefail
cd "$(dirname "$0")/.."

programs=(comm_test fully_shard_test pp_test)
if [ $# -eq 0 ]; then
  set -- -R "^($(printf '%s\\.np2|' "${programs[@]}" | sed 's/|$//'))\$"
fi

if ! command -v clang++ >/dev/null 2>&1; then
  echo "tsan.sh: skipped: clang++ is not installed (apt-get install clang)"
  exit 77
fi
# TSan's runtime maps its shadow at fixed addresses; some kernels (a large mmap_rnd_bits)
# place libraries where it does not expect them ("unexpected memory mapping"). Without
# address randomization (setarch -R) it then still runs.
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
printf '#include <thread>\nint main() { std::thread t([] {}); t.join(); return 0; }\n' > "$probe/p.cpp"
if ! clang++ -fsanitize=thread -pthread "$probe/p.cpp" -o "$probe/p" >/dev/null 2>&1; then
  echo "tsan.sh: skipped: clang++ cannot link a ThreadSanitizer program"
  exit 77
fi
norandom=()
if ! "$probe/p" >/dev/null 2>&1; then
  if command -v setarch >/dev/null 2>&1 && setarch "$(uname -m)" -R "$probe/p" >/dev/null 2>&1; then
    norandom=(setarch "$(uname -m)" -R)
  else
    echo "tsan.sh: skipped: a ThreadSanitizer program does not run on this kernel"
    exit 77
  fi
fi

bash scripts/deps.sh > /dev/null
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
# Every setting on each run (not only the first), so a folder configured by an older version
# of this script is brought to these. The flags reach every object (the library's own -O3
# comes after them and stays); the link adds TSan's runtime.
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_FLAGS="-fsanitize=thread" -DCMAKE_CXX_FLAGS="-fsanitize=thread" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" \
  -DHP_BUILD_FUZZ=OFF -DHP_BUILD_TESTS=ON -DHP_BUILD_BENCH=OFF -DHP_INSTALL=OFF -DHP_WITH_MPI=ON \
  -DHP_TEST_TIMEOUT_SCALE="${HP_SANITIZE_TIMEOUT_SCALE:-8}" > build-tsan.configure.log 2>&1 ||
  { tail -20 build-tsan.configure.log; echo "tsan.sh: configure failed"; exit 1; }
start=$(date +%s)
cmake --build build-tsan -j "${HP_BUILD_JOBS:-2}" --target "${programs[@]}"
echo "tsan.sh: built ${programs[*]} in $(( $(date +%s) - start )) s"

# halt_on_error: the first report ends the rank (exit code 66), and mpirun the job.
# second_deadlock_stack: both stacks of a lock-order inversion. history_size=4: older
# accesses keep their stacks in the long collective loops.
export TSAN_OPTIONS="halt_on_error=1:exitcode=66:second_deadlock_stack=1:history_size=4:suppressions=$PWD/tests/tsan.supp:print_suppressions=0${TSAN_EXTRA:+:$TSAN_EXTRA}"
# Open MPI and PMIx unload their components (mca_*.so) at finalize, so a report or a
# suppression inside one would have no module name to match; kept loaded, they are named.
export OMPI_MCA_mca_base_component_disable_dlclose=1 PMIX_MCA_mca_base_component_disable_dlclose=1
# libgomp's and OpenBLAS's worker pools synchronize in uninstrumented code TSan cannot see:
# one thread each, so libtorch's kernels run on the calling thread.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
# Sanitized ranks are slower: the communicator's timeouts get room (ctest entries set their
# own, scaled by HP_SANITIZE_TIMEOUT_SCALE above).
export HP_COMM_TIMEOUT_S="${HP_COMM_TIMEOUT_S:-600}"

cd build-tsan
start=$(date +%s)
set +e
# One entry at a time: a 2-rank entry holds both cores (its PROCESSORS).
"${norandom[@]}" ctest --output-on-failure "$@"
status=$?
set -e
echo "tsan.sh: ctest exited with status $status after $(( $(date +%s) - start )) s"
exit "$status"
