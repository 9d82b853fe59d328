#!/usr/bin/env bash
# CI only (root, Debian): a real single-node Slurm on localhost, started by hand (no systemd), then
# scripts/ci/slurm_e2e.py submits a tiny harvest array and a 2-task training job through submitit and
# checks their outputs. Stops only the daemons it started (their PID files). Never run by
# scripts/test.sh: a user's test run does not install daemons.
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
cleanup() {
  for f in "${pids[@]}"; do
    [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
  done
  sleep 1
  for f in "${pids[@]}"; do
    [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null || true
  done
}
trap cleanup EXIT

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

# --- Slurm configs (no cgroups here: linuxproc tracking, no task plugin)
host="$(hostname -s)"
node="$(slurmd -C | head -n1)"
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
cat >/etc/slurm/slurm.conf <<EOF
ClusterName=eagle3ci
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=$work/ctld
SlurmdSpoolDir=$work/d
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
$node
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF

/usr/sbin/slurmdbd
pids+=("$work/slurmdbd.pid")
for _ in $(seq 30); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 1; done
sacctmgr -i add cluster eagle3ci >/dev/null 2>&1 || true
/usr/sbin/slurmctld -i
pids+=("$work/slurmctld.pid")
/usr/sbin/slurmd
pids+=("$work/slurmd.pid")
for _ in $(seq 60); do
  state="$(sinfo -h -o %t 2>/dev/null | head -n1 || true)"
  [ "$state" = "idle" ] && break
  sleep 1
done
sinfo >&2
[ "$state" = "idle" ] || { echo "slurm CI: the node never became idle" >&2; tail -n 30 "$work/log/"*.log >&2; exit 1; }

cd "$root"
.venv/bin/python scripts/ci/slurm_e2e.py --work "$work/e2e"
echo "slurm CI: passed" >&2
