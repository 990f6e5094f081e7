"""molt/reaper.py sweep: what a SIGKILLed run left in /dev/shm goes at the next start (or when its reaper is done),
and nothing of a live run does."""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from molt.reaper import sweep


def test_sweep_removes_the_weight_files_of_dead_writers_only():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = Path(tempfile.mkdtemp(prefix=f"molt-sync-{int(dead.stdout)}-v3-", dir="/dev/shm"))  # as sync_weights names it
    live = Path(tempfile.mkdtemp(prefix=f"molt-sync-{os.getpid()}-v3-", dir="/dev/shm"))
    (left / "model.safetensors").write_bytes(b"x" * 1024)
    try:
        sweep()
        assert not left.exists() and live.exists()
    finally:
        for d in (left, live):
            shutil.rmtree(d, ignore_errors=True)
