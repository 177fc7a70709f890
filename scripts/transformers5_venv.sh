#!/usr/bin/env bash
# Makes (once) a virtual environment with Hugging Face's transformers 5.25 and safetensors
# over PyTorch 2.x, which transformers 5 needs: the new environment sees the packages of the
# PyTorch 2.x one (TORCH2, the one scripts/torch2_check.sh installs) through a .pth file.
# Nothing is done where VENV already imports them.
# Usage: transformers5_venv.sh VENV TORCH2 LOG
# Exit status: 0 ready, 77 no PyTorch 2.x in TORCH2 or the packages could not be installed
# (the reason printed; LOG holds pip's output).
set -uo pipefail
venv=$1 torch2=$2 log=$3
if ! "$torch2/bin/python" -c 'import torch; assert int(torch.__version__.split(".")[0]) >= 2' 2>/dev/null; then
  echo "transformers5_venv.sh: no PyTorch 2.x in $torch2 (scripts/torch2_check.sh installs it)"
  exit 77
fi
if [ -x "$venv/bin/python" ] &&
   "$venv/bin/python" -c 'from transformers import DeepseekV3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM; import safetensors' 2>/dev/null; then
  exit 0
fi
if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
  echo "transformers5_venv.sh: '$venv' exists but is not a virtual environment"
  exit 77
fi
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
if "$torch2/bin/python" -m venv "$venv" > "$log" 2>&1 &&
   "$torch2/bin/python" -c 'import site; print(site.getsitepackages()[0])' \
     > "$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')/hp-torch2.pth" &&
   "$venv/bin/pip" install -q "transformers==5.25.0" safetensors >> "$log" 2>&1 &&
   "$venv/bin/python" -c 'from transformers import DeepseekV3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM' >> "$log" 2>&1; then
  echo "transformers5_venv.sh: made $venv"
  exit 0
fi
echo "transformers5_venv.sh: could not install transformers and safetensors into $venv (see $log)"
exit 77
