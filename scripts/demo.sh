#!/usr/bin/env bash
# README command 1: builds hp-smoke and runs it on 4 ranks of this machine.
# For now the demo is the smoke run of a few collectives and a 2-D DeviceMesh; once the
# hp-train trainer exists, this script will run a short training job with it instead.
set -euo pipefail

cd "$(dirname "$0")/.."

bash scripts/build.sh hp-smoke
bash scripts/mpirun.sh 4 build/hp-smoke
