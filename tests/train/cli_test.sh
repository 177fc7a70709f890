#!/usr/bin/env bash
# hp-train as a user runs it: key listing, config errors (exit status, the key named, one
# message for all ranks), a 2-rank run with --verify and its output files, text data.
# Usage: cli_test.sh <hp-train> <source dir> [mpirun]
set -uo pipefail
bin=$1 src=$2 mpirun=${3:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
run_np() {  # run_np N args...: under mpirun when there is one, else N must be 1
  local n=$1; shift
  if [ -n "$mpirun" ]; then
    "$mpirun" -np "$n" --oversubscribe --bind-to none "$bin" "$@"
  else
    [ "$n" = 1 ] || { echo "SKIP: no mpirun for $n ranks"; return 0; }
    "$bin" "$@"
  fi
}

"$bin" --list-keys > "$work/keys" || fail "--list-keys exited $?"
grep -q '^params_dtype ' "$work/keys" || fail "--list-keys lacks params_dtype"
grep -q '^model.kv_lora_rank ' "$work/keys" || fail "--list-keys lacks model.kv_lora_rank"
grep -q '^model.drop_policy  *probs|position ' "$work/keys" || fail "--list-keys: model.drop_policy's choices: $(grep drop_policy "$work/keys")"
"$bin" --config "$src/configs/deepseek_tiny.yaml" --set model.drop_policy=random --estimate > "$work/out" 2>&1 &&
  fail "drop_policy=random was accepted"
grep -q "model.drop_policy=random: expected one of: probs, position" "$work/out" || fail "drop_policy error: $(cat "$work/out")"

"$bin" --bogus > "$work/out" 2>&1 && fail "an unknown argument was accepted"
grep -q "unknown argument '--bogus'" "$work/out" || fail "unknown argument not named: $(cat "$work/out")"

cfg=$src/configs/deepseek_tiny.yaml
"$bin" --config "$cfg" --set nope=1 > "$work/out" 2>&1
[ $? = 78 ] || fail "an unknown key did not exit 78 (a config error)"
grep -q "unknown config key 'nope'" "$work/out" || fail "unknown key not named: $(cat "$work/out")"

# device: cuda where this build or machine has no GPU: one clear error, exit 1.
if [ -z "$(command -v nvidia-smi)" ]; then
  run_np 2 --config "$cfg" --set device=cuda > "$work/out" 2>&1 && fail "device=cuda without a GPU was accepted"
  [ "$(grep -c 'device=cuda' "$work/out")" = 1 ] || fail "expected one message naming device=cuda: $(cat "$work/out")"
fi

if [ -n "$mpirun" ]; then
  run_np 2 --config "$cfg" --set tensor_parallel=2 --set model.heads=3 > "$work/out" 2>&1 &&
    fail "deepseek heads=3 under tensor_parallel=2 was accepted"
  [ "$(grep -c 'tensor_parallel=2: heads=3 is not divisible by it' "$work/out")" = 1 ] ||
    fail "expected one message naming heads=3: $(cat "$work/out")"
  # Llama under tensor_parallel 2 with sequence parallel, against one process.
  run_np 2 --config "$src/configs/llama_tiny.yaml" --verify --set tensor_parallel=2 --set sequence_parallel=true \
    --set params_dtype=float32 --set compute_dtype=float32 --set train_steps=3 --set lr_warmup_steps=1 \
    --set output_dir= > "$work/out" 2>&1 || fail "tensor-parallel run failed: $(cat "$work/out")"
  grep -q "x data_parallel_shard 1 x tensor_parallel 2 (FSDP + TP, sequence_parallel on, loss parallel)" "$work/out" ||
    fail "the layout line does not show tensor_parallel: $(cat "$work/out")"
  diff=$(sed -n 's/^verify: largest |loss - single-process loss| over 3 steps: \([0-9.e+-]*\) .*/\1/p' "$work/out")
  [ -n "$diff" ] || fail "no verify line: $(cat "$work/out")"
  python3 -c "import sys; sys.exit(0 if float('$diff') < 1e-5 else 1)" || fail "tensor-parallel verify difference $diff >= 1e-5"
  run_np 2 --config "$src/configs/llama_tiny.yaml" --set tensor_parallel=2 --set model.kv_heads=1 \
    > "$work/out" 2>&1 && fail "kv_heads=1 under tensor_parallel=2 was accepted"
  grep -q "kv_heads=1 is not divisible" "$work/out" || fail "indivisible kv_heads not named: $(cat "$work/out")"
fi

"$bin" --config "$src/configs" > "$work/out" 2>&1 && fail "a directory was accepted as --config"
grep -q "is not a regular file" "$work/out" || fail "directory config not named: $(cat "$work/out")"
"$bin" --config "$cfg" --estimate --verify > "$work/out" 2>&1 && fail "--estimate --verify was accepted"

# Divergence stops the run with an error naming the step (every rank agrees; one message).
n=2; [ -n "$mpirun" ] || n=1
run_np $n --config "$cfg" --set data_parallel=1 --set lr=1e30 --set clip_grad=0 --set train_steps=20 \
  --set lr_warmup_steps=0 --set output_dir= > "$work/out" 2>&1 && fail "a diverging run exited 0"
[ "$(grep -c 'training diverged' "$work/out")" = 1 ] || fail "expected one divergence message: $(cat "$work/out")"

# A bad data file is reported before training, once.
run_np $n --config "$src/configs/llama_tiny.yaml" --set data.type=binary --set data.path=/tmp --set output_dir= \
  > "$work/out" 2>&1 && fail "a directory was accepted as data.path"
[ "$(grep -c "data.path '/tmp' is not a regular file" "$work/out")" = 1 ] || fail "data.path error: $(cat "$work/out")"
grep -q '^step ' "$work/out" && fail "training started despite a bad data file"

# The published DeepSeek-V3 size: estimated without allocating, refused for training here.
printf 'model:\n  preset: deepseek_v3\n  max_seq: 4096\nparams_dtype: bfloat16\naccumulate_allreduce_grads_in_fp32: true\ndata_parallel: 8\nglobal_batch_size: 1024\n' > "$work/v3.yaml"
"$bin" --config "$work/v3.yaml" --estimate --world 1024 > "$work/out" 2>&1 || fail "--estimate failed: $(cat "$work/out")"
grep -q 'parameters: 671026404352' "$work/out" || fail "--estimate: wrong parameter count: $(cat "$work/out")"
grep -q 'data_parallel 8 x data_parallel_shard 128' "$work/out" || fail "--estimate: layout not resolved"
# The same with tensor_parallel 8 and sequence parallel: the per-rank share before sharding.
"$bin" --config "$work/v3.yaml" --estimate --world 1024 --set tensor_parallel=8 --set sequence_parallel=true \
  > "$work/out" 2>&1 || fail "--estimate with tensor_parallel failed: $(cat "$work/out")"
grep -q 'data_parallel 8 x data_parallel_shard 16 x tensor_parallel 8' "$work/out" || fail "--estimate: tp layout not resolved: $(cat "$work/out")"
grep -q 'per tensor-parallel rank, before fully_shard: ' "$work/out" || fail "--estimate: no per-tp-rank count"
# Expert parallelism in the estimate: a rank's share of the routed experts, and the rest.
"$bin" --config "$src/configs/deepseek_v3_plan.yaml" --estimate --world 2048 --set expert_parallel=64 \
  > "$work/out" 2>&1 || fail "--estimate with expert_parallel failed: $(cat "$work/out")"
grep -q 'expert parallel 64: a rank holds 704643072 routed-expert parameters' "$work/out" ||
  fail "--estimate: no expert-parallel share: $(cat "$work/out")"
# The report's layout on 2048 GPUs of 80 GB with an H800-like link is feasible (ranked, with
# a step time); pure fully_shard must gather a whole MoE layer and does not fit.
plan_v3=("$bin" --config "$src/configs/deepseek_v3_plan.yaml" --plan --world 2048 --link 2:160,5:50:8
  --device-tflops 989 --memory-per-rank 80e9)
"${plan_v3[@]}" > "$work/out" 2>&1 || fail "--plan of DeepSeek-V3 failed: $(cat "$work/out")"
for l in 'dp_replicate=1 dp_shard=128 ep=64 tp=1 pp=16' 'dp_replicate=2 dp_shard=64 ep=64 tp=1 pp=16'; do
  grep -Eq "^[0-9]+ +$l \(1f1b\) " "$work/out" || fail "--plan: $l not feasible: $(cat "$work/out")"
done
"${plan_v3[@]}" --set micro_batch_num=8 > "$work/out" 2>&1 || fail "--plan of DeepSeek-V3 failed: $(cat "$work/out")"
grep -q 'dp_replicate=1 dp_shard=2048 ep=1 tp=1 pp=1: needs .* per rank without activations' "$work/out" ||
  fail "--plan: pure fully_shard of DeepSeek-V3 not refused for memory: $(cat "$work/out")"
# The Qwen3-MoE and Mixtral presets on 64 GPUs of 80 GB (BENCHMARKS.md): each plans with a
# feasible expert-parallel layout first (Qwen3-235B-A22B only with full recompute).
for case in "8|" "64|--set model.preset=qwen3_235b_a22b --set recompute=full" \
            "8|--set model.type=mixtral --set model.preset=mixtral_8x7b"; do
  ep=${case%%|*} s=${case#*|}
  # shellcheck disable=SC2086
  "$bin" --config "$src/configs/moe_llama_plan.yaml" $s --plan --world 64 --link 2:160,5:50:8 --device-tflops 989 \
    --memory-per-rank 80e9 > "$work/out" 2>&1 || fail "--plan of moe_llama_plan.yaml $s failed: $(cat "$work/out")"
  grep -Eq "^1 +dp_replicate=1 dp_shard=64 ep=$ep tp=1 pp=1 " "$work/out" ||
    fail "--plan of moe_llama_plan.yaml $s: not dp_shard 64 x ep $ep first: $(head -5 "$work/out")"
done
"$bin" --config "$work/v3.yaml" --set data_parallel=1 --set global_batch_size=8 > "$work/out" 2>&1 &&
  fail "a 671B model was not refused"
grep -q 'needs about .* per rank' "$work/out" || fail "no memory error: $(cat "$work/out")"

# 2 ranks (FSDP), fp32, --verify, validation after steps 3 and 6: losses and validation
# losses match one process to rounding.
out=$work/run
n=2; [ -n "$mpirun" ] || n=1
run_np $n --config "$cfg" --verify --set data_parallel=1 --set train_steps=6 --set lr_warmup_steps=2 \
  --set params_dtype=float32 --set compute_dtype=float32 --set output_dir="$out" \
  --set eval_interval=3 --set eval_steps=2 > "$work/out" 2>&1 ||
  fail "training run failed: $(cat "$work/out")"
grep -q '^step 6/6 | loss .* | valid [0-9.]* ' "$work/out" || fail "no progress line with the validation loss for step 6: $(cat "$work/out")"
grep -q '^done: 6 steps' "$work/out" || fail "no summary"
grep -q 'validation every 3 steps on 2 batches of held-out synthetic samples' "$work/out" || fail "no validation in the startup lines"
for s in 3 6; do
  grep -q "^validation after step $s/6 | loss [0-9.]* | ppl [0-9.]* | 2.0k tokens" "$work/out" ||
    fail "no validation line after step $s: $(cat "$work/out")"
done
diff=$(sed -n 's/^verify: largest |loss - single-process loss| over 6 steps: \([0-9.e+-]*\) .*/\1/p' "$work/out")
[ -n "$diff" ] || fail "no verify line: $(cat "$work/out")"
python3 -c "import sys; sys.exit(0 if float('$diff') < 1e-5 else 1)" || fail "verify difference $diff >= 1e-5"
diff=$(sed -n 's/^verify: largest |validation loss - single-process validation loss| over 2 evaluations: \([0-9.e+-]*\) .*/\1/p' "$work/out")
[ -n "$diff" ] || fail "no validation verify line: $(cat "$work/out")"
python3 -c "import sys; sys.exit(0 if float('$diff') < 1e-5 else 1)" || fail "validation verify difference $diff >= 1e-5"
[ "$(grep -c '^{"step":' "$out/metrics.jsonl")" = 6 ] || fail "metrics.jsonl should have 6 step lines"
[ "$(grep -c '^{"eval":{"step":[36],"loss":' "$out/metrics.jsonl")" = 2 ] || fail "metrics.jsonl should have 2 eval lines"
grep -q '>validation<' "$out/loss.svg" || fail "loss.svg does not draw the validation loss"
grep -q '"summary":{"steps":6' "$out/metrics.jsonl" || fail "metrics.jsonl has no summary"
# The experts' load of each MoE block (layers 1 and 2): every token of the global batch
# picks 2 of 8 experts, so 16 x 64 x 2 / 8 = 256 tokens per expert on average.
grep -q '^step 6/6 | .* | experts max/mean [0-9.]*' "$work/out" || fail "no expert load in the progress line: $(cat "$work/out")"
python3 - "$out/metrics.jsonl" <<'PY' || fail "metrics.jsonl: wrong expert load: $(cat "$out/metrics.jsonl")"
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"step"')]
assert len(steps) == 6
for s in steps:
    load = s["expert_load"]
    assert [e["layer"] for e in load] == [1, 2], load
    for e in load:
        assert e["tokens_mean"] == 256 and 256 <= e["tokens_max"] <= 16 * 64, e
PY
grep -q '<polyline' "$out/loss.svg" || fail "loss.svg has no curve"
[ ! -e "$out/metrics.jsonl.partial" ] && [ ! -e "$out/loss.svg.partial" ] || fail "temporary files left behind"

# A full disk while writing the metrics or the curve (the temporary file is /dev/full):
# exit 1 naming the file and the OS error; no file appears under the final name.
for f in metrics.jsonl loss.svg; do
  full=$work/full_$f
  mkdir -p "$full" && ln -sf /dev/full "$full/$f.partial"
  "$bin" --config "$cfg" --set data_parallel=1 --set train_steps=2 --set lr_warmup_steps=1 \
    --set output_dir="$full" > "$work/out" 2>&1
  rc=$?
  [ $rc = 1 ] || fail "disk full on $f: exit $rc: $(cat "$work/out")"
  grep -q "$f.partial.*No space left on device" "$work/out" || fail "disk full on $f not named: $(cat "$work/out")"
  [ ! -e "$full/$f" ] || fail "a half-written $f appeared under its final name"
done

# The same with the parameters resharded to groups of 2 after forward (all of
# data_parallel_shard here) and gathered within the group for backward.
run_np $n --config "$cfg" --verify --set data_parallel=1 --set train_steps=3 --set lr_warmup_steps=1 \
  --set params_dtype=float32 --set compute_dtype=float32 --set output_dir= \
  --set reshard_after_forward_group_size=$n > "$work/out" 2>&1 || fail "grouped run failed: $(cat "$work/out")"
grep -q "resharded to groups of $n after forward" "$work/out" || fail "the layout line does not name the group"
diff=$(sed -n 's/^verify: largest |loss - single-process loss| over 3 steps: \([0-9.e+-]*\) .*/\1/p' "$work/out")
[ -n "$diff" ] || fail "no verify line: $(cat "$work/out")"
python3 -c "import sys; sys.exit(0 if float('$diff') < 1e-5 else 1)" || fail "grouped verify difference $diff >= 1e-5"

# Text data through the byte tokenizer, one process; the config's validation (every 10
# steps) needs a file of the same type, refused at start without one.
python3 -c "print('the quick brown fox jumps over the lazy dog. ' * 200)" > "$work/corpus.txt"
"$bin" --config "$cfg" --set data.type=text --set data.path="$work/corpus.txt" --set data_parallel=1 \
  --set train_steps=3 --set lr_warmup_steps=1 --set output_dir= > "$work/out" 2>&1 && fail "text data without data.valid_path was accepted"
grep -q 'eval_interval=10 needs data.valid_path' "$work/out" || fail "missing validation set not named: $(cat "$work/out")"
"$bin" --config "$cfg" --set data.type=text --set data.path="$work/corpus.txt" --set data_parallel=1 \
  --set data.valid_path="$work/corpus.txt" --set train_steps=3 --set lr_warmup_steps=1 --set output_dir= \
  > "$work/out" 2>&1 || fail "text run failed: $(cat "$work/out")"
grep -q 'data: text file, 9001 tokens' "$work/out" || fail "text data not described: $(cat "$work/out")"
grep -q '^validation after step 3/3 | loss ' "$work/out" || fail "no validation on the text file: $(cat "$work/out")"
# Bad HP_* knobs: exit 1 with the knob and its range named, before anything runs.
expect_knob_error() {  # VAR=value "expected text"
  env "$1" "$bin" --config "$cfg" --set data_parallel=1 --set train_steps=1 --set lr_warmup_steps=0 --set output_dir= > "$work/out" 2>&1
  local rc=$?
  [ $rc = 1 ] || fail "$1: exit $rc: $(cat "$work/out")"
  grep -q "hp-train: error: .*$2" "$work/out" || fail "$1: not named: $(cat "$work/out")"
}
expect_knob_error HP_BACKEND=bogus "HP_BACKEND='bogus' is not one of auto|mpi|local|nccl"
expect_knob_error HP_COMM_TIMEOUT_S=inf "HP_COMM_TIMEOUT_S='inf' is not a finite number"
expect_knob_error HP_COMM_TIMEOUT_S=1e300 "HP_COMM_TIMEOUT_S='1e300' is out of range"
expect_knob_error HP_COMM_TIMEOUT_S=1e-9 "HP_COMM_TIMEOUT_S='1e-9' is out of range"
expect_knob_error HP_NUM_THREADS=99999999999999999999 "HP_NUM_THREADS='99999999999999999999' is out of range: it must be in \[0, 1024\]"
expect_knob_error HP_FSDP_OVERLAP=2 "HP_FSDP_OVERLAP='2' is not one of auto|0|1"
expect_knob_error HP_SIM_NET=5:0 "simulated network '5:0': bandwidth '0' is not a positive number"
expect_knob_error HP_SIM_NET=5:1e-300 "simulated network '5:1e-300': bandwidth '1e-300' GB/s is outside"
# --plan with figures no device or link has, or for devices without their memory: refused.
for bad in "--link 1e300:10" "--device-tflops 1e-300 --memory-per-rank 80GB" "--device-tflops 1e300 --memory-per-rank 80GB"; do
  # shellcheck disable=SC2086  # $bad is a list of words on purpose
  "$bin" --config "$cfg" --plan --world 4 $bad > "$work/out" 2>&1; rc=$?
  [ $rc != 0 ] || fail "--plan $bad was accepted: $(head -3 "$work/out")"
  grep -q "latency '1e300' us is beyond\|--device-tflops 1e-*300: expected the TFLOP/s of one device" "$work/out" ||
    fail "--plan $bad not named: $(cat "$work/out")"
done
"$bin" --config "$cfg" --plan --world 4 --device-tflops 900 > "$work/out" 2>&1 && fail "--device-tflops without --memory-per-rank was accepted"
grep -q -- "give --memory-per-rank too" "$work/out" || fail "--device-tflops without memory not explained: $(cat "$work/out")"
expect_knob_error HP_RS_SEGMENT_BYTES=12 "HP_RS_SEGMENT_BYTES='12' is out of range"
expect_knob_error HP_TRACE=/etc/hostname "HP_TRACE='/etc/hostname' is not a directory"
# The trace, written as the run ends, on a full disk: exit 1 naming the file, nothing under
# the trace's name (it was exit 0 with an empty file).
mkdir -p "$work/trace_full" && ln -sf /dev/full "$work/trace_full/trace_rank0.json.partial"
HP_TRACE="$work/trace_full" "$bin" --config "$cfg" --set data_parallel=1 --set train_steps=1 --set lr_warmup_steps=0 \
  --set output_dir= > "$work/out" 2>&1; rc=$?
[ $rc = 1 ] || fail "a trace on a full disk: exit $rc: $(cat "$work/out")"
grep -q "trace_rank0.json.partial' failed: No space left on device" "$work/out" || fail "the trace's full disk not named: $(cat "$work/out")"
[ ! -e "$work/trace_full/trace_rank0.json" ] && [ ! -e "$work/trace_full/trace_rank0.json.partial" ] ||
  fail "a trace file was left: $(ls -la "$work/trace_full")"
if [ -n "$mpirun" ]; then
  HP_BACKEND=local run_np 2 --config "$cfg" --set train_steps=1 --set lr_warmup_steps=0 --set output_dir= > "$work/out" 2>&1 &&
    fail "HP_BACKEND=local under mpirun was accepted"
  grep -q "processes but using the local backend" "$work/out" || fail "local under mpirun not named: $(cat "$work/out")"
fi
# Ranks started with different configs (mpirun's ':' form): named before training.
if [ -n "$mpirun" ]; then
  "$mpirun" --oversubscribe --bind-to none -np 1 "$bin" --config "$cfg" --set data_parallel=1 --set seed=1 \
    --set output_dir= : -np 1 "$bin" --config "$cfg" --set data_parallel=1 --set seed=2 --set output_dir= \
    > "$work/out" 2>&1 && fail "ranks with different seeds were accepted"
  [ "$(grep -c 'different configs: seed=2 on rank 1 but seed=1 on rank 0' "$work/out")" = 1 ] ||
    fail "config mismatch not named once: $(cat "$work/out")"
fi
# Checkpoints: 6 steps saving every 2 and keeping the newest 2; --resume from step 4's
# continues with the losses the run had for steps 5 and 6 (bitwise: the same printed digits).
ck=$work/ck
run_np $n --config "$cfg" --set data_parallel=1 --set train_steps=6 --set lr_warmup_steps=2 --set save_interval=2 \
  --set keep_last_n=2 --set log_interval=1 --set output_dir= --set save_dir="$ck" > "$work/straight" 2>&1 ||
  fail "run with save_interval failed: $(cat "$work/straight")"
grep -q "^saved $ck/step_00000004" "$work/straight" || fail "no saved line: $(cat "$work/straight")"
[ "$(cat "$ck/latest")" = step_00000006 ] || fail "latest does not name step_00000006: $(cat "$ck/latest")"
[ "$(ls "$ck" | grep '^step_' | tr '\n' ' ')" = "step_00000004 step_00000006 " ] || fail "keep_last_n=2 left: $(ls "$ck")"
run_np $n --config "$cfg" --set data_parallel=1 --set train_steps=6 --set lr_warmup_steps=2 --set log_interval=1 \
  --set output_dir= --set save_dir="$ck" --resume "$ck/step_00000004" > "$work/resumed" 2>&1 ||
  fail "--resume failed: $(cat "$work/resumed")"
grep -q "^resumed from $ck/step_00000004 after step 4" "$work/resumed" || fail "no resumed line: $(cat "$work/resumed")"
for k in 5 6; do
  a=$(sed -n "s/^step $k\/6 | loss \([0-9.]*\) .*/\1/p" "$work/straight")
  b=$(sed -n "s/^step $k\/6 | loss \([0-9.]*\) .*/\1/p" "$work/resumed")
  [ -n "$a" ] && [ "$a" = "$b" ] || fail "step $k: straight loss '$a', resumed '$b'"
done
grep -q "^step 4/6" "$work/resumed" && fail "the resumed run trained step 4 again"
run_np $n --config "$cfg" --set data_parallel=1 --set train_steps=6 --set lr_warmup_steps=2 --set output_dir= \
  --set save_dir="$ck" --resume > "$work/out" 2>&1 || fail "--resume at the end failed: $(cat "$work/out")"
grep -q "nothing to train" "$work/out" || fail "--resume from latest (step 6 of 6): $(cat "$work/out")"
# --elastic: step 4's checkpoint of 2 ranks resumed on 1, laid out anew: micro-batches of the
# same 4 samples (16 over 2 ranks in 2 micro-batches), 4 of them; without --elastic the
# config's own layout would take 8 samples a micro-batch. (two_nodes_test compares such a
# relaunch bit for bit with a resume by hand.)
if [ "$n" = 2 ]; then
  run_np 1 --config "$cfg" --set data_parallel=1 --set train_steps=6 --set lr_warmup_steps=2 --set log_interval=1 \
    --set output_dir= --set save_dir="$ck" --resume "$ck/step_00000004" --elastic > "$work/out" 2>&1 ||
    fail "--elastic onto 1 rank failed: $(cat "$work/out")"
  grep -q "^elastic: the checkpoint's run had 2 rank(s) (dp_replicate=1 dp_shard=2 ep=1 tp=1 pp=1, micro_batch_num=2); on 1 rank(s) now: dp_replicate=1 dp_shard=1 ep=1 tp=1 pp=1, micro_batch_num=4, keeping tensor_parallel=1 pipeline_parallel=1 and micro-batches of 4 sample(s)" "$work/out" &&
    grep -q "^batch: 16 samples x .* 4 micro-batch(es) of 4 per rank" "$work/out" && grep -q "^step 6/6" "$work/out" ||
    fail "--elastic onto 1 rank: $(cat "$work/out")"
fi
# The same saves in the background: announced, and 'latest' moved once each committed.
ca=$work/ck_async
run_np $n --config "$cfg" --set data_parallel=1 --set train_steps=6 --set lr_warmup_steps=2 --set save_interval=2 \
  --set async_save=true --set output_dir= --set save_dir="$ca" > "$work/async" 2>&1 ||
  fail "run with async_save failed: $(cat "$work/async")"
grep -q "^saving $ca/step_00000006 in the background" "$work/async" || fail "no background save line: $(cat "$work/async")"
[ "$(cat "$ca/latest")" = step_00000006 ] || fail "async: latest names '$(cat "$ca/latest")'"
for k in 2 4 6; do [ -e "$ca/step_0000000$k/metadata.json" ] || fail "async: step $k not committed"; done
# The reader written from docs/ckpt.md alone verifies what was written: metadata.json's own
# checksum, every file's block checksums, every chunk.
python3 "$src/tests/ckpt/hp_checkpoint.py" "$ca/step_00000006" > "$work/out" 2>&1 ||
  fail "hp_checkpoint.py cannot read step 6: $(cat "$work/out")"
# A metadata.json edited by hand (the steps made -3, which once spun the data sampler
# forever): the resume ends at once with the file named.
cb=$work/ck_edited
mkdir -p "$cb" && cp -r "$ca/step_00000006" "$cb/" && echo step_00000006 > "$cb/latest"
sed -i 's/"steps": "6"/"steps": "-3"/' "$cb/step_00000006/metadata.json"
grep -q '"steps": "-3"' "$cb/step_00000006/metadata.json" || fail "the edit of the steps did not apply"
timeout 120 "$bin" --config "$cfg" --set data_parallel=1 --set train_steps=6 --set save_dir="$cb" --resume > "$work/out" 2>&1 &&
  fail "a resume from an edited metadata.json was accepted"
grep -q "$cb/step_00000006/metadata.json' was altered or damaged" "$work/out" || fail "edited metadata.json not named: $(cat "$work/out")"
"$bin" --config "$cfg" --set data_parallel=1 --set save_dir="$work/none" --resume > "$work/out" 2>&1 &&
  fail "--resume without a checkpoint was accepted"
grep -q -- "--resume: no checkpoint in '$work/none'" "$work/out" || fail "missing checkpoint not named: $(cat "$work/out")"
# An export error, which every rank meets: printed once, worded for the export.
if [ -n "$mpirun" ]; then
  mkdir -p "$work/noexport" && echo x > "$work/noexport/latest"
  run_np 2 --export-hf "$work/noexport" "$work/exported" > "$work/out" 2>&1 && fail "an export of 'latest: x' was accepted"
  [ "$(grep -c -- "--export-hf: '$work/noexport/latest' names 'x'" "$work/out")" = 1 ] ||
    fail "the export error was not printed once: $(cat "$work/out")"
  [ ! -e "$work/exported" ] || fail "a failed export left its folder"
fi
printf '# nothing here\n' > "$work/empty.yaml"
"$bin" --config "$work/empty.yaml" > "$work/out" 2>&1; [ $? = 78 ] || fail "an empty config did not exit 78"
grep -q "holds no settings" "$work/out" || fail "empty config not named: $(cat "$work/out")"

echo "PASS"

# --plan: every layout of a world, ranked, the infeasible ones with their reason.
"$bin" --config "$src/configs/llama_tiny.yaml" --plan --world 4 > "$work/out" 2>&1 || fail "--plan failed: $(cat "$work/out")"
grep -q '^1 .*dp_replicate=' "$work/out" || fail "--plan: no ranked layout: $(cat "$work/out")"
grep -q 'tp=4 pp=1: tensor_parallel=4: kv_heads=2 is not divisible' "$work/out" || fail "--plan: no reason for tp=4: $(cat "$work/out")"
"$bin" --config "$src/configs/llama_tiny.yaml" --plan --world 4 --json --link 10:1 > "$work/out" 2>&1 ||
  fail "--plan --json failed: $(cat "$work/out")"
# 15 layouts (dp_replicate x dp_shard x cp x tp x pp = 4), all but tp 4 and pp 4 feasible.
[ "$(grep -c '"feasible":true' "$work/out")" = 13 ] && [ "$(grep -c '"feasible":false' "$work/out")" = 2 ] ||
  fail "--plan --json: expected 13 feasible and 2 infeasible layouts: $(cat "$work/out")"
grep -q '"cp":2,.*"cp_comm_s":[1-9]' "$work/out" || grep -q '"cp":2,.*"cp_comm_s":0\.[0-9]*[1-9]' "$work/out" ||
  fail "--plan --json: no cp=2 layout with its exchanges: $(cat "$work/out")"
python3 -c "import json,sys; [json.loads(l) for l in open(sys.argv[1])]" "$work/out" || fail "--plan --json is not JSON lines"
"$bin" --config "$src/configs/llama_tiny.yaml" --plan --link 5:zero > "$work/out" 2>&1 && fail "a bad --link was accepted"
grep -q "simulated network '5:zero'" "$work/out" || fail "bad --link not named: $(cat "$work/out")"
"$bin" --config "$src/configs/llama_tiny.yaml" --json > "$work/out" 2>&1 && fail "--json without --plan was accepted"
grep -q -- "--json only goes with --plan" "$work/out" || fail "--json without --plan not explained: $(cat "$work/out")"
"$bin" --config "$src/configs/llama_tiny.yaml" --link 5:400 > "$work/out" 2>&1 && fail "--link without --plan was accepted"
grep -q -- "--link, --device-tflops and --memory-per-rank only go with --plan or --elastic" "$work/out" ||
  fail "--link without --plan not explained: $(cat "$work/out")"
"$bin" --config "$src/configs/llama_tiny.yaml" --elastic > "$work/out" 2>&1 && fail "--elastic without a resume was accepted"
grep -q -- "--elastic goes with --resume or --auto-resume" "$work/out" || fail "--elastic alone not explained: $(cat "$work/out")"
# The published DeepSeek-V3 on 256 devices of 141 GB, 8 per node: planned in seconds, nothing allocated.
"$bin" --config "$work/v3.yaml" --plan --world 256 --device-tflops 989 --memory-per-rank 141GB --link 5:400,10:50:8 \
  > "$work/out" 2>&1 || fail "--plan of deepseek_v3 failed: $(cat "$work/out")"
grep -q 'one device, fully_shard overlap on; compute FLOPs at half of 989 TFLOP/s' "$work/out" || fail "--plan: device line: $(cat "$work/out")"
grep -q '^1 ' "$work/out" || fail "--plan: no feasible layout for deepseek_v3 on 256 devices: $(cat "$work/out")"
grep -q 'dp_shard=256 ep=1 tp=1 pp=1: needs .* per rank without activations; 131.3 GiB available' "$work/out" ||
  fail "--plan: memory reason missing: $(cat "$work/out")"

# OpenMP's idle threads sleep unless the user chose otherwise (hp::prefer_passive_openmp).
(unset OMP_WAIT_POLICY; "$bin" --config "$src/configs/llama_tiny.yaml" --set train_steps=1 --set lr_warmup_steps=0 --set output_dir= > "$work/out" 2>&1) ||
  fail "a one-step run failed: $(cat "$work/out")"
grep -q 'compute thread(s) per rank (OMP_WAIT_POLICY=passive)' "$work/out" || fail "OpenMP not made passive: $(cat "$work/out")"
OMP_WAIT_POLICY=active "$bin" --config "$src/configs/llama_tiny.yaml" --set train_steps=1 --set lr_warmup_steps=0 --set output_dir= > "$work/out" 2>&1 ||
  fail "a one-step run failed: $(cat "$work/out")"
grep -q '(OMP_WAIT_POLICY=active)' "$work/out" || fail "the user's OMP_WAIT_POLICY was not kept: $(cat "$work/out")"
