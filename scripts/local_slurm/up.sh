#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for tests and for trying scripts/train.sbatch: munged, slurmctld and
# NNODES slurmd processes emulating nodes n1..nN (each in its own UTS + mount namespace, so it has its own hostname
# and a private /etc/hosts that resolves n1..nN). All state lives in $SLURM_CI_DIR; nothing in /etc is changed.
#
#   SLURM_CI_DIR=/tmp/slurmci NNODES=2 bash scripts/local_slurm/up.sh
#   export SLURM_CONF=/tmp/slurmci/etc/slurm.conf; sbatch ...; bash scripts/local_slurm/down.sh
#
# Installs Debian's slurmctld, slurmd, slurm-client and munge when they are missing (root, apt). Needs `unshare`
# (root) for several nodes. Stop it with down.sh, which stops only what this script started, by PID file.
set -euo pipefail
D=${SLURM_CI_DIR:-/tmp/slurmci}; NNODES=${NNODES:-2}
export SLURM_CONF=$D/etc/slurm.conf

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  # No systemd: keep the packages' postinst from starting the stock daemons (harmless either way).
  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; }
fi

mkdir -p "$D"/{etc,munge,log,run,state,spool}
chmod 755 "$D" "$D/munge"   # munged wants an o+x socket folder
if [ ! -f "$D/munge/munge.key" ]; then
  dd if=/dev/urandom of="$D/munge/munge.key" bs=1024 count=1 status=none; chmod 400 "$D/munge/munge.key"
fi
munged -S "$D/munge/munge.socket.2" --key-file="$D/munge/munge.key" --pid-file="$D/munge/munged.pid" \
       --log-file="$D/log/munged.log" --seed-file="$D/munge/munged.seed"

H=$(hostname)
HW=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //')
if [ "$NNODES" -le 1 ]; then
  NODES="NodeName=$H NodeAddr=127.0.0.1 $HW State=UNKNOWN"
else
  NODES="NodeName=n[1-$NNODES] NodeHostname=$H NodeAddr=127.0.1.[1-$NNODES] Port=[17001-$((17000+NNODES))] $HW State=UNKNOWN"
  { echo "127.0.0.1 localhost $H"; for i in $(seq 1 "$NNODES"); do echo "127.0.1.$i n$i"; done; } > "$D/etc/hosts"
fi
cat > "$SLURM_CONF" <<EOF
ClusterName=ci
SlurmctldHost=$H(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also the delay before a requeued job may start again (default 120 s)
AuthInfo=socket=$D/munge/munge.socket.2,cred_expire=10
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
$NODES
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

slurmctld -f "$SLURM_CONF"
if [ "$NNODES" -le 1 ]; then
  mkdir -p "$D/spool/$H"; slurmd -f "$SLURM_CONF"
else
  for i in $(seq 1 "$NNODES"); do
    mkdir -p "$D/spool/n$i"
    unshare --uts --mount --propagation private sh -c \
      "hostname n$i && mount --bind '$D/etc/hosts' /etc/hosts && exec slurmd -f '$SLURM_CONF' -N n$i"
  done
fi
for _ in $(seq 1 150); do   # up to 30 s for every node to be idle
  [ "$(sinfo -h -o %T 2>/dev/null | sort -u)" = idle ] && [ "$(sinfo -h -o %D 2>/dev/null)" = "$NNODES" ] && break
  sleep 0.2
done
sinfo -N
[ "$(sinfo -h -o %T | sort -u)" = idle ] || { echo "local Slurm did not come up; see $D/log" >&2; exit 1; }
