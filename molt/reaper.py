"""A watchdog so that nothing of a run outlives its driver, even a SIGKILLed one.

    with watching(mlflow_uri, run_id): ...     # in the driver, once Ray and the MLflow run exist

It is a separate process in its own session (no Ctrl-C, no process-group kill reaches it). Once a second it notes
the driver's process tree; when the driver dies without saying goodbye (SIGKILL, OOM), it stops every process that
tree held (Ray's GCS, raylet, workers, dashboard and runtime-env agents; engines die by their parent-death signal
anyway) and marks the MLflow run KILLED. A clean exit says goodbye: the driver stops what it started itself.
"""
from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys

import psutil


@contextlib.contextmanager
def watching(mlflow_uri: str, run_id: str):
    read, write = os.pipe()  # the driver holds the only write end (not inherited): EOF = the driver is gone
    proc = subprocess.Popen([sys.executable, "-m", "molt.reaper", str(os.getpid()), mlflow_uri, run_id],
                            stdin=read, start_new_session=True)
    os.close(read)
    try:
        yield proc
    finally:
        os.write(write, b"bye")
        os.close(write)
        proc.wait(30)


def _follow(driver: int) -> list[psutil.Process] | None:
    """Every process the driver's tree held while it lived, once it is gone; None when it says goodbye."""
    seen: dict[int, psutil.Process] = {}
    while True:
        if select.select([sys.stdin], [], [], 1.0)[0]:
            return None if os.read(sys.stdin.fileno(), 3) else list(seen.values())
        try:
            seen |= {p.pid: p for p in psutil.Process(driver).children(recursive=True) if p.pid != os.getpid()}
        except psutil.NoSuchProcess:
            return list(seen.values())


def main(driver: int, mlflow_uri: str, run_id: str) -> None:
    held = _follow(driver)
    if held is None:
        return
    orphans = [p for p in held if p.is_running()]  # is_running also checks the start time: no reused pid
    for p in orphans:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    for p in psutil.wait_procs(orphans, timeout=3)[1]:
        with contextlib.suppress(psutil.Error):
            p.kill()
    if mlflow_uri:
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, "KILLED")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
