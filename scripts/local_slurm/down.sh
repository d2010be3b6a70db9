#!/usr/bin/env bash
# Stop what scripts/local_slurm/up.sh started (jobs first, then the daemons by PID file); leaves nothing running.
D=${SLURM_CI_DIR:-/tmp/slurmci}; export SLURM_CONF=$D/etc/slurm.conf
if [ -f "$D/run/slurmctld.pid" ]; then
  ids=$(squeue -h -o %i 2>/dev/null || true)
  if [ -n "$ids" ]; then
    # shellcheck disable=SC2086
    scancel $ids
    for _ in $(seq 1 60); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.5; done
  fi
fi
pids=""
for f in "$D"/run/slurmd-*.pid "$D/run/slurmctld.pid" "$D/munge/munged.pid"; do
  [ -f "$f" ] || continue; p=$(cat "$f"); kill -TERM "$p" 2>/dev/null && pids="$pids $p"
done
alive=""
for _ in $(seq 1 50); do
  alive=""; for p in $pids; do kill -0 "$p" 2>/dev/null && alive="$alive $p"; done
  [ -z "$alive" ] && break; sleep 0.2
done
# shellcheck disable=SC2086
[ -z "$alive" ] || { echo "still alive:$alive -> SIGKILL"; kill -KILL $alive; }
echo "stopped:$pids"
