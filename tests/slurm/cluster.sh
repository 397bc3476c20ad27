#!/usr/bin/env bash
# A one-node Slurm cluster on this machine for the tests (Debian's slurmctld / slurmd / munge, run as root).
#
#   tests/slurm/cluster.sh up     install the packages if missing, start munged, slurmctld and slurmd under
#                                 $SLURM_BASE, wait until the node takes jobs; prints the slurm.conf path on stdout
#   tests/slurm/cluster.sh down   cancel the cluster's jobs, stop its daemons (by their pid files) and delete
#                                 $SLURM_BASE
#
# Everything lives under SLURM_BASE (default /tmp/megatron-pdm-test-slurm); the daemons use ports
# SLURM_PORT and SLURM_PORT + 1 (default 6917, 6918) so as not to meet another cluster on this host.
# No cgroups (proctrack/linuxproc, task/none) and no accounting: this works in a container or a microVM.
# The node has the CPUs this process may use (nproc, which OMP_NUM_THREADS would otherwise cap).
set -euo pipefail
BASE=${SLURM_BASE:-/tmp/megatron-pdm-test-slurm}
PORT=${SLURM_PORT:-6917}
CONF=$BASE/etc/slurm.conf
MUNGE_SOCKET=$BASE/munge/munge.socket
say() { echo "slurm-cluster: $*" >&2; }

# running PIDFILE NAME: the pid in PIDFILE is a live (not zombie) process called NAME
running() {
  [ -s "$1" ] || return 1
  local pid state; pid=$(cat "$1")
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 1
  state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || true)
  [ -n "$state" ] && [ "$state" != Z ]
}

stop() {  # stop PIDFILE NAME: TERM, then KILL after 10 s; an exited zombie counts as stopped
  running "$1" "$2" || return 0
  local pid; pid=$(cat "$1"); kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do running "$1" "$2" || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}

up() {
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
      || ! command -v munged >/dev/null; then
    say "installing slurmctld slurmd slurm-client munge"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge >&2
  fi
  mkdir -p "$BASE"/{etc,run,log,spool/ctld,spool/d,munge}
  # munge with its own key and socket, as the munge user
  [ -s "$BASE/munge/munge.key" ] || dd if=/dev/urandom of="$BASE/munge/munge.key" bs=1024 count=1 status=none
  chown -R munge:munge "$BASE/munge"; chmod 400 "$BASE/munge/munge.key"
  chmod 755 "$BASE/munge"  # clients (root) must reach the socket
  if ! running "$BASE/munge/munged.pid" munged; then
    runuser -u munge -- munged --force --key-file="$BASE/munge/munge.key" --socket="$MUNGE_SOCKET" \
      --pid-file="$BASE/munge/munged.pid" --log-file="$BASE/munge/munged.log" --seed-file="$BASE/munge/seed"
  fi
  for _ in $(seq 50); do
    munge -S "$MUNGE_SOCKET" -n </dev/null 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1 && break
    sleep 0.1
  done
  local host; host=$(hostname -s)
  cat > "$CONF" <<CONF
ClusterName=mpdmtest
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
StateSaveLocation=$BASE/spool/ctld
SlurmdSpoolDir=$BASE/spool/d
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobContainerType=job_container/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,kill_invalid_depend
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=3600
KillWait=10
MailProg=/bin/true
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) RealMemory=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  export SLURM_CONF=$CONF
  running "$BASE/run/slurmctld.pid" slurmctld || slurmctld -f "$CONF" -c
  running "$BASE/run/slurmd.pid" slurmd || slurmd -f "$CONF"
  # sinfo may report a saved state before slurmd registers: a job that runs is the real test
  local state=""
  for _ in $(seq 150); do
    state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
    case "$state" in
      idle) timeout 20 srun -N1 -n1 --immediate=15 -o /dev/null true 2>/dev/null && break ;;
      mixed | allocated) break ;;
      drain* | down*) scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    state="not ready ($state)"; sleep 0.2
  done
  case "$state" in
    idle | mixed | allocated) ;;
    *) say "node $host $state"; tail -n 20 "$BASE/log/slurmctld.log" "$BASE/log/slurmd.log" >&2; exit 1 ;;
  esac
  say "up: node $host is $state ($CONF)"
  echo "$CONF"
}

down() {
  export SLURM_CONF=$CONF
  if running "$BASE/run/slurmctld.pid" slurmctld; then
    local jobs; jobs=$(squeue -h -o %A 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086
      scancel $jobs
      for _ in $(seq 100); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.1; done
    fi
  fi
  stop "$BASE/run/slurmd.pid" slurmd
  stop "$BASE/run/slurmctld.pid" slurmctld
  stop "$BASE/munge/munged.pid" munged
  rm -rf "$BASE"
  say "down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
