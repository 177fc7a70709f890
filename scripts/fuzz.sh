#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ with clang (ASan + UBSan + libFuzzer coverage) in
# build-fuzz/ (scripts/sanitized_build.sh, shared with scripts/sanitize.sh), then runs each
# for SECONDS (default 30) on a copy of its seed corpus (fuzz/corpus/<name>/; what the
# fuzzer adds stays in build-fuzz/corpus/<name>/).
#
# Usage: scripts/fuzz.sh [SECONDS] [NAME...]     e.g. scripts/fuzz.sh 600 config data
#   NAME: run only these targets (config, safetensors_header, ...; default all).
# Prints each target's executions and executions per second. A finding (crash, sanitizer
# report, timeout of 10 s on one input, 2 GB of memory, an uncaught exception) stops that
# target and keeps its input in build-fuzz/findings/<name>/; the script then exits 1 after
# running the others. Without clang or libFuzzer it says so and exits 0, or 77 (ctest's
# skip) with HP_FUZZ_SKIP_STATUS=77.
# Environment: HP_BUILD_JOBS, CCACHE_DIR (as scripts/sanitized_build.sh), HP_FUZZ_NO_BUILD=1
# (run what build-fuzz/ holds).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-30}"
shift || true
skip_status="${HP_FUZZ_SKIP_STATUS:-0}"

skip() {
  echo "fuzz.sh: skipped: $*"
  exit "$skip_status"
}

if [ "${HP_FUZZ_NO_BUILD:-0}" != 1 ]; then
  set +e
  bash scripts/sanitized_build.sh fuzz_targets
  status=$?
  set -e
  [ "$status" -eq 77 ] && skip "no clang build with libFuzzer (above)"
  [ "$status" -eq 0 ] || { echo "fuzz.sh: the build failed"; exit "$status"; }
fi

names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for exe in build-fuzz/fuzz/*_fuzz; do
    [ -x "$exe" ] && names+=("$(basename "$exe" _fuzz)")
  done
fi
[ ${#names[@]} -gt 0 ] || skip "no fuzz target in build-fuzz/fuzz/ (build them first)"

# libtorch and yaml-cpp are uninstrumented: their allocations live until exit (not leaks of
# ours), and ASan's leak check at each finding would only name them.
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=0:abort_on_error=1:detect_odr_violation=0${ASAN_EXTRA:+:$ASAN_EXTRA}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:abort_on_error=1"
failed=()
printf '%-20s %10s %10s %8s %s\n' target executions exec/s seconds outcome
for name in "${names[@]}"; do
  exe="$PWD/build-fuzz/fuzz/${name}_fuzz"
  [ -x "$exe" ] || { echo "fuzz.sh: no target $exe" >&2; failed+=("$name"); continue; }
  corpus="build-fuzz/corpus/$name" findings="build-fuzz/findings/$name" log="build-fuzz/logs/$name.log"
  mkdir -p "$corpus" "$findings" "$(dirname "$log")"
  [ -d "fuzz/corpus/$name" ] && cp -n fuzz/corpus/"$name"/* "$corpus"/ 2>/dev/null || true
  # The JSON and YAML readers take inputs up to 1 MiB: nesting 200,000 deep (a segfault before
  # the nesting bound) needs 400 KB, past the 64 KiB the others take.
  max_len=65536
  case $name in config|hf_config|hf_index|metadata) max_len=1048576 ;; esac
  set +e
  t0=$(date +%s)
  "$exe" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=2048 -max_len=$max_len \
    -print_final_stats=1 -artifact_prefix="$findings/" "$corpus" > "$log" 2>&1
  status=$?
  took=$(( $(date +%s) - t0 ))
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  if [ "$status" -eq 0 ]; then
    outcome="no finding"
  else
    outcome="FINDING (status $status): $(ls -t "$findings" | head -1) - see $log"
    failed+=("$name")
  fi
  printf '%-20s %10s %10s %8s %s\n' "$name" "${execs:-?}" "${rate:-?}" "$took" "$outcome"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz.sh: findings in: ${failed[*]} (inputs under build-fuzz/findings/; replay: build-fuzz/fuzz/<name>_fuzz <input>)"
  exit 1
fi
echo "fuzz.sh: ${#names[@]} targets, $seconds s each, no finding"
