#!/usr/bin/env bash
# Installs the Debian packages hyperparallel needs to build and test, skipping those
# already installed. Quiet and fast when nothing is missing.
#
# Usage: scripts/deps.sh        (or source it from another script)
set -euo pipefail

hp_deps_packages=(
  libtorch-dev
  libopenmpi-dev
  openmpi-bin
  libopenblas0-pthread
  ccache
  ninja-build
  cmake
  g++
  libgtest-dev
  googletest
  nlohmann-json3-dev
  libyaml-cpp-dev
  python3-venv
  python3-torch
)

hp_deps_missing=()
for hp_deps_pkg in "${hp_deps_packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$hp_deps_pkg" 2>/dev/null | grep -q "install ok installed"; then
    hp_deps_missing+=("$hp_deps_pkg")
  fi
done

if [ "${#hp_deps_missing[@]}" -eq 0 ]; then
  echo "deps.sh: all ${#hp_deps_packages[@]} required packages are present"
else
  hp_deps_sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
      hp_deps_sudo=(sudo)
    else
      echo "deps.sh: missing packages (${hp_deps_missing[*]}) and not root, no sudo to install them" >&2
      exit 1
    fi
  fi
  "${hp_deps_sudo[@]}" apt-get update
  "${hp_deps_sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y --no-install-recommends "${hp_deps_missing[@]}"
  echo "deps.sh: installed ${hp_deps_missing[*]}"
fi
