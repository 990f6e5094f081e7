"""A watchdog so that nothing of a run outlives its driver, even a SIGKILLed one.

    with watching(mlflow_uri, run_id): ...     # in the driver, once Ray and the MLflow run exist

It is a separate process in its own session, not a child of the driver, deaf to SIGTERM, SIGINT and SIGHUP (a scancel signals every process of
the job at once). Once a second it notes the driver's process tree; once the driver has exited, it stops every
process that tree held and that still runs (Ray's GCS, raylet, workers, dashboard and runtime-env agents, a vLLM
server waiting on its requests), and if the driver died without saying goodbye (SIGKILL, OOM, scancel) it marks
the MLflow run KILLED. After a clean exit there is nothing left to stop: the driver stopped what it started.

Files too: a run keeps its temporary files (Ray's session, the engines' sockets, vLLM's IPC sockets and FileStore)
in one private directory (`private_tmp`), which `sweep` removes once no live process holds its lock; the reaper
sweeps after stopping the processes, and so does every later run as it starts. What the stopped processes left in
/dev/shm (vLLM's shared-memory rings and caches, when a SIGKILL cut their cleanup short) goes too: an engine notes
its files in the run's directory once it is up (SHM_LIST), so they go with it even when a scheduler killed every
process of the job at once, before anything could look at their maps.
"""
from __future__ import annotations

import contextlib
import fcntl
import getpass
import glob
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

SHM_LIST = ".shm"  # <private dir>/<engine>.shm: the /dev/shm files an engine's processes made, one per line


@contextlib.contextmanager
def watching(mlflow_uri: str, run_id: str):
    read, write = os.pipe()  # the driver holds the only write end (not inherited): EOF = the driver is gone
    subprocess.run([sys.executable, "-m", "molt.reaper", str(os.getpid()), mlflow_uri, run_id], stdin=read,
                   start_new_session=True, check=True)  # returns at once: the reaper lives on in a forked child
    os.close(read)
    try:
        yield
    finally:
        # the run ended as the driver meant it to: leave its MLflow run alone. The write end stays open until the
        # driver exits; closed here, the reaper would stop Ray and the engines while the driver still shuts them down
        os.write(write, b"bye")


@contextlib.contextmanager
def private_tmp():
    """A new 0700 directory (molt-run-*), removed on exit and locked while this process lives: after a SIGKILL,
    `sweep` removes it."""
    sweep()
    staging = tempfile.mkdtemp(prefix=".molt-run-")  # renamed once locked: a sweep never sees it unlocked
    lock = os.open(staging, os.O_RDONLY)  # not inherited (O_CLOEXEC): the engines and Ray never hold it
    fcntl.flock(lock, fcntl.LOCK_EX)
    root = os.path.join(os.path.dirname(staging), os.path.basename(staging)[1:])
    os.rename(staging, root)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
        os.close(lock)


def private_env(tmp: str) -> dict[str, str]:
    """The environment that puts a process's temporary files (tempfile.gettempdir()) in `tmp`, while torch's compile
    cache stays where it was (gettempdir() of this process), shared between runs."""
    return dict(TMPDIR=tmp, TORCHINDUCTOR_CACHE_DIR=os.environ.get("TORCHINDUCTOR_CACHE_DIR")
                or os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))


def sweep() -> None:
    """Remove the private directories of runs that are gone (those whose lock no process holds), and the weight
    files a killed run was writing for its engines in /dev/shm (engine.sync_dir's default; molt/sync/reload.py
    names them after the writer's pid)."""
    for d in glob.glob("/dev/shm/molt-sync-*-v*"):
        with contextlib.suppress(ValueError, psutil.Error):
            if not psutil.pid_exists(int(d.split("-")[2])):
                shutil.rmtree(d, ignore_errors=True)
    for d in glob.glob(os.path.join(tempfile.gettempdir(), "molt-run-*")):
        with contextlib.suppress(OSError):
            fd = os.open(d, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError while its run lives
                for listed in glob.glob(os.path.join(d, "*" + SHM_LIST)):  # what its engines noted (engine.py)
                    unlink(p for p in Path(listed).read_text().split() if p.startswith("/dev/shm/"))
                shutil.rmtree(d, ignore_errors=True)
            finally:
                os.close(fd)


def shared_memory(pids) -> set[str]:
    """The POSIX shared-memory segments (Python's /dev/shm/psm_*: vLLM's message queues and caches) these
    processes map, read from /proc, and the named semaphores loky (imported by vLLM's workers) made for them
    (/dev/shm/sem.loky-<pid>-*): a process that dies by SIGKILL leaves them behind."""
    found = set()
    for pid in pids:
        found |= set(glob.glob(f"/dev/shm/sem.loky-{pid}-*"))
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[5:]  # address, perms, offset, device, inode, path
                if path and path[0].startswith("/dev/shm/psm_") and not path[0].endswith(" (deleted)"):
                    found.add(path[0])
    return found


def unlink(paths) -> None:
    """Remove shared-memory segments whose processes are gone (mappings still alive keep their memory)."""
    for p in paths:
        Path(p).unlink(missing_ok=True)


def _follow(driver: int) -> tuple[bool, list[psutil.Process]]:
    """Once the driver is gone: whether it said goodbye, and every process its tree held while it lived."""
    seen: dict[int, psutil.Process] = {}
    goodbye = False
    while True:
        if select.select([sys.stdin], [], [], 1.0)[0]:
            if os.read(sys.stdin.fileno(), 3):
                goodbye = True
                continue
            return goodbye, list(seen.values())
        try:
            seen |= {p.pid: p for p in psutil.Process(driver).children(recursive=True) if p.pid != os.getpid()}
        except psutil.NoSuchProcess:
            return goodbye, list(seen.values())


def main(driver: int, mlflow_uri: str, run_id: str) -> None:
    # a scheduler's SIGTERM (scancel) and a terminal's Ctrl-C reach this process too: it must outlive the driver
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if os.fork():  # no child of the driver: a scheduler that kills the job's process tree (Slurm's proctrack/
        os._exit(0)  # linuxproc after KillWait) kills the driver and its children, not this
    goodbye, held = _follow(driver)
    orphans = [p for p in held if p.is_running()]  # is_running also checks the start time: no reused pid
    segments = shared_memory(p.pid for p in orphans)
    for p in orphans:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    for p in psutil.wait_procs(orphans, timeout=3)[1]:
        with contextlib.suppress(psutil.Error):
            p.kill()
    unlink(segments)
    sweep()  # the driver's private directory, now that nothing of the run uses it
    if mlflow_uri and not goodbye:
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, "KILLED")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
