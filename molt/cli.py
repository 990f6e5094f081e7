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
from molt.assets import hf_config, model_facts
from molt.config import REPO, derived, register

# Ray reads its auth mode once, when it is first imported: the per-run token auth of a local run (molt/loop.py
# ray_session) needs it set before then, in the driver too, or the driver cannot talk to its own cluster
os.environ.setdefault("RAY_AUTH_MODE", "token")
log = logging.getLogger(__name__)


def describe_model(cfg, hf: dict) -> str:
    f = model_facts(hf)
    kind = f"MoE {f.experts} experts, top-{f.top_k}" if f.experts else "dense"
    return (f"{cfg.model.name}: {hf.get('architectures', ['?'])[0]}, {hf['num_hidden_layers']} layers, hidden "
            f"{hf['hidden_size']}, head_dim {f.head_dim}, {kind} (exact parameter count: the memory plan below)")


def plan(cfg) -> str:
    """What a run would start, in a few lines."""
    from molt.rollout.engine import server_cmd  # the launcher's own command line, not a copy

    f, r, t, e = cfg.fsdp, cfg.rollout, cfg.train, cfg.engine
    d = derived(cfg)
    device = f"{cfg.cluster.gpus_per_node} GPUs/node" if cfg.cluster.gpus_per_node else "cpu"
    env = "" if cfg.cluster.gpus_per_node else f"VLLM_CPU_KVCACHE_SPACE={e.kv_cache_gb} "
    source = f"built by recipe {cfg.model.build!r} if missing" if cfg.model.build else "existing directory"
    lines = ["processes",
             "  driver      this process: the loop, advantages, weight sync, MLflow",
             *(f"  engine {i}    {env}python -m vllm.entrypoints.openai.api_server "
               + " ".join(server_cmd(e, cfg.model.path, e.base_port + i if e.base_port else "<free>",
                                     f"<0700 dir>/engine{i}.sock" if e.uds else "")[3:])
               for i in range(e.num_engines)),
             f"  rollout     agent.mode={cfg.agent.mode} ({cfg.agent.module}), up to {r.max_inflight_groups} groups in flight",
             f"  actor       {d['world_size']} rank(s) on {device} x {cfg.cluster.num_nodes} node(s)",
             f"layout        dp {f.dp_size} x ep {f.ep_size} x cp {f.cp_size} = world size {d['world_size']}, "
             f"offload {f.offload}",
             f"model         {describe_model(cfg, hf_config(cfg.model))}",
             f"              {cfg.model.path} ({source})",
             f"estimator     {cfg.estimator.name}",
             f"batch         {t.groups_per_step} groups x {r.n} samples = {d['samples_per_step']} rollouts/step, "
             f"max_lag {r.max_lag}, temperature {r.temperature}",
             f"steps         {t.steps}, lr {t.lr}, eval every {cfg.eval.every or 'never'}, weight sync {e.sync}"]
    from molt.actor.planner import dry_run_text  # torch + transformers: the meta model on a fake process group

    return "\n".join(lines + [dry_run_text(cfg)])


def task(cfg: DictConfig) -> None:
    guards.validate(cfg)
    if cfg.dry_run:
        print(f"molt dry run: {cfg.name} (nothing started)\n{plan(cfg)}")
        return
    from molt.cluster import allocation
    from molt.loop import Interrupted, run  # heavy imports (torch, vllm, ray) only for a real run
    from molt.types import EngineDied

    # SIGTERM (a scheduler, `kill`) unwinds like Ctrl-C, so every `finally` stops what it started,
    # engines included, even while they are still starting
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    logging.captureWarnings(True)  # Python warnings go to the run log too
    try:
        with allocation(cfg) as runs_the_loop:  # on Slurm: Ray on every task, the loop on task 0
            if runs_the_loop:
                log.info(f"molt: {cfg.name}, output in {cfg.output_dir}\n{plan(cfg)}")
                run(cfg)
    except EngineDied as e:  # everything is shut down by now; the last checkpoint is intact
        log.error(f"molt: {e} (engine log under {cfg.output_dir}/engines/; resume=true continues from "
                  "the last checkpoint)")
        sys.exit(1)
    except KeyboardInterrupt as e:  # Ctrl-C: everything is shut down by now, the MLflow run marked KILLED
        log.warning(f"molt: {e}" if isinstance(e, Interrupted) else "molt: interrupted before training started")
        sys.exit(130)
    except Exception:  # Hydra would print the traceback on the terminal only: the run log keeps it too
        log.exception("molt: the run failed")
        sys.exit(1)


# An absolute path: under `python -m molt` Hydra would otherwise look for a `conf` Python package.
_app = hydra.main(config_path=str(REPO / "conf"), config_name="config", version_base=None)(task)


def main() -> None:
    register()  # the schemas must be in Hydra's ConfigStore before it composes
    _app()
