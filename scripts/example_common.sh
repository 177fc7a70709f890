# shellcheck shell=bash
# The steps scripts/llama_example.sh and scripts/moe_example.sh share (sourced by them, not
# run): the arguments, hp-train, and the run itself.
#   example_init NAME "$@"   sets here, out (--out DIR, default hp-train-out/NAME; must not
#                            exist), HP_TRAIN (building build/hp-train unless given) and
#                            example_args (the hp-train options left)
#   example_run FAMILY CONFIG PYTHON
#                            1. tokenizer and random model (tools/hf_example.py model),
#                            2. the corpus (tools/prepare_data.py), 3. hp-train on 4 ranks
#                            with CONFIG, 4. export and tools/hf_example.py check

example_init() {
  example_name=$1
  shift
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  out=hp-train-out/$example_name
  if [ "${1:-}" = --out ]; then
    out=${2:?--out needs a folder}
    shift 2
  fi
  if [ -e "$out" ]; then
    echo "$example_name.sh: '$out' exists; nothing is overwritten: remove it or give --out another folder" >&2
    exit 1
  fi
  example_args=("$@")
  if [ -z "${HP_TRAIN:-}" ]; then
    bash "$here/scripts/build.sh" hp-train
    HP_TRAIN=$here/build/hp-train
  fi
}

example_run() {
  local family=$1 config=$2 vpy=$3
  mkdir -p "$out"
  local corpus=("$here/docs" "$here/include" "$here/src" "$here/apps" "$here/README.md")
  echo "== 1. tokenizer and model"
  "$vpy" "$here/tools/hf_example.py" --name "$example_name" model --family "$family" --out "$out/model" "${corpus[@]}"
  echo "== 2. corpus"
  "$vpy" "$here/tools/prepare_data.py" --tokenizer "$out/model" --out "$out/data/corpus" --valid-fraction 0.1 \
    "${corpus[@]}"
  echo "== 3. training"
  local paths=(--set "model.from_hf=$out/model" --set "data.path=$out/data/corpus.train.bin"
               --set "data.valid_path=$out/data/corpus.valid.bin" --set "output_dir=$out/run"
               --set "save_dir=$out/checkpoints")
  bash "$here/scripts/mpirun.sh" 4 "$HP_TRAIN" --config "$config" "${paths[@]}" ${example_args[@]+"${example_args[@]}"}
  echo "== 4. export, and transformers"
  "$HP_TRAIN" --export-hf "$out/checkpoints" "$out/export"  # the checkpoint its latest names
  local f
  for f in tokenizer.json tokenizer_config.json special_tokens_map.json; do  # transformers 5 writes no map
    [ ! -e "$out/model/$f" ] || cp "$out/model/$f" "$out/export/"
  done
  local sets=() arg
  for arg in ${example_args[@]+"${example_args[@]}"}; do
    case $arg in
      seq_length=* | global_batch_size=* | eval_steps=*) sets+=(--set "$arg") ;;
    esac
  done
  "$vpy" "$here/tools/hf_example.py" --name "$example_name" check --run "$out/run" --export "$out/export" \
    --valid "$out/data/corpus.valid.bin" --config "$config" ${sets[@]+"${sets[@]}"}
  echo "$example_name.sh: done; the trained model, with its tokenizer, is in $out/export"
}
