"""Where a run executes: one Ray node per Slurm task, and Slurm submission through submitit.

    molt cluster=slurm cluster.partition=gpu experiment=quickstart   # one job: its id, log and how to follow it
    molt -m cluster=slurm estimator=grpo,rloo                        # one array, one MLflow run per element
    molt cluster=slurm dry_run=true                                  # guard rails, each job's plan, the sbatch script (no Slurm needed)

Submission is Hydra's submitit launcher (hydra_plugins/molt_slurm) with `launch` below: every job's config is
composed and checked on the login node, the resources come from `cluster.*` alone, and jobs are followed with
squeue/scontrol (submitit's own polling needs Slurm accounting, which many clusters and our tests lack).
"""
from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from molt import guards, reaper, tracking
from molt.net import free_port


def requeued() -> bool:
    """True in a Slurm job that was preempted, timed out or `scontrol requeue`d and now runs again."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0


# ---------------------------------------------------------------------------------------------
# On the allocation: one Ray node per Slurm task


@contextlib.contextmanager
def allocation(cfg):
    """Yield True where the loop runs. In a Slurm job of several tasks: task 0 starts a Ray head and runs the
    loop; every other task joins it as a Ray worker and yields False once task 0 is done (or gone). Each task
    stops its own Ray node (by process group; `ray stop` would stop every Ray on the host)."""
    import submitit

    env = submitit.JobEnvironment() if "SLURM_JOB_ID" in os.environ and cfg.cluster.launcher == "slurm" else None
    if env is None or env.num_tasks == 1:
        yield True
        return
    # rendezvous files on the job's (shared) directory, fresh for every start of a requeued job
    rdv = Path(cfg.output_dir) / f".ray.{env.job_id}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    addr = socket.gethostbyname(env.hostnames[env.node])
    os.environ["MOLT_NODE_ADDR"] = addr
    # each task's Ray node keeps its session (and its processes their temporary files) in a private directory of
    # the task's, removed when the task ends (swept by the next run on the node if it was killed)
    with reaper.private_tmp() as tmp:
        cmd = [str(Path(sys.executable).parent / "ray"), "start", "--block", f"--node-ip-address={addr}",
               "--disable-usage-stats", f"--temp-dir={tmp}/ray", f"--num-cpus={cfg.cluster.cpus_per_task or 1}",
               f"--resources={{\"molt_task_{env.global_rank}\": 1}}"]
        start = functools.partial(subprocess.Popen, start_new_session=True, env=os.environ | reaper.private_env(tmp))
        if env.global_rank == 0:
            rdv.mkdir(parents=True, exist_ok=True)
            port = free_port(addr)
            ray = start(cmd + ["--head", f"--port={port}", "--include-dashboard=false"])
            os.environ["MOLT_RAY_ADDRESS"] = f"{addr}:{port}"  # the loop's ray_session joins it
            try:
                wait_for_nodes(env.num_tasks, rdv / "address")
                yield True
            finally:
                (rdv / "done").touch()
                stop_group(ray)
            return
        head = wait_for_file(rdv / "address").read_text()
        ray = start(cmd + [f"--address={head}"])
        try:
            while not (rdv / "done").exists() and ray.poll() is None:  # the head's end ends our worker too
                time.sleep(1)
            yield False
        finally:
            stop_group(ray)


def wait_for_file(path: Path, timeout_s: float = 300) -> Path:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout_s:.0f} s: task 0 did not start Ray (its log)")
        time.sleep(0.5)
    return path


def wait_for_nodes(n: int, address_file: Path, timeout_s: float = 300) -> None:
    """On task 0: once the head answers, publish its address; then wait until all n Ray nodes are alive."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.init(address=os.environ["MOLT_RAY_ADDRESS"], log_to_driver=False)
            break
        except ConnectionError:  # the head is still starting
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    try:
        address_file.write_text(os.environ["MOLT_RAY_ADDRESS"])
        while (alive := sum(node["Alive"] for node in ray.nodes())) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {alive} of {n} Ray nodes joined in {timeout_s:.0f} s (see the task logs)")
            time.sleep(0.5)
    finally:
        ray.shutdown()


def stop_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM a process group (`ray start --block` shuts its node down), SIGKILL what is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ---------------------------------------------------------------------------------------------
# Submission (login node)


def slurm_params(cfg) -> dict:
    """SlurmExecutor's parameters, in sbatch's names, from cluster.*; empty values are left to the cluster's defaults.
    The submission and the dry run's script are both made from this one dict."""
    c = cfg.cluster
    image = [a.format(image=c.container_image) for a in c.container_srun_args] if c.container_image else []
    p = dict(job_name=cfg.name, nodes=c.num_nodes, ntasks_per_node=c.tasks_per_node,
             gpus_per_node=c.gpus_per_node or None, cpus_per_task=c.cpus_per_task or None,
             mem=f"{c.mem_gb}GB" if c.mem_gb else None, time=c.time_min, partition=c.partition or None,
             account=c.account or None, qos=c.qos or None, constraint=c.constraint or None,
             setup=list(c.setup) or None, srun_args=image + [str(a) for a in c.extra_srun] or None,
             additional_parameters=dict(c.extra_sbatch) or None)
    return {k: v for k, v in p.items() if v is not None}


