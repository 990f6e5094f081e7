"""molt/reaper.py sweep: what a SIGKILLed run left in /dev/shm goes at the next start (or when its reaper is done),
and nothing of a live run does; a signalled run is marked KILLED in MLflow."""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlflow
import pytest
from omegaconf import OmegaConf

from molt import tracking
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


def test_sweep_removes_what_the_engines_of_a_killed_run_noted_in_dev_shm(tmp_path, monkeypatch):
    """An engine notes its /dev/shm files in the run's private directory once up (engine.py, reaper.SHM_LIST): when
    every process of the run died at once (a scancel), the sweep that removes the directory removes them too, and
    leaves them while the run lives."""
    seg = Path(tempfile.mkstemp(prefix="psm_molttest_", dir="/dev/shm")[1])
    child = subprocess.Popen([sys.executable, "-c", f"""if 1:
        import sys, time
        from molt.reaper import SHM_LIST, private_tmp
        with private_tmp() as d:
            open(d + "/engine0" + SHM_LIST, "w").write("{seg}\\n/etc/hostname\\n")
            print(d, flush=True)
            time.sleep(600)"""], env=dict(os.environ, TMPDIR=str(tmp_path)), stdout=subprocess.PIPE, text=True)
    try:
        run_dir = Path(child.stdout.readline().strip())
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        sweep()
        assert run_dir.exists() and seg.exists(), "a live run's files were swept"
        child.kill()
        child.wait()
        sweep()
        assert not run_dir.exists() and not seg.exists() and Path("/etc/hostname").exists()
    finally:
        child.kill()
        seg.unlink(missing_ok=True)


@pytest.mark.parametrize("signalled", [False, True])
def test_a_signal_a_library_turned_into_its_own_exception_still_marks_the_run_killed(tmp_path, monkeypatch, signalled):
    """torch's checkpoint writer catches the SystemExit of a SIGTERM (a scancel during a save) and raises its own
    CheckpointException: the MLflow run is KILLED all the same, as the signal made it; an error alone is FAILED."""
    cfg = OmegaConf.create({"output_dir": str(tmp_path), "checkpoint_dir": str(tmp_path / "ck"), "resume": False,
                            "name": "signals", "mlflow_uri": None})
    monkeypatch.setattr(tracking, "TERMINATED", [15] if signalled else [])
    monkeypatch.setattr(tracking, "sweep", dict)  # not a sweep's job, whatever Hydra state an earlier test left
    with pytest.raises(RuntimeError), tracking.mlflow_run(cfg, {}) as run:
        raise RuntimeError("CheckpointException ranks: dict_keys([0])")
    status = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run.info.run_id).info.status
    assert status == ("KILLED" if signalled else "FAILED")
