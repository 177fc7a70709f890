#!/usr/bin/env bash
# The sanitized build, shared by scripts/fuzz.sh (the fuzz targets) and scripts/sanitize.sh
# (the tests): clang, AddressSanitizer + UndefinedBehaviorSanitizer + libFuzzer's coverage in
# every object of the project (libtorch, Open MPI, yaml-cpp and the standard library stay
# uninstrumented), the MPI backend and the tests on, in build-fuzz/. One folder, so the fuzz
# targets and the sanitized tests share the library's objects: each is compiled once.
#
# Usage: scripts/sanitized_build.sh TARGET...    e.g. fuzz_targets, or train_unit_test ep_test
# Exits 77 (saying why) where clang cannot link a libFuzzer target with both sanitizers;
# otherwise with the build's status. Environment: HP_BUILD_JOBS (default 2), CCACHE_DIR (as
# scripts/build.sh), HP_SANITIZE_TIMEOUT_SCALE (default 8: the factor on each test's time
# limit and its communicators' timeout, HP_TEST_TIMEOUT_SCALE).
set -euo pipefail
cd "$(dirname "$0")/.."

[ $# -gt 0 ] || { echo "usage: scripts/sanitized_build.sh TARGET..." >&2; exit 2; }
if ! command -v clang++ >/dev/null 2>&1; then
  echo "sanitized_build.sh: skipped: clang++ is not installed (apt-get install clang)"
  exit 77
fi
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' > "$probe/p.cpp"
if ! clang++ -fsanitize=fuzzer,address,undefined "$probe/p.cpp" -o "$probe/p" >/dev/null 2>&1; then
  echo "sanitized_build.sh: skipped: clang++ cannot link a libFuzzer target with ASan and UBSan"
  exit 77
fi
bash scripts/deps.sh > /dev/null
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
# Every setting on each run (not only the first), so a folder configured by an older version
# of this script is brought to these.
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DHP_BUILD_FUZZ=ON -DHP_BUILD_TESTS=ON -DHP_BUILD_BENCH=OFF \
  -DHP_INSTALL=OFF -DHP_WITH_MPI=ON -DHP_TEST_TIMEOUT_SCALE="${HP_SANITIZE_TIMEOUT_SCALE:-8}" > build-fuzz.configure.log 2>&1 ||
  { tail -20 build-fuzz.configure.log; echo "sanitized_build.sh: configure failed"; exit 1; }
start=$(date +%s)
cmake --build build-fuzz -j "${HP_BUILD_JOBS:-2}" --target "$@"
echo "sanitized_build.sh: built $* in $(( $(date +%s) - start )) s"
