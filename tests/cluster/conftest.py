"""A real single-node Slurm for the cluster tests (slurm_up.sh installs and starts it; needs root and apt)."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import psutil
import pytest

from molt.net import free_port

HERE = Path(__file__).resolve().parent


def why_no_slurm() -> str | None:
    if os.geteuid() != 0:
        return "the test Slurm needs root (it installs packages and starts munged/slurmctld/slurmd)"
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        return "Slurm is not installed and there is no apt-get to install it"
    return None


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """SLURM_CONF of a fresh cluster (partition debug, node localhost); every job is cancelled at the end and
    every process a job left behind is killed (proctrack/linuxproc does not follow daemons such as Ray's)."""
    reason = why_no_slurm()
    if reason:
        print(f"cluster tests skipped: {reason}")
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, SLURM_ROOT=str(root), SLURMCTLD_PORT=str(free_port()), SLURMD_PORT=str(free_port()))
    out = subprocess.run([HERE / "slurm_up.sh"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    conf = out.stdout.strip().splitlines()[-1].split("=", 1)[1]
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        subprocess.run([HERE / "slurm_down.sh"], env=env, timeout=120)
        os.environ.pop("SLURM_CONF") if old is None else os.environ.update(SLURM_CONF=old)
        for p in job_processes():
            p.kill()


def job_processes(job_id: str | None = None) -> list[psutil.Process]:
    """Live processes started by Slurm jobs (they carry SLURM_JOB_ID in their environment), and their descendants:
    vLLM's EngineCore and workers retitle themselves (setproctitle), which blanks their /proc/<pid>/environ; of one
    job if given."""
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            jid = p.environ().get("SLURM_JOB_ID")
            if jid and job_id in (None, jid):
                found |= {q.pid: q for q in [p, *p.children(recursive=True)]}
    live = []
    for p in found.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.status() != psutil.STATUS_ZOMBIE:
                live.append(p)
    return live
