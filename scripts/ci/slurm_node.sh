#!/usr/bin/env bash
# CI only (root): one "host" of the CI's Slurm cluster. `slurm_node.sh start WORK NAME ADDR` makes
# the network namespace WORK's cluster prefix + NAME (a veth pair on the cluster's bridge, address
# ADDR/24, no route anywhere else) if it does not exist yet, and starts slurmd -N NAME in it, inside
# its own UTS (hostname NAME), PID and mount namespaces (/etc/hosts: the cluster's names; /proc and
# WORK/private: its own), so that the node's processes see one host and die together. `slurm_node.sh stop WORK NAME`
# kills every process of the node at once (the node is lost; its network stays for a restart).
set -euo pipefail
action="$1" work="$2" name="$3"
prefix="$(cat "$work/prefix")"  # e3c<pid>: every namespace, link and file of this cluster carries it
ns="$prefix-$name"
pidfile="$work/nodes/$name.pid"
mkdir -p "$work/nodes"

case "$action" in
  start)
    addr="$4"
    if ! grep -qw "$ns" <<<"$(ip netns list)"; then
      host_if="${prefix}v${name}" node_if="${prefix}p${name}"
      ip netns add "$ns"
      ip link add "$host_if" type veth peer name "$node_if"
      ip link set "$node_if" netns "$ns"
      ip link set "$host_if" master "${prefix}b" up
      ip -n "$ns" link set "$node_if" name eth0
      ip -n "$ns" addr add "$addr/24" dev eth0
      ip -n "$ns" link set eth0 up
      ip -n "$ns" link set lo up
    fi
    # setsid: not in the group of whoever started it. --kill-child: killing this unshare kills the namespace's first process, and with it every
    # process of the node (a PID namespace ends with its init)
    mkdir -p "$work/d/$name" "$work/private"  # private: a tmpfs of the node's own (a folder no other host sees)
    # nsenter, not `ip netns exec`: that one remounts /sys, and slurmd wants this machine's cgroups there
    setsid nsenter --net="/run/netns/$ns" unshare --uts --pid --mount --fork --mount-proc --kill-child \
      sh -c "mount --bind '$work/hosts' /etc/hosts && mount -t tmpfs none '$work/private' && hostname '$name' \
             && exec /usr/sbin/slurmd -D -N '$name'" \
      >>"$work/log/node-$name.out" 2>&1 &
    echo $! >"$pidfile"
    ;;
  stop)
    [ -f "$pidfile" ] && kill -9 "$(cat "$pidfile")" 2>/dev/null || true
    rm -f "$pidfile"
    ;;
  *)
    echo "usage: slurm_node.sh start WORK NAME ADDR | stop WORK NAME" >&2
    exit 2
    ;;
esac
