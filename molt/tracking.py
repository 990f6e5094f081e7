"""MLflow tracking and the terminal progress bar.

One MLflow run per Hydra job: the resolved config as params and as an artifact, metrics every
step. The default store is a SQLite database under the run's output directory, so a run is
self-contained: `mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db`.
"""
from __future__ import annotations

import contextlib
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
    """Start the run; on an exception the run is marked FAILED and the exception propagates."""
    import mlflow

    logging.getLogger("alembic").setLevel(logging.WARNING)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(cfg.mlflow_uri or f"sqlite:///{out / 'mlflow.db'}")
    mlflow.set_experiment(cfg.name)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    with mlflow.start_run(run_name=out.name) as run:
        params = {**_flatten(resolved), **extra_params}
        items = [(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per call
            mlflow.log_params(dict(items[i:i + 100]))
        mlflow.log_dict(resolved, "config.yaml")
        yield run


def log_metrics(metrics: dict, step: int) -> None:
    import mlflow

    mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)


def progress(start: int, total: int):
    return tqdm(range(start, total), initial=start, total=total, desc="molt", unit="step", dynamic_ncols=True)
