#!/usr/bin/env bash
# The libtorch 2.x and CUDA guard, on a CPU machine: installs the PyTorch wheel of the GPU
# machine's version (2.11, CUDA 13) into a virtual environment (cached across runs), builds
# the project against its libtorch with the CUDA path on (the nccl backend against the
# wheel's NCCL, CUDA allocations, gpu_bench, compiled and linked with the CUDA toolkit's
# nvcc), and runs the CPU tests there. A compile error the GPU machine would hit is caught
# here. Skipped (exit 0, saying why) where PyPI or nvcc cannot be had.
#
#   scripts/torch2_check.sh [ctest args...]     default: the fast tier (below)
#   scripts/torch2_check.sh --build-all         every target (the benches too), no tests
#
# With the default tier it builds only what that tier runs (the programs its entries name,
# beside hp, hp-train, nccl_test and gpu_bench): the other benches and tests compile against
# 2.11 in the long tier (scripts/long_tier.sh runs --build-all). Other ctest args build
# everything, as entries may run programs their command does not name.
#
# HP_TORCH2_VENV: the virtual environment (default ~/.cache/hyperparallel/torch-2.11);
# HP_TORCH2_BUILD: the build folder (default build-torch2).
set -uo pipefail
cd "$(dirname "$0")/.."
version=2.11
venv=${HP_TORCH2_VENV:-$HOME/.cache/hyperparallel/torch-$version}
build=${HP_TORCH2_BUILD:-build-torch2}
step() { echo "== torch2_check: $* ($(date +%T))"; }

if ! command -v nvcc >/dev/null; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; else
    echo "torch2_check: SKIP: no nvcc (the CUDA toolkit) on this machine"; exit 0; fi
fi
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch; assert torch.__version__.startswith('$version')" 2>/dev/null; then
  step "installing torch $version from PyPI into $venv (once; about 5 GB)"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  if ! { python3 -m venv "$venv" && "$venv/bin/pip" install -q "torch==$version.*" numpy; } > "$venv.log" 2>&1; then
    echo "torch2_check: SKIP: could not install torch $version from PyPI (see $venv.log)"
    exit 0
  fi
fi
py=$venv/bin/python
prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')
nccl_root=$("$py" -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
"$py" -c 'import torch; print("torch_check: torch", torch.__version__, "cuda", torch.version.cuda)'

step "configure $build"
extra=(-DHP_REQUIRE_NCCL=ON)
[ -n "$nccl_root" ] && extra+=(-DNCCL_ROOT="$nccl_root")
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" "${extra[@]}" \
  > "$build.configure.log" 2>&1 || { tail -30 "$build.configure.log"; echo "torch2_check: configure FAILED"; exit 1; }
grep -E "NCCL:|warning" "$build.configure.log" | head -5

# The fast tier by default: what libtorch 2.x could change. Every libtorch op the project
# makes runs in the unit tests and the 1-rank entries of the distributed tests (each layer,
# each model, the trainer, the checkpoints); at 2 ranks fully_shard (its collectives on 2.x
# tensors) and the trainer end to end; the Llama model against transformers
# (hf_interop_test), the safetensors interchange and the data preparation. Left to the main
# suite (scripts/test.sh), which runs them against libtorch 1.13:
#   - the other 2-, 3-, 4- and 8-rank entries and the timing assertions: the same ops under
#     more ranks and the communicator, whose MPI byte moves no libtorch version changes;
#   - the trainer's 1-rank entry (train_test.np1): its 2-rank entry runs here, and each of
#     its cases trains the single-process reference beside the layout, so every op of the
#     1-rank run is in it (kept to hold .ci/run under 40 minutes);
#   - the tests against transformers 5 (hf_deepseek, hf_llama_rope, hf_llama_variants): they
#     run there on this same virtual environment's PyTorch 2.11 and transformers, against the
#     models whose every op the 1-rank entries here run on libtorch 2.11;
#   - hp-train's command line, the seed configs and the Llama example (arguments, files and
#     tokenizers; their training is the trainer's, run here);
#   - the tests of processes and files rather than tensors (injected faults, the launcher,
#     kills and restarts, the run folders' locks, the installed CMake package).
# All of them here: scripts/torch2_check.sh -LE gpu
build_all=0
default_tier=0
if [ "${1:-}" = --build-all ]; then
  build_all=1
  shift
elif [ $# -eq 0 ]; then
  default_tier=1
  set -- -LE 'gpu|dist_timing|fuzz' \
    -E '\.np[348]|^train_test\.np1$|^comm_test\.np2$|^fault_matrix_test$|^launcher_fault_test$|^launcher_test$|^hostile_inputs_test$|^two_nodes_test$|^restart_test$|^ckpt_kill_test$|^run_folders_test$|^cmake_package_test$|^hp_train_cli_test$|^hp_train_seed_config_test$|^llama_example_test$|^hf_deepseek_test$|^hf_llama_rope_test$|^hf_llama_variants_test$|^(comm_failure|deepseek_fsdp|deepseek_tp|deferred_init|fully_shard_composable|fully_shard_controls|fully_shard_errors|fully_shard_overlap|llama_fsdp|llama_tp|mesh|pp|tp|tp_checkpoint|simulated_network|ckpt|cp|ep|muon_dist|muon_trainer)_test\.np2(_overlap_off)?$|^train_test\.np2_overlap_off$'
fi
targets=()
if [ "$default_tier" -eq 1 ]; then
  # The programs the tier's entries run: every path into the build folder in their commands
  # and, for an entry whose program is not built yet (ctest then gives no command), the
  # target its name starts with (core_test, train_test.np2), which must be one.
  listing=$(realpath -m "$build.targets.txt")
  cmake --build "$build" --target help > "$listing"
  mapfile -t targets < <(cd "$build" && ctest --show-only=json-v1 "$@" | "$py" -c '
import json, os, sys
root = os.getcwd() + "/"
known = {line.split(":")[0] for line in open(sys.argv[1])}
names = {"hp", "hp-train", "nccl_test", "gpu_bench"}
for t in json.load(sys.stdin)["tests"]:
    if "command" not in t:
        name = t["name"].split(".")[0]
        if name not in known:
            sys.exit("torch2_check: the entry " + t["name"] + " names no program and no target " + name)
        names.add(name)
    for a in t.get("command", []):
        if a.startswith(root) and not a.endswith((".sh", ".py")):
            names.add(os.path.basename(a))
print("\n".join(sorted(names)))' "$listing")
  [ "${#targets[@]}" -gt 4 ] || { echo "torch2_check: could not list the fast tier's programs"; exit 1; }
  step "build (the ${#targets[@]} targets the fast tier runs, the CUDA path included)"
  targets=(--target "${targets[@]}")
else
  step "build (everything, the CUDA path included)"
fi
cmake --build "$build" -j "${HP_BUILD_JOBS:-2}" "${targets[@]}" > "$build.build.log" 2>&1 ||
  { grep -E "error|FAILED" "$build.build.log" | head -30; echo "torch2_check: build FAILED (see $build.build.log)"; exit 1; }
for t in hp hp-train nccl_test gpu_bench; do
  [ -n "$(find "$build" -name "lib$t.a" -o -name "$t" -type f | head -1)" ] ||
    { echo "torch2_check: $t was not built"; exit 1; }
done

[ "$build_all" -eq 1 ] && { echo "torch2_check: every target built"; exit 0; }

step "CPU tests against libtorch $version"
cd "$build"
ctest --output-on-failure -j2 "$@"
