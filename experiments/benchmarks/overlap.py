"""Async vs synchronous: how much of generation hides behind training.

Runs the quickstart experiment twice (rollout.max_lag=1, then max_lag=0: synchronous on-policy)
and prints per-step means from the runs' MLflow records, skipping the first steps (warm-up):

    python experiments/benchmarks/overlap.py --steps 40 --skip 5 [extra overrides...]

overlap efficiency = step time / max(generate, train): 1.0 means the shorter of the two hid
completely behind the longer; other = share of the step outside waiting for generation,
training and weight sync.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import mlflow

KEYS = ["time/step", "time/generate", "time/wait", "time/train", "time/sync", "time/other", "reward/mean"]


def run_one(out: Path, max_lag: int, steps: int, extra: list[str]) -> dict[str, list[float]]:
    cmd = [sys.executable, "-m", "molt", "experiment=quickstart", f"rollout.max_lag={max_lag}",
           f"train.steps={steps}", "eval.every=0", f"hydra.run.dir={out}", f"checkpoint_dir={out}/ckpt", *extra]
    subprocess.run(cmd, check=True)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    return {k: [m.value for m in sorted(client.get_metric_history(run.info.run_id, k), key=lambda m: m.step)]
            for k in KEYS}


def summarize(hist: dict[str, list[float]], skip: int) -> dict[str, float]:
    mean = {k: sum(v[skip:]) / max(len(v[skip:]), 1) for k, v in hist.items()}
    mean["overlap"] = mean["time/step"] / max(mean["time/generate"], mean["time/train"])
    mean["other_share"] = mean["time/other"] / mean["time/step"]
    return mean


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=5)
    args, extra = p.parse_known_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for lag in (1, 0):
            hist = run_one(Path(tmp) / f"lag{lag}", lag, args.steps, extra)
            rows.append((f"max_lag={lag}", summarize(hist, args.skip)))
    cols = ["time/step", "time/generate", "time/wait", "time/train", "time/sync", "overlap", "other_share"]
    print("| mode | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, m in rows:
        print(f"| {name} | " + " | ".join(f"{m[c]:.3f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
