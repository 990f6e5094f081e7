"""`molt cluster=slurm_local ...` on a real single-node Slurm (conftest.py): submission, guard rails, the dry run's
script against the submitted one (the dry run without Slurm: tests/test_dry_run.py)."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import pytest

from molt.reaper import shared_memory
from tests.cluster.conftest import job_processes

REPO = Path(__file__).resolve().parents[2]
TINY = ["cluster=slurm_local", "experiment=quickstart", "rollout.n=4", "train.groups_per_step=2",
        "rollout.max_inflight_groups=4", "eval.max_samples=4"]


def ray_sessions() -> set[str]:
    """Ray sessions in Ray's default temporary directory (a job's `ray start` keeps its own in the task's private one)."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "ray", "session_*")))


def molt(*overrides, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "molt", *overrides], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def queue() -> str:
    return subprocess.run(["squeue", "-h"], capture_output=True, text=True, check=True).stdout.strip()


def runs(uri: str):
    client = mlflow.MlflowClient(uri)
    return client, client.search_runs([e.experiment_id for e in client.search_experiments()])


@pytest.mark.parametrize("overrides,fragment", [
    (["cluster=slurm"], "cluster.partition is empty"),
    (["cluster=slurm", "cluster.partition=debug", "cluster.gpus_per_node=9"], "cluster.gpus_per_node=9 > cluster.max"),
    (["cluster=slurm_local", "cluster.container_image=./missing.sqsh"], "cluster.container_image=./missing.sqsh"),
    (["cluster=slurm_local", "fsdp.dp_size=4", "cluster.gpus_per_node=1", "cluster.max_gpus_per_node=1"],
     "4 actor ranks > cluster.num_nodes*gpus_per_node = 1"),  # a layout that does not fit the nodes
    (["-m", "cluster=slurm_local", "rollout.n=4,1"], "rollout.n=1"),  # the array's second job is bad: nothing goes
])
def test_bad_input_fails_before_submission(slurm, tmp_path, overrides, fragment):
    out = molt(*overrides, f"hydra.sweep.dir={tmp_path}", timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and fragment in out.stderr
    assert "submitted" not in out.stdout and not (tmp_path / ".submitit").exists() and not queue()


def test_sweep_on_two_tasks_is_one_array_that_trains_and_molt_compare_tables_and_plots_it(slurm, tmp_path):
    """A sweep is one Slurm array; each job trains and reports (the printed job, log path and scancel line; rewards,
    eval and sweep tags in MLflow; the end-of-run summary in its log). Ray spans both tasks of a job (token auth, a
    per-job token); the dp2 actor has a rank on each, and the engine runs on task 1 (cluster.engine_tasks), through
    Ray. The jobs run side by side and share the sweep's MLflow store, which the launcher made (a race otherwise).
    `molt compare` tables and plots the sweep. (One array for all: each job costs an engine and a Ray cluster.)"""
    sweep = ("-m", *TINY, "train.steps=2", "eval.every=2", "cluster.tasks_per_node=2", "cluster.cpus_per_task=1",
             "fsdp.dp_size=2", "cluster.engine_tasks=[1]", "estimator=grpo,rloo", f"hydra.sweep.dir={tmp_path}")
    dry = molt(*sweep, "dry_run=true", timeout=120)
    assert dry.returncode == 0 and not queue(), dry.stderr
    sessions = ray_sessions()
    out = molt(*sweep, timeout=1200)  # two jobs side by side (slurm_up.sh: twice the cores): 3-5 min on 2 busy cores
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    ids = [line.split()[4] for line in out.stdout.splitlines() if line.startswith("molt: submitted Slurm job")]
    assert len(ids) == 2 and {i.split("_")[0] for i in ids} == {ids[0].split("_")[0]}, ids  # one array
    assert "scancel" in out.stdout
    times = [dict(w.split("=", 1) for w in subprocess.run(["scontrol", "show", "job", "-o", i], capture_output=True,
                                                          text=True).stdout.split() if "=" in w) for i in ids]
    assert times[0]["StartTime"] < times[1]["EndTime"] and times[1]["StartTime"] < times[0]["EndTime"], \
        "the jobs ran side by side, sharing one MLflow store"
    (script,) = (tmp_path / ".submitit").glob("*/*_submission.sh")  # what submitit sent to sbatch
    assert script.read_text() in dry.stdout, "the dry run printed the script that was submitted"
    for job in ids:
        path = tmp_path / ".submitit" / job / f"{job}_0_log.out"
        assert path.as_posix() in out.stdout, "the printed log path is the job's log"
        log = path.read_text()
        assert "molt: actor ranks on Slurm tasks [0, 1]" in log, log[-3000:]
        assert "molt: engine0 on Slurm task 1, reached through Ray" in log, log[-3000:]
        assert "molt: quickstart done: 2 steps" in log and "reward  " in log and "mlflow ui --backend-store-uri" in log
        assert not job_processes(job), "every task stopped its own Ray node"
    assert ray_sessions() == sessions, "a task's Ray node kept its session in the default temporary directory"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client, found = runs(uri)
    assert sorted(r.data.tags["molt.overrides"].split()[-1] for r in found) == ["estimator=grpo", "estimator=rloo"]
    for run in found:
        assert run.info.status == "FINISHED" and len(client.get_metric_history(run.info.run_id, "reward/mean")) == 2
        assert client.get_metric_history(run.info.run_id, "eval/reward")
        assert run.data.tags["molt.sweep"] == str(tmp_path.resolve()) and "train.steps=2" in run.data.tags[
            "molt.overrides"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmp = subprocess.run([sys.executable, "-m", "molt.compare", str(tmp_path)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert cmp.returncode == 0, cmp.stderr
    header, *rows = cmp.stdout.splitlines()[:3]
    for col in ["final reward", "best reward", "eval reward", "steps", "s/step", "tokens/s", "mismatch", "estimator"]:
        assert col in header, header
    assert sorted(r.split()[-1] for r in rows) == ["grpo", "rloo"] and all(" 2 " in r for r in rows), rows
    pngs = sorted(p.name for p in (tmp_path / "compare").glob("*.png"))
    assert pngs == sorted(f"{n}.png" for n in ["reward", "eval_reward", "loss", "mismatch", "staleness", "throughput"])
    assert all((tmp_path / "compare" / p).stat().st_size > 10_000 for p in pngs)  # PNGs were written
    _, with_compare = runs(uri)
    (summary,) = [r for r in with_compare if r.data.tags.get("molt.compare")]
    assert {a.path for a in client.list_artifacts(summary.info.run_id)} >= {"reward.png", "table.txt"}
    assert all(r.info.artifact_uri.startswith((tmp_path / "artifacts").as_uri()) for r in with_compare)


def submit(*overrides) -> tuple[subprocess.Popen, str]:
    """Start `molt ...` (cluster.wait=true keeps it running until the job ends); returns it and the job id."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "molt", *overrides], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    assert first.startswith("molt: submitted Slurm job"), first + proc.stderr.read()
    return proc, first.split()[4]


def wait_for(path_glob, root: Path, timeout_s: float = 400) -> Path:
    deadline = time.monotonic() + timeout_s
    while not (found := sorted(root.glob(path_glob))):
        assert time.monotonic() < deadline, f"no {path_glob} under {root} after {timeout_s} s"
        time.sleep(1)
    return found[-1]


def requeue(job: str) -> None:
    """`scontrol requeue`, then make the pending job eligible at once (Slurm holds a requeued job back for a while)."""
    subprocess.run(["scontrol", "requeue", job], check=True)
    deadline = time.monotonic() + 120
    while "JobState=PENDING" not in subprocess.run(["scontrol", "show", "job", job], capture_output=True,
                                                   text=True).stdout:
        assert time.monotonic() < deadline, f"job {job} did not go back to the queue"
        time.sleep(0.5)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)


def shm_of(job: str) -> set[str]:
    """The /dev/shm files the job's processes hold now (vLLM's rings: psm_*, loky's semaphores); some must exist."""
    procs = job_processes(job)
    held = shared_memory(p.pid for p in procs)
    assert any("/psm_" in p for p in held), (f"job {job} maps no shared memory: is its engine up?",
                                             [(p.pid, p.name()) for p in procs])
    return held


def test_requeued_job_resumes_and_scancel_leaves_no_process_behind(slurm, tmp_path):
    """`scontrol requeue` restarts the job, which resumes its checkpoint into the same MLflow run; then scancel
    signals every process of the job at once: the vLLM server, Ray's daemons and the actor must all go, and the
    MLflow run is marked KILLED. (One job for both: each job start costs an engine and a Ray cluster.)"""
    proc, job = submit(*TINY, "train.steps=100000", "train.save_every=2", "eval.every=0", f"hydra.sweep.dir={tmp_path}",
                       "engine.cpu_threads_bind=auto")  # vLLM's worker in its own process: its rings in /dev/shm
    wait_for("0/checkpoints/step_*", tmp_path)
    held = shm_of(job)
    requeue(job)
    log = tmp_path / ".submitit" / job / f"{job}_0_log.out"
    deadline = time.monotonic() + 400
    while "resume=true: continuing from" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None, "the requeued job did not resume"
        time.sleep(1)
    at_resume = wait_for("0/checkpoints/step_*", tmp_path).name
    while wait_for("0/checkpoints/step_*", tmp_path).name <= at_resume:  # it trains on after the resume
        assert time.monotonic() < deadline and proc.poll() is None, "the resumed job wrote no checkpoint"
        time.sleep(1)
    assert any("vllm.entrypoints" in " ".join(p.cmdline()) for p in job_processes(job)), "the job runs an engine"
    held |= shm_of(job)
    subprocess.run(["scancel", job], check=True)
    proc.communicate(timeout=120)
    deadline = time.monotonic() + 60
    while (left := job_processes(job)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, [" ".join(p.cmdline()[:4]) for p in left]
    # issue 23: vLLM's shared-memory rings and loky's semaphores of both starts are gone from /dev/shm
    assert [p for p in held if os.path.exists(p)] == []
    client, (run,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")  # one run across both starts
    assert run.info.status == "KILLED"
    steps = sorted({m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")})
    assert steps == list(range(len(steps))) and len(steps) > int(at_resume.split("_")[1]), steps
