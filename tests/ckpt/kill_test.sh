#!/usr/bin/env bash
# kill -9 during a save: hp-train's training on 2 ranks saves after every step; at its third
# save one rank (or every rank) kills itself with SIGKILL at a point of the save
# (hp::ckpt::SavePoint, through the test's storage: kill_train.cpp): before writing its data,
# after writing it, before the commit renames, between them, after the commit but before the
# latest pointer. The job must end (no hang), 'latest' must
# still name the second step's checkpoint, and --resume from it must train steps 3 and 4 with
# bitwise the losses of a run that was never killed.
# Usage: kill_test.sh <hp-train> <kill_train> <source dir> <mpirun>
set -uo pipefail
bin=$1 killer=$2 src=$3 mpirun=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
cfg=$src/configs/deepseek_tiny.yaml
common=(--config "$cfg" --set data_parallel=1 --set train_steps=4 --set lr_warmup_steps=2 --set log_interval=1
        --set output_dir=)
run2() { "$mpirun" -np 2 --oversubscribe --bind-to none "$bin" "$@"; }
loss_of() { sed -n "s/^step $1\/4 | loss \([0-9.]*\) .*/\1/p" "$2"; }

run2 "${common[@]}" > "$work/straight" 2>&1 || fail "the run without a kill failed: $(cat "$work/straight")"
for crash in write:1 written written:0 commit:0 swap:0 latest:0; do
  ck=$work/ck_${crash/:/_}
  point=${crash%%:*} rank=all
  [ "$point" = "$crash" ] || rank=${crash#*:}
  timeout 300 "$mpirun" -np 2 --oversubscribe --bind-to none \
    "$killer" "$point" "$rank" 3 "${common[@]}" --set save_interval=1 --set save_dir="$ck" \
    > "$work/killed" 2>&1
  rc=$?
  [ $rc != 124 ] || fail "$crash: the killed job hung"
  [ $rc != 0 ] || fail "$crash: the job was not killed: $(cat "$work/killed")"
  [ "$(cat "$ck/latest")" = step_00000002 ] || fail "$crash: latest names '$(cat "$ck/latest")', not step_00000002"
  [ -e "$ck/step_00000002/metadata.json" ] || fail "$crash: step 2's checkpoint is not committed"
  if [ "$crash" != latest:0 ]; then
    [ ! -e "$ck/step_00000003" ] || fail "$crash: step 3's checkpoint appeared though its save was killed"
  fi
  run2 "${common[@]}" --set save_dir="$ck" --resume > "$work/resumed" 2>&1 ||
    fail "$crash: --resume failed: $(cat "$work/resumed")"
  grep -q "^resumed from $ck/step_00000002 after step 2" "$work/resumed" || fail "$crash: $(cat "$work/resumed")"
  for k in 3 4; do
    a=$(loss_of $k "$work/straight") b=$(loss_of $k "$work/resumed")
    [ -n "$a" ] && [ "$a" = "$b" ] || fail "$crash: step $k: loss '$a' without a kill, '$b' resumed"
  done
  echo "$crash: killed (exit $rc), resumed from step 2, steps 3-4 equal"
done
echo PASS
