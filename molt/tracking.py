"""MLflow tracking, the run's log lines and the terminal progress bar.

One MLflow run per Hydra job: the resolved config as params and as an artifact, metrics every
step. Every `train.log_every` steps a line of the main ones goes to the terminal and to the run's
log (<output_dir>/molt.log, Hydra's), and so does the summary at the end. The default store is a
SQLite database under the run's output directory, its artifacts beside it, so a run is self-contained:
`mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db`. The jobs of a sweep share one under
the sweep's directory and carry its tags (molt.sweep, molt.overrides), for `molt-compare`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf
from tqdm import tqdm

log = logging.getLogger(__name__)
# what a step's line shows (name in the line: MLflow key); `eval` only on the steps that evaluated
STEP_LINE = {"reward": "reward/mean", "eval": "eval/reward", "loss": "loss/policy",
             "mismatch": "mismatch/logprob_abs_max", "stale": "staleness/mean", "failed": "rollout/failed",
             "tok/s": "throughput/tokens_per_s", "s/step": "time/step"}
TERMINATED: list[int] = []  # the termination signal the driver received (cli.py), whatever exception it became


def on_sigterm(signum: int, _frame) -> None:
    """The driver's SIGTERM handler (cli.py): a scheduler's or `kill`'s SIGTERM unwinds like Ctrl-C, so every
    `finally` stops what it started, engines included, even while they are still starting."""
    TERMINATED.append(signum)
    sys.exit(128 + signum)


def exit_if_terminated() -> None:
    """SystemExit again where the driver waits or starts a step, if a SIGTERM came. Python runs a signal handler
    wherever the main thread is, and an exception it raises inside a weakref callback or a __del__ is printed
    ("Exception ignored in ...") and dropped: SQLAlchemy's `_collection_gced`, as MLflow created its tables, swallowed
    one, and the run trained on to its end (tests/test_loop.py)."""
    if TERMINATED:
        sys.exit(128 + TERMINATED[0])


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def sweep() -> dict:
    """Under a multirun (local or on Slurm): the sweep's directory, this job's number and its overrides."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return {}
    hc = HydraConfig.get()
    return {"molt.sweep": str(Path(hc.sweep.dir).resolve()), "molt.job_num": str(hc.job.num),
            "molt.overrides": " ".join(hc.overrides.task)}


def tracking_uri(cfg) -> str:
    """cfg.mlflow_uri, else a SQLite database in the run's directory; a sweep's jobs share one in the sweep's."""
    store = Path(sweep().get("molt.sweep") or cfg.output_dir)
    return cfg.mlflow_uri or f"sqlite:///{store / 'mlflow.db'}"


def create_experiment(uri: str, name: str) -> str:
    """The experiment's id; the store's tables and the experiment are created if missing, a SQLite store's with its
    artifacts beside it (<dir>/artifacts: MLflow's default is ./mlruns of the process that made the experiment). A
    Slurm sweep's launcher calls this before submitting: its jobs, started side by side, failed on the shared SQLite store (alembic: "Online
    migration expected to match one row") or would both create the experiment."""
    import mlflow

    logging.getLogger("alembic").setLevel(logging.WARNING)
    client = mlflow.MlflowClient(uri)
    if found := client.get_experiment_by_name(name):
        return found.experiment_id
    db = uri.removeprefix("sqlite:///")
    return client.create_experiment(name, Path(db).resolve().parent.joinpath("artifacts").as_uri() if db != uri else None)


