#!/usr/bin/env bash
# The tests under AddressSanitizer and UndefinedBehaviorSanitizer (libtorch and Open MPI stay
# uninstrumented), in the clang build the fuzz targets use (build-fuzz/, made by
# scripts/sanitized_build.sh).
#
# Usage: scripts/sanitize.sh --tier           the tier .ci/run runs (below)
#        scripts/sanitize.sh                  the unit tests and the distributed tests at 1, 2
#                                             and 4 ranks (about 2.5 hours here)
#        scripts/sanitize.sh [ctest args...]  those entries, e.g. -L unit or -E 'np[348]|interop'
# The tier (`tier` below): the unit tests (the gtest programs labelled unit), the 1- and
# 2-rank entries of the expert-parallel, context-parallel and Muon layers, the expert-parallel
# one again with fully_shard's overlap off (the synchronous path, which the context-parallel
# and Muon trainer entries take too: those two, 54 s, are left to the full run above to keep
# .ci/run under 40 minutes), and the 4-rank check of ParallelMesh's communicators.
# Findings stop the test that makes them (halt_on_error). A finding inside libtorch or Open
# MPI is suppressed in scripts/sanitize/*.supp with the reason beside it; the project's own
# are fixed, never suppressed. Exits with ctest's status (0, saying why, where clang cannot
# build it).
set -euo pipefail
cd "$(dirname "$0")/.."

tier=(core_test mesh_layout_test local_backend_test fault_injection_test fsdp_unit_test ckpt_unit_test
      hooks_test optim_test pp_unit_test models_test ep_unit_test train_unit_test
      ep_test.np1 ep_test.np2 ep_test.np2_overlap_off cp_test.np1 cp_test.np2
      muon_dist_test.np1 muon_dist_test.np2 parallel_mesh_test.np4)
if [ "${1:-}" = --tier ]; then
  # The programs behind the entries (each name before its first dot), and the entries exactly.
  targets=$(printf '%s\n' "${tier[@]%%.*}" | sort -u | tr '\n' ' ')
  set -- -R "^($(printf '%s|' "${tier[@]}" | sed 's/\./\\./g; s/|$//'))\$"
else
  targets=all
  # 3 and 8 ranks are left to the plain suite (time); the interop tests need PyPI's packages.
  if [ $# -eq 0 ]; then set -- -E 'np3|np8|interop'; fi
fi

set +e
# shellcheck disable=SC2086
bash scripts/sanitized_build.sh $targets
status=$?
set -e
if [ "$status" -eq 77 ]; then echo "sanitize.sh: skipped (above)"; exit 0; fi
[ "$status" -eq 0 ] || { echo "sanitize.sh: the build failed"; exit "$status"; }

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
# own, scaled by HP_SANITIZE_TIMEOUT_SCALE in scripts/sanitized_build.sh).
export HP_COMM_TIMEOUT_S="${HP_COMM_TIMEOUT_S:-300}"

cd build-fuzz
set +e
# Two at a time where each needs one core (an entry of N ranks holds both: its PROCESSORS).
ctest --output-on-failure -j2 "$@"
status=$?
set -e
echo "sanitize.sh: ctest exited with status $status"
exit "$status"
