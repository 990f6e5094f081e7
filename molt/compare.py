"""Compare MLflow runs: a table on the terminal and PNG plots, one line per run.

    molt-compare outputs/quickstart/multirun/2026-12-04_10-00-00       # a sweep's directory (its mlflow.db)
    molt-compare --uri sqlite:///path/mlflow.db --experiment quickstart  # every run of an experiment
    molt-compare --uri sqlite:///path/mlflow.db --runs RUN_ID RUN_ID     # chosen runs

Writes <out>/table.txt and <out>/<metric>.png (against step and wall time); for a sweep the plots are also
logged as artifacts of a `compare` run tagged with the sweep.
"""
from __future__ import annotations

import argparse
from pathlib import Path

PLOTS = {"reward": "reward/mean", "eval_reward": "eval/reward", "loss": "loss/policy",
         "mismatch": "mismatch/logprob_abs_mean", "staleness": "staleness/mean",
         "throughput": "throughput/tokens_per_s"}


def select(client, experiment: str | None, sweep: str | None, run_ids: list[str]):
    """The runs to compare: chosen ids, else a sweep's runs (tag molt.sweep), else an experiment's."""
    if run_ids:
        return [client.get_run(r) for r in run_ids]
    exps = [client.get_experiment_by_name(experiment)] if experiment else client.search_experiments()
    if None in exps:
        raise SystemExit(f"molt-compare: no experiment {experiment!r} in this store")
    query = f"tags.`molt.sweep` = '{sweep}'" if sweep else ""
    runs = client.search_runs([e.experiment_id for e in exps], query, order_by=["attributes.start_time ASC"])
    return [r for r in runs if "molt.compare" not in r.data.tags]


def overrides(run) -> dict[str, str]:
    return dict(o.split("=", 1) for o in run.data.tags.get("molt.overrides", "").split() if "=" in o)


def differing(runs) -> dict[str, list[str]]:
    """The overrides whose values are not the same in every run."""
    per_run = [overrides(r) for r in runs]
    cols = {k: [o.get(k, "-") for o in per_run] for k in sorted({k for o in per_run for k in o})}
    return {k: v for k, v in cols.items() if len(set(v)) > 1}


def row(history: dict[str, list]) -> dict[str, str]:
    mean = lambda key: sum(m.value for m in history[key]) / len(history[key]) if history[key] else float("nan")  # noqa: E731
    reward, evals = history["reward/mean"], history["eval/reward"]
    return {"steps": str(len(reward)), "final reward": f"{reward[-1].value:.3f}" if reward else "-",
            "best reward": f"{max(m.value for m in reward):.3f}" if reward else "-",
            "eval reward": f"{evals[-1].value:.3f}" if evals else "-", "s/step": f"{mean('time/step'):.2f}",
            "tokens/s": f"{mean('throughput/tokens_per_s'):.0f}", "mismatch": f"{mean('mismatch/logprob_abs_mean'):.1e}"}


def table(runs, histories) -> str:
    diff = differing(runs)
    rows = [{"run": r.info.run_name or r.info.run_id[:8], **row(h), **{k: v[i] for k, v in diff.items()}}
            for i, (r, h) in enumerate(zip(runs, histories))]
    cols = list(rows[0])
    width = {c: max(len(c), *(len(x[c]) for x in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols)] + ["  ".join(x[c].ljust(width[c]) for c in cols) for x in rows]
    return "\n".join(lines)


def plot(runs, histories, out: Path) -> list[Path]:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no figure to close

    labels = [" ".join(f"{k}={v[i]}" for k, v in differing(runs).items()) or r.info.run_name for i, r in enumerate(runs)]
    paths = []
    for name, key in PLOTS.items():
        fig = Figure(figsize=(10, 3.5))
        by_step, by_time = fig.subplots(1, 2)
        for run, hist, label in zip(runs, histories, labels):
            points = hist[key]
            by_step.plot([m.step for m in points], [m.value for m in points], ".-", label=label)
            by_time.plot([(m.timestamp - run.info.start_time) / 1000 for m in points], [m.value for m in points], ".-")
        by_step.set(xlabel="step", ylabel=key)
        by_time.set(xlabel="wall time (s)")
        by_step.legend(fontsize="small")
        fig.tight_layout()
        paths.append(out / f"{name}.png")
        fig.savefig(paths[-1])
    return paths


def compare(uri: str, out: Path, experiment: str | None = None, sweep: str | None = None,
            run_ids: list[str] = ()) -> str:
    import mlflow

    client = mlflow.MlflowClient(uri)
    runs = select(client, experiment, sweep, list(run_ids))
    if not runs:
        raise SystemExit(f"molt-compare: no runs found in {uri}")
    histories = [{k: sorted(client.get_metric_history(r.info.run_id, k), key=lambda m: m.step)
                  for k in {*PLOTS.values(), "time/step"}} for r in runs]
    out.mkdir(parents=True, exist_ok=True)
    text = table(runs, histories)
    (out / "table.txt").write_text(text + "\n")
    paths = plot(runs, histories, out)
    if sweep:  # the plots belong to the sweep as a whole: one run that holds them
        tags = {"molt.sweep": sweep, "molt.compare": "true"}
        run = client.create_run(runs[0].info.experiment_id, run_name="compare", tags=tags)
        for p in [out / "table.txt", *paths]:
            client.log_artifact(run.info.run_id, str(p))
        client.set_terminated(run.info.run_id)
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="molt-compare", description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", nargs="?", help="a sweep's directory: its mlflow.db and its runs")
    ap.add_argument("--uri", help="MLflow tracking URI (default: sqlite:///<sweep_dir>/mlflow.db)")
    ap.add_argument("--experiment", help="compare this experiment's runs")
    ap.add_argument("--runs", nargs="*", default=[], help="compare these run ids")
    ap.add_argument("--out", help="where table.txt and the PNGs go (default: <sweep_dir>/compare or ./compare)")
    a = ap.parse_args(argv)
    sweep = str(Path(a.sweep_dir).resolve()) if a.sweep_dir else None
    uri = a.uri or (f"sqlite:///{Path(sweep) / 'mlflow.db'}" if sweep else None)
    if uri is None:
        ap.error("give a sweep directory or --uri")
    out = Path(a.out or (Path(sweep) / "compare" if sweep else "compare"))
    print(compare(uri, out, a.experiment, sweep, a.runs))
    print(f"plots: {out}/")


if __name__ == "__main__":
    main()
