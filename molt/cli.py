"""The `molt` command: compose the run with Hydra, check the guard rails, then plan or train.

    molt experiment=quickstart                 # train (molt.loop.run)
    molt experiment=quickstart dry_run=true    # print the processes, layout, model and batch; start nothing
    molt --cfg job model=tiny_moe              # print the composed run (a Hydra flag)
    molt -m estimator=grpo rollout.n=4,8       # sweep, one Hydra job per combination

A config error prints one line, `molt: config error: <message>`, and exits with code 2. A run logs its plan,
a line of metrics every train.log_every steps, warnings, failures and its summary, on the terminal and in
<output_dir>/molt.log (Hydra's job log; conf/config.yaml sets its format).
"""
from __future__ import annotations

import logging
import os
import signal
import sys

import hydra
from omegaconf import DictConfig

from molt import guards
from molt.config import REPO, register

# Ray reads its auth mode once, when it is first imported: the per-run token auth of a local run (molt/loop.py
# ray_session) needs it set before then, in the driver too, or the driver cannot talk to its own cluster
os.environ.setdefault("RAY_AUTH_MODE", "token")
log = logging.getLogger(__name__)


def task(cfg: DictConfig) -> None:
    guards.validate(cfg)
    from molt.actor.planner import run_plan  # torch + transformers: the meta model on a fake process group

    if cfg.dry_run:
        print(f"molt dry run: {cfg.name} (nothing started)\n{run_plan(cfg)}")
        return
    from molt.cluster import allocation
    from molt.loop import Interrupted, run  # heavy imports (torch, vllm, ray) only for a real run
    from molt.tracking import TERMINATED, on_sigterm
    from molt.types import EngineDied

    signal.signal(signal.SIGTERM, on_sigterm)  # unwinds like Ctrl-C, engines that are still starting included
    logging.captureWarnings(True)  # Python warnings go to the run log too
    try:
        with allocation(cfg) as runs_the_loop:  # on Slurm: Ray on every task, the loop on task 0
            if runs_the_loop:
                log.info(f"molt: {cfg.name}, output in {cfg.output_dir}\n{run_plan(cfg)}")
                run(cfg)
    except EngineDied as e:  # everything is shut down by now; the last checkpoint is intact
        log.error(f"molt: {e} (engine log under {cfg.output_dir}/engines/; resume=true continues from "
                  "the last checkpoint)")
        sys.exit(1)
    except KeyboardInterrupt as e:  # Ctrl-C: everything is shut down by now, the MLflow run marked KILLED
        log.warning(f"molt: {e}" if isinstance(e, Interrupted) else "molt: interrupted before training started")
        sys.exit(130)
    except Exception:  # Hydra would print the traceback on the terminal only: the run log keeps it too
        if TERMINATED:  # SIGTERM landed in code that turned it into its own exception (a checkpoint being written)
            log.warning("molt: terminated (SIGTERM); resume=true continues from the last checkpoint")
            sys.exit(128 + signal.SIGTERM)
        log.exception("molt: the run failed")
        sys.exit(1)


# An absolute path: under `python -m molt` Hydra would otherwise look for a `conf` Python package.
_app = hydra.main(config_path=str(REPO / "conf"), config_name="config", version_base=None)(task)


def main() -> None:
    register()  # the schemas must be in Hydra's ConfigStore before it composes
    _app()
