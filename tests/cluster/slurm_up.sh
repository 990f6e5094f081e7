#!/bin/bash
# Bring up a throwaway single-node Slurm as root without systemd (facts and pitfalls: shared/SLURM.md).
# No accounting (slurmdbd): molt's launcher follows jobs with squeue/scontrol, not sacct.
#   SLURM_ROOT=/tmp/x SLURMCTLD_PORT=... SLURMD_PORT=... tests/cluster/slurm_up.sh   -> prints SLURM_CONF=...
set -euo pipefail
R=${SLURM_ROOT:?set SLURM_ROOT to a scratch dir}
PKGS="slurmctld slurmd slurm-client munge"
if ! dpkg -s $PKGS >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends $PKGS >/dev/null
fi
mkdir -p $R/{etc,state,spool,log,run}
export SLURM_CONF=$R/etc/slurm.conf
wait_for() { local n=0; until eval "$1" >/dev/null 2>&1; do n=$((n+1)); [ $n -gt 150 ] && { echo "timeout: $1" >&2; exit 1; }; sleep 0.2; done; }

if ! (munge -n | unmunge) >/dev/null 2>&1; then  # munged: as user munge (root fails its log-dir check)
  [ -s /etc/munge/munge.key ] || { mungekey -c -k /etc/munge/munge.key; chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
  install -d -o munge -g munge -m 0755 /run/munge
  setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F >$R/log/munged.out 2>&1 &
  echo $! > $R/run/munged.fg.pid
  wait_for "munge -n | unmunge"
fi

# Twice the cores (config_overrides: slurmd takes the configured CPUs, not the counted ones), so that a 2-task sweep's
# jobs run side by side on CI's 2 cores instead of one after the other: each job is mostly one core importing.
MEM=$(( $(awk '/MemTotal/{print int($2/1024)}' /proc/meminfo) * 9 / 10 ))
cat > $SLURM_CONF <<EOC
ClusterName=molttest
SlurmctldHost=localhost
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=10
StateSaveLocation=$R/state
SlurmdSpoolDir=$R/spool
SlurmctldPidFile=$R/run/slurmctld.pid
SlurmdPidFile=$R/run/slurmd.pid
SlurmctldLogFile=$R/log/slurmctld.log
SlurmdLogFile=$R/log/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
NodeName=localhost CPUs=$(( 2 * $(nproc) )) RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOC
slurmctld -D -i >$R/log/slurmctld.out 2>&1 &
echo $! > $R/run/slurmctld.fg.pid
wait_for "scontrol ping | grep -q UP"
slurmd -D -N localhost >$R/log/slurmd.out 2>&1 &
echo $! > $R/run/slurmd.fg.pid
wait_for "[ \"\$(sinfo -h -n localhost -o %T)\" = idle ]"
echo "SLURM_CONF=$SLURM_CONF"
