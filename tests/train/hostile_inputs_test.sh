#!/usr/bin/env bash
# hp-train against what a hostile round on the run's inputs found (issue 48): FIFOs where
# files are read (they blocked forever in open()), JSON and YAML nested 200,000 deep (a
# segfault printing the value), a model that collapses without a word, and weights that
# overflow after a step whose loss was still finite (committed as 'latest' before the NaN
# stop). Each case exits with hp-train's status for it (include/hp/train/exit_status.h) and
# an error naming the file or the step, within a time limit.
# Usage: hostile_inputs_test.sh <hp-train> <source dir> [mpirun]
set -uo pipefail
bin=$1 src=$2 mpirun=${3:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
cfg=$src/configs/llama_tiny.yaml
base=(--config "$cfg" --set lr_warmup_steps=0)
expect() {  # expect STATUS "text" hp-train-args...: exits STATUS (not blocked) naming "text"
  local want=$1 text=$2; shift 2
  timeout 60 "$bin" "$@" > "$work/out" 2>&1; local rc=$?
  [ $rc != 124 ] || fail "blocked (killed after 60 s): $*"
  [ $rc = "$want" ] || fail "exit $rc, not $want: $*: $(tail -3 "$work/out")"
  grep -q -- "$text" "$work/out" || fail "'$text' not said: $*: $(tail -3 "$work/out")"
}

# 1. FIFOs where a file is read: refused at once, named.
mkfifo "$work/fifo"
for type in binary text; do
  expect 78 "data.path '$work/fifo' is not a regular file" "${base[@]}" --set output_dir= --set data.type=$type \
    --set data.path="$work/fifo"
done
mkfifo "$work/mega.idx" && : > "$work/mega.bin"
expect 78 "mega.idx' is not a regular file" "${base[@]}" --set output_dir= --set data.type=megatron --set data.path="$work/mega"
rm "$work/mega.idx" "$work/mega.bin" && : > "$work/mega.idx" && mkfifo "$work/mega.bin"
expect 78 "mega.bin' is not a regular file" "${base[@]}" --set output_dir= --set data.type=megatron --set data.path="$work/mega"
# A Hugging Face folder (exported from a 1-step run, in 2 shards with an index), each of its
# files in turn a FIFO.
timeout 120 "$bin" "${base[@]}" --set train_steps=1 --set save_interval=1 --set output_dir="$work/run" \
  > "$work/out" 2>&1 || fail "the 1-step run failed: $(tail -3 "$work/out")"
timeout 120 "$bin" --export-hf "$work/run/checkpoints" "$work/hf" --max-shard-size 100K > "$work/out" 2>&1 ||
  fail "the export failed: $(tail -3 "$work/out")"
[ -e "$work/hf/model.safetensors.index.json" ] || fail "the export wrote no index: $(ls "$work/hf")"
shard=$(ls "$work/hf" | grep -m1 '^model-.*\.safetensors$')
for f in config.json model.safetensors.index.json "$shard"; do
  rm -rf "$work/hf2" && cp -r "$work/hf" "$work/hf2" && rm "$work/hf2/$f" && mkfifo "$work/hf2/$f"
  expect 78 "$f' is not a regular file" "${base[@]}" --set output_dir= --set model.from_hf="$work/hf2"
done
# What is wrong with a Hugging Face folder is the command's error, said once for all ranks
# (it was raised in every rank's trainer and printed by each, interleaved): here a tensor
# a shard holds that the index does not list.
if [ -n "$mpirun" ]; then
  rm -rf "$work/hf2" && cp -r "$work/hf" "$work/hf2"
  python3 -c "import json, sys; p = sys.argv[1]; j = json.load(open(p)); del j['weight_map']['model.norm.weight']
json.dump(j, open(p, 'w'))" "$work/hf2/model.safetensors.index.json"
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 "$mpirun" -np 2 --oversubscribe --bind-to none \
    "$bin" "${base[@]}" --set output_dir= --set model.from_hf="$work/hf2" > "$work/out" 2>&1; rc=$?
  [ $rc = 78 ] || fail "an index that lists less than its shards, 2 ranks: exit $rc: $(tail -3 "$work/out")"
  [ "$(grep -c "holds the tensor 'model.norm.weight', which model.safetensors.index.json does not list" "$work/out")" = 1 ] ||
    fail "not said once: $(grep -c error "$work/out") error lines: $(grep error "$work/out")"
fi

# 2. Nesting 200,000 deep: refused before any reader recurses.
deep() { python3 -c "import sys; n=200000; sys.stdout.write(sys.argv[1] + '['*n + ']'*n + sys.argv[2])" "$1" "$2"; }
rm -rf "$work/hf2" && cp -r "$work/hf" "$work/hf2"
deep '{"model_type": "llama", "hidden_act": "silu", "vocab_size": ' '}' > "$work/hf2/config.json"
expect 78 "config.json': nested deeper than 64 levels" "${base[@]}" --set output_dir= --set model.from_hf="$work/hf2"
deep 'train_steps: ' '' > "$work/deep.yaml"
expect 78 "deep.yaml: nested deeper than 64 levels" --config "$work/deep.yaml"
python3 -c "print(''.join(' ' * i + 'k%d:' % i + '\n' for i in range(3000)))" > "$work/deep_block.yaml"
expect 78 "deep_block.yaml: nested deeper than 64 levels" --config "$work/deep_block.yaml"
ck=$work/run/checkpoints/$(cat "$work/run/checkpoints/latest")
deep '{"format": ' '}' > "$ck/metadata.json"
expect 78 "metadata.json': nested deeper than 64 levels" "${base[@]}" --set output_dir="$work/run" --resume

# 3. A collapsed model (lr 1e3, no clipping: the loss sits at ln(vocab) with a gradient norm
# of exactly 0): a warning, once; under --strict the divergence status.
collapse=("${base[@]}" --set train_steps=12 --set lr=1e3 --set clip_grad=0 --set output_dir=)
timeout 120 "$bin" "${collapse[@]}" > "$work/out" 2>&1 || fail "the collapsing run failed: $(tail -3 "$work/out")"
[ "$(grep -c "^warning: step [0-9]*: the gradient norm is 0 at loss .*the model has collapsed" "$work/out")" = 1 ] ||
  fail "no single collapse warning: $(grep -E '^step|warning' "$work/out" | tail -5)"
expect 3 "the model has collapsed .*(--strict)" "${collapse[@]}" --strict

# 4. lr 1e6 without clipping: the model collapses (a warning), then the norm is NaN: the
# divergence status, which the launcher does not relaunch (it relaunched from the same
# checkpoint until its restarts ran out), with a hint naming the lr and clip_grad. (Weights
# that are not finite after a finite step are never saved: train_test
# TrainDist.NonFiniteWeightsAreNeverSaved.)
timeout 120 "$bin" "${base[@]}" --set train_steps=12 --set lr=1e6 --set clip_grad=0 --set save_interval=1 \
  --set output_dir="$work/nan" > "$work/out" 2>&1; rc=$?
[ $rc = 3 ] || fail "lr 1e6: exit $rc, not 3: $(tail -3 "$work/out")"
grep -q "training diverged (try a lower lr than 1e+06, or clip_grad > 0)" "$work/out" ||
  fail "lr 1e6: no divergence with its hint: $(tail -3 "$work/out")"
# With clipping on, the message does not suggest turning it on.
timeout 120 "$bin" "${base[@]}" --set train_steps=12 --set lr=1e30 --set output_dir= > "$work/out" 2>&1
grep -q "training diverged (try a lower lr than 1e+30; clip_grad is 1)" "$work/out" ||
  fail "clip_grad=1: $(grep -m1 diverged "$work/out")"

# 5. A resume under other settings: a change of the run's course is refused (78, before any
# state loads) naming each change and the flag that allows it; allowed, it is said; a change
# of layout passes, said. A new experiment sent into a finished run's folder with
# --auto-resume (as launch.sh does) is refused, not "nothing to train". An MoE's capacity is
# such a setting, not a model change.
run=("${base[@]}" --set train_steps=4 --set save_interval=2 --set output_dir="$work/r5")
timeout 120 "$bin" "${run[@]}" > "$work/out" 2>&1 || fail "the run to resume failed: $(tail -3 "$work/out")"
expect 78 "seed=1234 in the checkpoint but seed=7 now" "${run[@]}" --set seed=7 --resume "$work/r5/checkpoints/step_00000002"
grep -q -- "--resume-changes seed;" "$work/out" || fail "the way on not named: $(tail -2 "$work/out")"
grep -q "^step " "$work/out" && fail "a refused resume trained"
expect 78 "global_batch_size=16 in the checkpoint but global_batch_size=32 now" "${run[@]}" --set global_batch_size=32 \
  --set lr=0.01 --auto-resume
grep -q "lr=0.003 in the checkpoint but lr=0.01 now" "$work/out" || fail "not every change named: $(tail -2 "$work/out")"
expect 0 "resume: changed (--resume-changes): seed 1234 -> 7" "${run[@]}" --set seed=7 --set micro_batch_num=2 \
  --resume "$work/r5/checkpoints/step_00000002" --resume-changes seed
grep -q "resume: changed (layout, timing or output): micro_batch_num 1 -> 2" "$work/out" || fail "$(grep resume "$work/out")"
expect 78 "--resume-changes: 'bogus' is not a config key" "${run[@]}" --auto-resume --resume-changes bogus
expect 2 "--resume-changes goes with --resume" "${run[@]}" --resume-changes seed
ds=(--config "$src/configs/deepseek_tiny.yaml" --set data_parallel=1 --set lr_warmup_steps=0 --set save_interval=2
    --set output_dir="$work/r6")
timeout 120 "$bin" "${ds[@]}" --set train_steps=2 > "$work/out" 2>&1 || fail "the deepseek run failed: $(tail -3 "$work/out")"
expect 78 "model.capacity_factor=0 in the checkpoint but model.capacity_factor=1.5 now" "${ds[@]}" \
  --set model.capacity_factor=1.5 --set train_steps=3 --resume --resume-changes train_steps
expect 0 "model.capacity_factor 0 -> 1.5" "${ds[@]}" --set model.capacity_factor=1.5 --set train_steps=3 --resume \
  --resume-changes train_steps,model.capacity_factor

# 6. A format-1 checkpoint (written before checksums): its resume says it is read unchecked
# and how to change that (it said nothing); --upgrade-checkpoint rewrites it as format 2,
# after which a damaged data byte is found on load.
run=("${base[@]}" --set train_steps=4 --set save_interval=2 --set output_dir="$work/r7")
timeout 120 "$bin" "${run[@]}" > "$work/out" 2>&1 || fail "the run to downgrade failed: $(tail -3 "$work/out")"
ck2=$work/r7/checkpoints/step_00000002
python3 -c "import json, sys; p = sys.argv[1]; j = json.load(open(p)); j['format'] = 'hyperparallel-checkpoint-1'
del j['checksum']; del j['files']; json.dump(j, open(p, 'w'))" "$ck2/metadata.json"
expect 0 "is a format-1 checkpoint (written before checksums): its files are read unchecked" "${run[@]}" --resume "$ck2"
expect 0 "upgraded '$ck2' to format 2: 1 data file(s) checksummed" --upgrade-checkpoint "$ck2"
grep -q '"checksum"' "$ck2/metadata.json" || fail "no checksum after the upgrade"
expect 0 "format 2 already" --upgrade-checkpoint "$ck2"
expect 0 "resumed from $ck2 after step 2" "${run[@]}" --resume "$ck2"
grep -q "format-1" "$work/out" && fail "an upgraded checkpoint still said format 1"
python3 -c "import sys; p = sys.argv[1]; b = bytearray(open(p, 'rb').read()); b[-1] ^= 1; open(p, 'wb').write(b)" \
  "$ck2/rank0.safetensors"
expect 1 "rank0.safetensors" "${run[@]}" --resume "$ck2"
grep -q "damaged\|checksum" "$work/out" || fail "the flipped byte was not found: $(tail -2 "$work/out")"
echo "hostile_inputs_test: all checks passed"
