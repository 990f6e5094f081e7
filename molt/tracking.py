"""MLflow tracking and the terminal progress bar.

One MLflow run per Hydra job: the resolved config as params and as an artifact, metrics every
step. The default store is a SQLite database under the run's output directory, so a run is
self-contained: `mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db`.
"""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from omegaconf import OmegaConf
from tqdm import tqdm


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


@contextlib.contextmanager
def mlflow_run(cfg, extra_params: dict):
    """Start the run, or with resume=true continue the one its checkpoints came from (`checkpoint_dir/mlflow_run.json`
    names its store and id). Ctrl-C or SIGTERM marks it KILLED, another exception FAILED; if the driver is SIGKILLed,
    the reaper (molt/reaper.py, started here) marks it KILLED and stops what the driver left running."""
    import mlflow

    from molt import reaper

    logging.getLogger("alembic").setLevel(logging.WARNING)
    out, marker = Path(cfg.output_dir), Path(cfg.checkpoint_dir) / "mlflow_run.json"
    out.mkdir(parents=True, exist_ok=True)
    previous = json.loads(marker.read_text()) if cfg.resume and marker.exists() else {}
    uri = previous.get("uri") or cfg.mlflow_uri or f"sqlite:///{out / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(cfg.name)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    with mlflow.start_run(run_id=previous.get("run_id"), run_name=None if previous else out.name) as run:
        if not previous:  # a continued run keeps its first params: MLflow refuses changed values
            params = {**_flatten(resolved), **extra_params}
            items = [(k, str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):  # MLflow takes at most 100 params per call
                mlflow.log_params(dict(items[i:i + 100]))
            mlflow.log_dict(resolved, "config.yaml")
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"uri": uri, "run_id": run.info.run_id}))
        try:
            with reaper.watching(uri, run.info.run_id):
                yield run
        except (KeyboardInterrupt, SystemExit):
            mlflow.end_run("KILLED")
            raise


def log_metrics(metrics: dict, step: int) -> None:
    import mlflow

    mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)


def progress(start: int, total: int):
    return tqdm(range(start, total), initial=start, total=total, desc="molt", unit="step", dynamic_ncols=True)
