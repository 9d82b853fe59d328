#!/usr/bin/env bash
# CI only (root, Debian): a real two-node Slurm on this machine, started by hand (no systemd). Each
# node is a "host" of its own (scripts/ci/slurm_node.sh: a network namespace with its own address
# on a private bridge, its own hostname, processes and /etc/hosts) running slurmd; the controller,
# accounting and munge run here; the cluster's filesystem is this one (shared, as a cluster's is).
# Then scripts/ci/slurm_e2e.py submits through submitit what users submit (one-node and two-node
# layouts, online across nodes, a node lost mid-run) and checks the outputs. Stops and removes only
# what it started and made (its PID files, its namespaces and bridge). Never run by scripts/test.sh:
# a user's test run does not install daemons.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
work="$(mktemp -d /tmp/eagle3-slurm-XXXXXX)"
chmod 755 "$work"  # munge and mysql run as their own users
echo "slurm CI: state in $work" >&2

if ! command -v slurmctld >/dev/null || ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null; then
  # policy-rc.d blocks service starts inside apt-get (we start everything by hand below)
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >&2
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client slurmdbd munge mariadb-server >&2
fi

pids=()
prefix="e3c$$"  # this run's namespaces, bridge and veths: e3c<pid>-n1, e3c<pid>b, ...
net=10.231.77  # the cluster's /24: the controller .254, node i .i
nodes=(n1 n2)
echo "$prefix" >"$work/prefix"
cleanup() {
  for n in "${nodes[@]}"; do bash "$root/scripts/ci/slurm_node.sh" stop "$work" "$n" || true; done
  for f in "${pids[@]}"; do
    [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
  done
  sleep 1
  for f in "${pids[@]}"; do
    [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null || true
  done
  for n in "${nodes[@]}"; do ip netns del "$prefix-$n" 2>/dev/null || true; done
  ip link del "${prefix}b" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM  # a signal exits, and the EXIT trap cleans up

# --- munge: runs as the munge user, needs /run/munge
mkdir -p /run/munge /etc/munge "$work/munge"
chown munge:munge /run/munge "$work/munge"
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
runuser -u munge -- /usr/sbin/munged --pid-file="$work/munge/munged.pid" --socket=/run/munge/munge.socket.2 \
  --log-file="$work/munge/munged.log" --seed-file="$work/munge/munged.seed" --force
pids+=("$work/munge/munged.pid")
munge -n | unmunge >/dev/null

# --- MariaDB for slurmdbd (accounting is needed: without it submitit waits forever on a crashed job)
mkdir -p "$work/mysql" /run/mysqld && chown mysql:mysql "$work/mysql" /run/mysqld
mariadb-install-db --user=mysql --datadir="$work/mysql" --auth-root-authentication-method=socket >/dev/null
/usr/sbin/mariadbd --user=mysql --datadir="$work/mysql" --socket="$work/mysql/mysql.sock" --pid-file="$work/mysql/mysqld.pid" \
  --skip-networking=0 --bind-address=127.0.0.1 --port=3307 >"$work/mysqld.log" 2>&1 &
pids+=("$work/mysql/mysqld.pid")
for _ in $(seq 60); do mariadb --socket="$work/mysql/mysql.sock" -e "select 1" >/dev/null 2>&1 && break; sleep 1; done
mariadb --socket="$work/mysql/mysql.sock" -e "create database if not exists slurm_acct_db;
  create user if not exists 'slurm'@'localhost' identified by 'eagle3ci';
  grant all on slurm_acct_db.* to 'slurm'@'localhost'; flush privileges;"

# --- the cluster's network: a bridge here (the controller's address), nothing routed elsewhere
if grep -q "^$net\." <<<"$(ip route)"; then
  echo "slurm CI: $net.0/24 is already routed on this machine; set another net= in $0" >&2
  exit 1
fi
ip link add "${prefix}b" type bridge
ip addr add "$net.254/24" dev "${prefix}b"
ip link set "${prefix}b" up
host="$(hostname -s)"
{
  echo "127.0.0.1 localhost"
  echo "$net.254 $host"
  for i in "${!nodes[@]}"; do echo "$net.$((i + 1)) ${nodes[$i]}"; done
} >"$work/hosts"

# --- Slurm configs (no cgroups here: linuxproc tracking, no task plugin); every node reports this
# machine's CPUs (they share them)
hardware="$(slurmd -C | head -n1 | sed -E 's/^NodeName=[^ ]+ //')"
mkdir -p "$work/ctld" "$work/d" "$work/log" /etc/slurm
cat >/etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$work/slurmdbd.pid
LogFile=$work/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3307
StorageUser=slurm
StoragePass=eagle3ci
StorageLoc=slurm_acct_db
EOF
chmod 600 /etc/slurm/slurmdbd.conf
{
  cat <<EOF
ClusterName=eagle3ci
SlurmctldHost=$host($net.254)
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SlurmdTimeout=10
AuthInfo=cred_expire=10
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=$work/ctld
SlurmdSpoolDir=$work/d/%n
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/d/slurmd-%n.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd-%n.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
EOF
  for i in "${!nodes[@]}"; do echo "NodeName=${nodes[$i]} NodeAddr=$net.$((i + 1)) $hardware"; done
  echo "PartitionName=debug Nodes=$(IFS=,; echo "${nodes[*]}") Default=YES MaxTime=INFINITE State=UP"
} >/etc/slurm/slurm.conf

/usr/sbin/slurmdbd
pids+=("$work/slurmdbd.pid")
for _ in $(seq 30); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 1; done
sacctmgr -i add cluster eagle3ci >/dev/null 2>&1 || true
/usr/sbin/slurmctld -i
pids+=("$work/slurmctld.pid")
for i in "${!nodes[@]}"; do bash "$root/scripts/ci/slurm_node.sh" start "$work" "${nodes[$i]}" "$net.$((i + 1))"; done
idle=0
for _ in $(seq 60); do
  idle="$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l || true)"
  [ "$idle" = "${#nodes[@]}" ] && break
  sleep 1
done
sinfo -N >&2
[ "$idle" = "${#nodes[@]}" ] || { echo "slurm CI: the nodes never became idle" >&2; tail -n 30 "$work/log/"* >&2; exit 1; }

cd "$root"
if [ -n "${SLURM_CI_HOLD:-}" ]; then  # by hand, to look around: the cluster stays up until $work/stop exists
  echo "slurm CI: holding the cluster; touch $work/stop to end" >&2
  until [ -e "$work/stop" ]; do sleep 2; done
  exit 0
fi
.venv/bin/python scripts/ci/slurm_e2e.py --work "$work/e2e" --cluster "$work"
echo "slurm CI: passed" >&2
