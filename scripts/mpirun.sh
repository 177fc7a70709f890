#!/usr/bin/env bash
# Runs a program on N ranks of this machine with Open MPI's mpirun.
#
# Usage: scripts/mpirun.sh N prog [args...]
#
# Ranks may outnumber cores (--oversubscribe) and are not bound to cores (--bind-to none):
# hp::init sizes each rank's compute threads itself. When run as root, the variables that
# let Open MPI run as root are exported. Every HP_* variable set in the environment is
# forwarded to the ranks with -x (needed for ranks on other machines; local ranks
# inherit the environment anyway).
set -euo pipefail

if [ "$#" -lt 2 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N prog [args...]   (N: number of ranks, a positive integer)" >&2
  exit 2
fi
np="$1"
shift

if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1
  export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

args=(-np "$np" --oversubscribe --bind-to none)
while IFS= read -r name; do
  case "$name" in
    HP_*) args+=(-x "$name") ;;
  esac
done < <(compgen -e)

exec mpirun "${args[@]}" "$@"