def check_job(launcher, overrides: list[str], num: int) -> tuple[str, tuple[str, str]]:
    """Compose one job's config as its node will, and run the guard rails on it here (exit 2 on a failure); returns
    the job's plan (with dry_run=true, else "") and its MLflow store and experiment."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
    with open_dict(cfg):
        cfg.hydra.job.num = num
        cfg.hydra.runtime.output_dir = str(Path(cfg.hydra.sweep.dir) / str(cfg.hydra.sweep.subdir))
    HydraConfig.instance().set_config(cfg)  # ${hydra:...} in the job's config reads this job's values
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])  # what the task gets, as in run_job
    OmegaConf.set_readonly(job, False)
    try:
        guards.validate(job)
        store = (tracking.tracking_uri(job), job.name)
        if job.dry_run:
            from molt.actor.planner import run_plan  # torch + transformers: only for a dry run

            return f"molt dry run: job {num} ({' '.join(overrides) or job.name})\n{run_plan(job)}", store
        return "", store
    finally:
        HydraConfig.instance().set_config(launcher.config)


def sbatch_script(folder: Path, python: str, params: dict, num_jobs: int) -> str:
    """The sbatch script `SlurmExecutor(folder, python=python)` with `params` submits for `num_jobs` jobs (an array
    when several), made without the executor, which refuses to exist where `srun` is missing: a dry run works anywhere.
    submitit has no public call for it, so this is Molt's one use of its private API: `_make_sbatch_string` (what the
    executor writes its script with) and the command of `SlurmExecutor._submitit_command_str`. submitit is pinned
    exactly; tests/test_dry_run.py and tests/cluster (the dry run's script is the one submitted) catch a change."""
    from submitit.slurm.slurm import _make_sbatch_string

    command = f"{python} -u -m submitit.core._submit {shlex.quote(str(folder))}"
    return _make_sbatch_string(command=command, folder=folder, map_count=num_jobs if num_jobs > 1 else None, **params)


def launch(launcher, job_overrides, initial_job_idx: int):
    """Check every job, then submit them as one array (or print its sbatch script with dry_run=true)."""
    import submitit
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobReturn, JobStatus

    cfg = launcher.config
    nums = [initial_job_idx + i for i in range(len(job_overrides))]
    plans, stores = zip(*[check_job(launcher, list(o), num) for o, num in zip(job_overrides, nums)])
    folder = Path(launcher.params["submitit_folder"]).expanduser().absolute()  # as submitit's Executor keeps it
    python = cfg.cluster.python or shlex.quote(sys.executable)  # SlurmExecutor's default, passed to it as well
    params = slurm_params(cfg)
    done = [JobReturn(overrides=list(o), status=JobStatus.COMPLETED) for o in job_overrides]
    if cfg.dry_run:
        print(*plans, sep="\n")
        print(f"molt dry run: {len(done)} Slurm job(s) pass the guard rails; sbatch script (nothing submitted):")
        print(sbatch_script(folder, python, params, len(done)))
        return done
    Path(str(cfg.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    for uri, name in dict.fromkeys(stores):  # here, once: jobs that start together would race to create them
        tracking.create_experiment(uri, name)
    if os.environ.get("RAY_AUTH_MODE", "token") == "token":  # the jobs' Ray clusters (allocation) accept only
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))  # this token: in the job's environment only
    args = [(list(o), "hydra.sweep.dir", n, f"job_id_for_{n}", Singleton.get_state()) for o, n in zip(job_overrides, nums)]
    executor = submitit.SlurmExecutor(folder, max_num_timeout=cfg.cluster.max_requeue, python=python)
    executor.update_parameters(**params)
    jobs = executor.map_array(launcher, *zip(*args))
    for job, overrides in zip(jobs, job_overrides):
        print(f"molt: submitted Slurm job {job.job_id} ({' '.join(overrides) or cfg.name})\n"
              f"  log     {job.paths.stdout}\n"
              f"  follow  tail -f {shlex.quote(str(job.paths.stdout))}   squeue -j {job.job_id}   scancel {job.job_id}")
    sys.stdout.flush()
    if cfg.cluster.wait:
        wait(jobs)
    return done


def wait(jobs, poll_s: float = 2.0) -> None:
    """Until every job has left the queue (a requeued job stays in it); exit 1 unless each one succeeded."""
    from hydra.core.utils import JobStatus

    array = jobs[0].job_id.split("_")[0]
    while subprocess.run(["squeue", "-h", "-j", array], capture_output=True, text=True).stdout.strip():
        time.sleep(poll_s)
    for job in jobs:
        if all(job.task(t).paths.result_pickle.exists() for t in range(job.num_tasks)):
            failed = [r for r in job.results() if r.status == JobStatus.FAILED]
            if not failed:
                continue
            try:
                failed[0].return_value  # Hydra re-raises the job's own exception here
            except Exception as e:
                print(f"molt: Slurm job {job.job_id} failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}; "
                      f"see {job.paths.stdout}", file=sys.stderr)
            sys.exit(1)
        state = subprocess.run(["scontrol", "show", "job", "-o", job.job_id], capture_output=True, text=True).stdout
        state = next((w for w in state.split() if w.startswith("JobState=")), "JobState=?")
        print(f"molt: Slurm job {job.job_id} ended without a result ({state}); see {job.paths.stdout} and "
              f"{job.paths.stderr}", file=sys.stderr)
        sys.exit(1)
