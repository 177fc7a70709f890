#!/usr/bin/env bash
# Two "nodes" on one machine, for tests of a job that spans hosts: two network namespaces
# joined by a veth pair (10.77.0.1 and 10.77.0.2), each with a host name of its own (a UTS
# namespace) and its own Open MPI session folder, so that Open MPI takes them for two hosts.
# Root only (namespaces and links); nothing but the namespaces' own addresses is touched.
#
#   scripts/two_nodes.sh NAME create            make NAME-a, NAME-b and the link between them
#   scripts/two_nodes.sh NAME run K COMMAND...  COMMAND (hp-train and its arguments) on 2 x K
#                                               ranks, K per node, mpirun started in node a
#   scripts/two_nodes.sh NAME run-on HOSTS COMMAND...
#                                               the same on the ranks HOSTS places, as
#                                               mpirun's --host names them with a and b for the
#                                               nodes ("a:2,b:2", "a:2"; scripts/launch.sh's
#                                               {hosts})
#   scripts/two_nodes.sh NAME down | up         take the link down (a partition) or back up
#   scripts/two_nodes.sh NAME lose b            node b lost for good: its processes killed
#                                               (SIGKILL), and the agent refuses it from then
#                                               on, as ssh fails for a host that is gone
#   scripts/two_nodes.sh NAME check a|b         whether the node can be reached (the agent runs
#                                               'true' there): scripts/launch.sh --node-check
#   scripts/two_nodes.sh NAME destroy           remove them (what exists of them; no error
#                                               for what does not)
#
# `run` passes HP_* and OMPI_* variables of its environment to every rank. mpirun cannot
# reach the far node's daemon across a partition and does not return by itself then: the
# caller ends it (a test, or scripts/launch.sh --rank-grace).
set -uo pipefail
name=${1:-} verb=${2:-}
[ -n "$name" ] && [ -n "$verb" ] || { sed -n '2,26p' "$0" >&2; exit 2; }
[[ $name =~ ^[a-z0-9]{1,8}$ ]] || { echo "two_nodes.sh: NAME '$name': 1 to 8 lower-case letters or digits" >&2; exit 2; }
shift 2
state=/tmp/hp-two-nodes-$name
a=$name-a b=$name-b va=${name}va vb=${name}vb

case $verb in
  create)
    [ "$(id -u)" = 0 ] || { echo "two_nodes.sh: needs root (network namespaces)" >&2; exit 77; }
    ip netns add "$a" && ip netns add "$b" || { echo "two_nodes.sh: cannot make the namespaces" >&2; exit 1; }
    if ! { ip link add "$va" type veth peer name "$vb" && ip link set "$va" netns "$a" && ip link set "$vb" netns "$b" &&
           ip -n "$a" addr add 10.77.0.1/24 dev "$va" && ip -n "$b" addr add 10.77.0.2/24 dev "$vb" &&
           ip -n "$a" link set "$va" up && ip -n "$b" link set "$vb" up &&
           ip -n "$a" link set lo up && ip -n "$b" link set lo up; }; then
      "$0" "$name" destroy
      echo "two_nodes.sh: cannot make the link" >&2
      exit 1
    fi
    mkdir -p "$state/${name}nodea" "$state/${name}nodeb"
    # The rsh agent mpirun starts the far node's daemon with: the host's namespace, its own
    # host name and session folder.
    cat > "$state/agent.sh" <<AGENT
#!/bin/bash
host=\$1; shift
case \$host in
  10.77.0.1) ns=$a node=${name}nodea ;;
  10.77.0.2) ns=$b node=${name}nodeb ;;
  *) echo "two_nodes agent: unknown host \$host" >&2; exit 1 ;;
esac
[ ! -e "$state/lost-\$node" ] || { echo "two_nodes agent: \$host: no route to host (the node is lost)" >&2; exit 255; }
exec ip netns exec "\$ns" unshare -u /bin/sh -c "hostname \$node; export OMPI_MCA_orte_tmpdir_base=$state/\$node; \$*"
AGENT
    chmod +x "$state/agent.sh"
    ;;
  run|run-on)
    if [ "$verb" = run ]; then
      k=${1:-}; shift
      [[ $k =~ ^[1-9][0-9]?$ ]] && [ $# -gt 0 ] || { echo "two_nodes.sh: run K COMMAND..." >&2; exit 2; }
      hosts="10.77.0.1:$k,10.77.0.2:$k" np=$((2 * k))
    else
      spec=${1:-}; shift
      [[ $spec =~ ^[ab]:[1-9][0-9]?(,[ab]:[1-9][0-9]?)?$ ]] && [ $# -gt 0 ] ||
        { echo "two_nodes.sh: run-on HOSTS COMMAND... (HOSTS: a:K, b:K or both, comma-separated)" >&2; exit 2; }
      hosts="" np=0
      for h in ${spec//,/ }; do
        hosts+="${hosts:+,}10.77.0.$([ "${h%%:*}" = a ] && echo 1 || echo 2):${h#*:}" np=$((np + ${h#*:}))
      done
    fi
    [ -x "$state/agent.sh" ] || { echo "two_nodes.sh: '$name' was not created" >&2; exit 1; }
    pass=()
    for v in $(env | sed -n 's/^\(\(HP\|OMPI\)_[A-Za-z0-9_]*\)=.*/\1/p'); do pass+=(-x "$v"); done
    printf -v cmd '%q ' mpirun --mca plm_rsh_agent "$state/agent.sh" --host "$hosts" -np "$np" \
      --oversubscribe --bind-to none --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24 \
      --mca oob_tcp_if_include 10.77.0.0/24 "${pass[@]}" "$@"
    exec ip netns exec "$a" unshare -u /bin/sh -c \
      "hostname ${name}nodea; export OMPI_MCA_orte_tmpdir_base=$state/${name}nodea; exec $cmd"
    ;;
  lose)
    [ "${1:-}" = b ] || { echo "two_nodes.sh: lose b (node a runs mpirun)" >&2; exit 2; }
    touch "$state/lost-${name}nodeb"
    pids=$(ip netns pids "$b" 2> /dev/null)
    [ -z "$pids" ] || kill -9 $pids 2> /dev/null
    ;;
  check)
    case ${1:-} in a) host=10.77.0.1 ;; b) host=10.77.0.2 ;; *) echo "two_nodes.sh: check a|b" >&2; exit 2 ;; esac
    timeout 10 "$state/agent.sh" "$host" true
    ;;
  down) ip -n "$a" link set "$va" down ;;
  up) ip -n "$a" link set "$va" up ;;
  destroy)
    # Processes still inside (a job that was not ended) would keep a namespace alive.
    for ns in "$a" "$b"; do
      pids=$(ip netns pids "$ns" 2> /dev/null)
      [ -z "$pids" ] || kill -9 $pids 2> /dev/null
      ip netns del "$ns" 2> /dev/null
    done
    ip link del "$va" 2> /dev/null
    rm -rf "$state"
    exit 0
    ;;
  *) echo "two_nodes.sh: unknown verb '$verb' (create, run, run-on, down, up, lose, check, destroy)" >&2; exit 2 ;;
esac