@contextlib.contextmanager
def mlflow_run(cfg, extra_params: dict, resume_run: bool = False):
    """Start the run, or with resume=true (or resume_run: a requeued Slurm job) continue the one its checkpoints
    came from (`checkpoint_dir/mlflow_run.json` names its store and id). Ctrl-C or SIGTERM marks it KILLED, another exception FAILED; if the driver is SIGKILLed,
    the reaper (molt/reaper.py, started here) marks it KILLED and stops what the driver left running. A sweep's
    jobs share one store and carry the sweep's tags; at the end, a summary on the terminal."""
    import mlflow

    from molt import reaper

    out, marker = Path(cfg.output_dir), Path(cfg.checkpoint_dir) / "mlflow_run.json"
    out.mkdir(parents=True, exist_ok=True)
    previous = json.loads(marker.read_text()) if (cfg.resume or resume_run) and marker.exists() else {}
    uri = previous.get("uri") or tracking_uri(cfg)
    mlflow.set_tracking_uri(uri)
    # the logging thread writes what a second brought in one transaction: on the quickstart ~10 steps' metrics, about
    # half the CPU per step of a transaction each (experiments/benchmarks/step_cost.py); a flush (a checkpoint,
    # the run's end) writes them at once
    os.environ.setdefault("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "1")
    mlflow.set_experiment(experiment_id=create_experiment(uri, cfg.name))
    resolved = OmegaConf.to_container(cfg, resolve=True)
    with mlflow.start_run(run_id=previous.get("run_id"), run_name=None if previous else out.name,
                          tags=None if previous else sweep()) as run:
        if not previous:  # a continued run keeps its first params: MLflow refuses changed values
            params = {**_flatten(resolved), **extra_params}  # MLflow logs them in batches of 100
            mlflow.log_params({k: str(v)[:6000] for k, v in params.items()})  # values: at most 6000 characters
            mlflow.log_dict(resolved, "config.yaml")
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"uri": uri, "run_id": run.info.run_id}))
        try:
            with reaper.watching(uri, run.info.run_id):
                yield run
        except BaseException as e:  # a signal, even one a library turned into its own exception (torch's
            if isinstance(e, (KeyboardInterrupt, SystemExit)) or TERMINATED:  # checkpoint writer does)
                mlflow.end_run("KILLED")
            raise
    log.info(summary(cfg, uri, run.info.run_id))


def summary(cfg, uri: str, run_id: str) -> str:
    """Reward start -> end, eval, steps, wall time, and where the run's records (and its last page) are."""
    import mlflow

    client = mlflow.MlflowClient(uri)
    hist = lambda key: sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)  # noqa: E731
    reward, evals = hist("reward/mean"), hist("eval/reward")
    info = client.get_run(run_id).info
    wall = ((info.end_time or info.start_time) - info.start_time) / 1000
    steps = reward[-1].step + 1 if reward else 0  # a requeued job logs the steps after its checkpoint again
    lines = [f"molt: {cfg.name} done: {steps} steps in {wall:.0f} s"]
    if reward:
        lines.append(f"  reward  {reward[0].value:.3f} -> {reward[-1].value:.3f}"
                     + (f"   eval {evals[-1].value:.3f} (step {evals[-1].step})" if evals else ""))
    lines += [f"  mlflow  {uri}  (run {run_id})", f"  ckpt    {cfg.checkpoint_dir}",
              f"  open    mlflow ui --backend-store-uri {uri}"]
    pages = sorted((Path(cfg.output_dir) / "view").glob("step_*.html"))  # molt/view.py's trajectory pages
    if pages:
        lines.append(f"  view    {pages[-1]}  ({len(pages)} pages: molt-view {cfg.output_dir})")
    return "\n".join(lines)


def log_metrics(metrics: dict, step: int, total: int, every: int) -> None:
    """All of them to MLflow, written on MLflow's logging thread (40 ms a step on the quickstart, in the loop's
    thread; the run's end and every checkpoint wait for them); the main ones in a line of the run log at the first
    step, every `every` steps and the last (steps count from 0, as in MLflow and the loop's warnings)."""
    import mlflow

    mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step, synchronous=False)
    if line_due(step, total, every):
        log.info(f"step {step}  " + "  ".join(f"{n} {metrics[k]:.4g}" for n, k in STEP_LINE.items() if k in metrics))


def line_due(step: int, total: int, every: int) -> bool:
    """Whether step `step` of `total` gets a line in the run log (train.log_every = `every`)."""
    return bool(every and step % every == 0) or step + 1 == total


def progress(start: int, total: int):
    return tqdm(range(start, total), initial=start, total=total, desc="molt", unit="step", dynamic_ncols=True)
