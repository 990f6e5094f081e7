#!/bin/bash
# Stop what slurm_up.sh started, by PID; cancel jobs first (slurmstepd outlives slurmd).
R=${SLURM_ROOT:?set SLURM_ROOT to a scratch dir}; export SLURM_CONF=$R/etc/slurm.conf
alive() { local st; st=$(ps -o stat= -p $1 2>/dev/null) && [ "${st:0:1}" != Z ]; }  # a zombie counts as gone
scancel --user=root 2>/dev/null; for i in $(seq 100); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
for d in slurmd slurmctld munged; do
  f=$R/run/$d.fg.pid; [ -f $f ] || continue; p=$(cat $f)
  kill -TERM $p 2>/dev/null; for i in $(seq 100); do alive $p || break; sleep 0.1; done
  alive $p && { echo "$d ($p) did not exit, SIGKILL"; kill -KILL $p; }
  rm -f $f
done
exit 0
