"""The main job: one asynchronous RL loop over vLLM engines, a rollout worker and the policy actor.

    python -m molt experiment=quickstart

The rollout worker generates groups, which the loop takes over Ray, while the actor trains; after every optimizer
step the weights go to the engines (verified with a log-prob probe) and the worker gets back a
credit for every group it trained (after the sync) or dropped (at once), which bounds staleness
by `rollout.max_lag`.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import signal
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import mlflow
import ray
import torch
from ray._private import ray_constants
from omegaconf import OmegaConf
from tqdm.contrib.logging import logging_redirect_tqdm

from molt import checkpoint, cluster, dump, guards, net, reaper, tracking, view
from molt.actor.group import run_actor
from molt.agents.pool import RolloutWorker
from molt.algo.advantages import ESTIMATORS, compute_advantages, helper_targets, token_tables, untable
from molt.assets import ensure_model
from molt.config import derived
from molt.fleet import Fleet
from molt.rollout.engine import launch_engines, wait_ready
from molt.types import Segment

log = logging.getLogger(__name__)


def run(cfg) -> None:
    """Start engines, Ray and MLflow; train; always tear everything down (exit, Ctrl-C, crash)."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # plain values, picklable for Ray
    model_dir = ensure_model(cfg.model.path, cfg.model.build)
    guards.check(cfg)  # again, now that the model exists: guards that read it (e.g. the opd teacher's tokenizer)
    if cfg.cluster.gpus_per_node == 0 and (cfg.model.master or "bfloat16" in (cfg.engine.dtype, cfg.model.dtype)):
        flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
        if not {"avx512_bf16", "amx_bf16"} & set(flags):
            log.warning("bf16 on a CPU without bf16 instructions (avx512_bf16, amx_bf16): torch and vLLM emulate "
                        "it, far slower than fp32 (a 2048x576x1536 matmul: 131x on an AVX2 CPU); precision=bf16 "
                        "pays only where the CPU has them")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine request otherwise
    with contextlib.ExitStack() as stack:
        stack.enter_context(logging_redirect_tqdm())  # log lines print above the progress bar, not into it
        tmp = stack.enter_context(reaper.private_tmp())  # the run's temporary files, Ray's and the engines'
        replaying = bool(cfg.train.replay_rollouts)  # no engine, no rollout worker: Ray only for actor ranks
        if not replaying or ranked(cfg):
            stack.enter_context(ray_session(tmp))
        engines = None if replaying else stack.enter_context(launch_engines(  # started: train waits for them
            cfg.engine, model_dir, Path(cfg.output_dir) / "engines", cfg.cluster.engine_tasks,
            cfg.cluster.gpus_per_node > 0, tmp, wait=False))
        stack.enter_context(tracking.mlflow_run(cfg, derived(cfg), resume_run=cluster.requeued()))  # with the reaper (molt/reaper.py)
        stop = stack.enter_context(stop_on_interrupt())
        replay(cfg, model_dir, stop) if replaying else train(cfg, model_dir, engines, stop)


def train(cfg, model_dir: Path, engines, stop: threading.Event) -> None:
    actor = make_actor(cfg, model_dir)  # while the engines start (their start is mostly one core importing vLLM)
    with Fleet(engines, cfg, actor) as fleet:  # syncs engines, replaces those that die; closed however the run ends
        version, position = restore(cfg, actor)
        popper = Popper()
        fleet.worker = worker = RolloutWorker.options(**net.on_task(0)).remote(  # its process starts meanwhile too
            cfg, list(fleet.clients.values()), str(model_dir), credits(cfg), retry=True)
        wait_ready(engines, cfg.engine.startup_timeout_s)
        if version or cfg.engine.sync == "adapter":  # the engines serve the initial weights (adapter: not the policy)
            fleet.sync(version)
        ray.get(worker.start.remote(position))
        bar, clock = tracking.progress(version, cfg.train.steps), Clock()
        for step in bar:
            tracking.exit_if_terminated()  # a SIGTERM a library swallowed stops the run here at the latest
            failed = []  # this step's failed rollouts, not trained, shown on its page
            with clock("wait"):
                fleet.check()  # engines that died or failed a request: replaced here, and while no group comes
                groups, counts = collect(lambda: popper.pop(worker, fleet, stop), cfg, version, worker.grant.remote,
                                         failed)
            if groups is None:  # Ctrl-C: stop between two steps, where the state is consistent
                raise Interrupted(step, save(cfg, step, actor, position, model_dir) if step else None,
                                  cfg.checkpoint_dir)
            position += counts["groups"]
            prep, metrics = learn(cfg, actor, groups, step, clock)
            with clock("sync"):  # max_lag >= 1: overlapped with the next step (its probe is reported with the next)
                last = step + 1 == cfg.train.steps  # no credits after it: nothing starts only to be cancelled
                probe = fleet.sync(version + 1, prep.segments[0], wait=cfg.rollout.max_lag == 0,
                                   then=None if last else functools.partial(worker.grant.remote, len(groups)))
            version += 1  # the next groups run on the new weights: their credits go back at the sync's pause (fleet.py)
            metrics |= ({} if probe is None else {"sync/probe_abs_max": probe}) | maybe_eval(cfg, worker, fleet, step)
            metrics |= {"engine/restarts": fleet.total}
            if tracking.line_due(step, cfg.train.steps, cfg.train.log_every):  # /metrics is 50 KB: read as often as the
                metrics |= fleet.cache_metrics()  # run log's line; the hit rate covers the steps since the last read
            report(cfg, bar, step, version, metrics, prep, groups, failed, counts, clock, actor, model_dir)
            maybe_save(cfg, actor, position, step, model_dir)  # after the log: a kill in between repeats a step
        fleet.settle()
        ray.get(worker.stop.remote(), timeout=60)  # its tasks cancelled: ray.kill is asynchronous, and an actor that
        ray.kill(worker)  # Ray's shutdown ends first reports every task it left pending as destroyed


def replay(cfg, model_dir: Path, stop: threading.Event) -> None:
    """train.replay_rollouts=DIR: train on a dump's steps in order (molt/dump.py), with their behaviour log-probs and
    versions, without generating: no engine, no rollout worker (Ray only for an actor of several ranks). Advantages
    come from the run's estimator. The data position is the number of dumped steps replayed: resume=true goes on with
    the next one."""
    source = dump.path_of(cfg.train.replay_rollouts)
    entries = dump.index(source)
    actor = make_actor(cfg, model_dir)
    version, position = restore(cfg, actor)
    if version + len(entries) - position < cfg.train.steps:
        log.warning("replay: %s holds %d steps, %d of them left: training %d steps, not train.steps=%d", source,
                    len(entries), len(entries) - position, version + len(entries) - position, cfg.train.steps)
        cfg.train.steps = version + len(entries) - position
    bar, clock = tracking.progress(version, cfg.train.steps), Clock()
    for step in bar:
        tracking.exit_if_terminated()
        if stop.is_set():  # Ctrl-C: stop between two steps
            raise Interrupted(step, save(cfg, step, actor, position, model_dir) if step else None, cfg.checkpoint_dir)
        with clock("wait"):
            groups, failed = dump.read_step(source, entries[position])
        position += 1
        prep, metrics = learn(cfg, actor, groups, step, clock)
        report(cfg, bar, step, step + 1, metrics, prep, groups, failed, Counter(failed=len(failed)), clock, actor,
               model_dir)
        maybe_save(cfg, actor, position, step, model_dir)


def learn(cfg, actor, groups, step: int, clock: Clock) -> tuple[Prepared, dict]:
    """Advantages, then one optimizer step of the policy and of its trainable helpers (time/train)."""
    with clock("train"):
        prep = prepare(groups, cfg, actor)
        metrics = actor.train_step(prep.segments, prep.advantages, cfg.rollout.temperature, view.due(cfg, step))
        metrics |= actor.train_helpers(prep.segments, prep.helper_targets)
    return prep, metrics


def report(cfg, bar, step: int, version: int, metrics: dict, prep: Prepared, groups, failed, counts, clock: Clock,
           actor, model_dir) -> None:
    """The step's records (dump, page), its metrics to MLflow and the run log, and the progress bar."""
    with clock("view"):
        kept = actor.kept_logprobs() if view.due(cfg, step) else None
        record(cfg, groups, failed, prep.advantages, step, kept, model_dir)
    metrics |= prep.metrics | rollout_metrics(groups, counts, version) | clock.metrics()
    metrics["throughput/tokens_per_s"] = metrics["rollout/gen_tokens"] / metrics["time/step"]
    tracking.log_metrics(metrics, step, cfg.train.steps, cfg.train.log_every)
    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{metrics['time/step']:.2f}")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, handled between two steps: `step` steps are done, `path` holds them (None: no step ran)."""

    def __init__(self, step: int, path, checkpoint_dir: str):
        super().__init__(step, path, checkpoint_dir)
        self.step, self.path, self.checkpoint_dir = step, path, checkpoint_dir

    def __str__(self) -> str:
        where = f"checkpoint at {self.path}" if self.path else "no step finished, no checkpoint"
        return (f"interrupted at step {self.step}; {where}; to continue, run the same command with resume=true "
                f"(checkpoint_dir={self.checkpoint_dir})")


@contextlib.contextmanager
def stop_on_interrupt():
    """The first Ctrl-C (SIGINT) asks the loop to stop between two steps; a second one interrupts at once."""
    asked = threading.Event()

    def handler(signum, frame):
        if asked.is_set():
            raise KeyboardInterrupt
        asked.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield asked
    finally:
        signal.signal(signal.SIGINT, previous)


def credits(cfg) -> int:
    """Groups the worker may start before the first step: the staleness bound, (max_lag + 1) steps' worth."""
    return min((cfg.rollout.max_lag + 1) * cfg.train.groups_per_step, cfg.rollout.max_inflight_groups)


class Clock:
    """Wall time of each step's named phases (time/<phase>), of the whole step (time/step: since the previous step's
    metrics were taken, so its logging and checkpoint count in the next step) and of the rest (time/other)."""

    def __init__(self):
        self.start, self.phases = time.time(), {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.time()
        yield
        self.phases[phase] = self.phases.get(phase, 0.0) + time.time() - t0

    def metrics(self) -> dict[str, float]:
        """This step's times; the next step's start now."""
        now, phases = time.time(), self.phases
        step, self.start, self.phases = now - self.start, now, {}
        return {f"time/{k}": v for k, v in phases.items()} | {"time/step": step,
                                                             "time/other": step - sum(phases.values())}


def make_actor(cfg, model_dir: Path):
    """One in-process Actor for world size 1 on CPU (the reference path); else a group of ranks on the (dp, ep, cp)
    mesh, each on its own GPU when the cluster has GPUs (one rank too, on its GPU: fp32 masters in the optimizer)."""
    if ranked(cfg):
        from molt.actor.group import ActorGroup

        return ActorGroup(cfg, model_dir)
    return run_actor(cfg, model_dir)


def ranked(cfg) -> bool:
    """Whether the actor is a group of ranks (Ray actors), not one Actor in this process."""
    return derived(cfg)["world_size"] > 1 or cfg.cluster.gpus_per_node > 0


@contextlib.contextmanager
def ray_session(tmp: str):
    """A local Ray instance of our own, reachable only by this user: token auth with a per-process token (in the
    environment of its processes, never written to disk), every listener on loopback, and its session directory
    (sockets, logs) inside `tmp`, a 0700 directory (molt/reaper.py private_tmp). A Slurm launcher connects to its
    cluster instead."""
    started, on_sigterm = not ray.is_initialized(), signal.getsignal(signal.SIGTERM)
    saved = {k: os.environ.get(k) for k in _RAY_ENV} | {"cluster": ray_constants.ENABLE_RAY_CLUSTER}
    if started and os.environ.get("MOLT_RAY_ADDRESS"):  # the job's Ray cluster on Slurm (molt.cluster.allocation)
        ray.init(address=os.environ["MOLT_RAY_ADDRESS"], log_to_driver=True)
    elif started:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        os.environ.setdefault("RAY_AUTH_TOKEN", _TOKEN)
        # Ray moves a node off loopback (`_node_ip_address="127.0.0.1"` included) unless it believes clusters are
        # off, as on macOS: then every Ray server binds 127.0.0.1. Ray reads the variable when it is imported, so the
        # driver's copy of it is set too (ray_constants.ENABLE_RAY_CLUSTER); its processes read the variable
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
        # Ray opens its temp dir to everyone (0777) as it starts, and again as later processes start: so it lives
        # inside a 0700 directory of ours, which Ray never touches
        # Ray's processes (the actor, the rollout worker, the agents' code) inherit the raylet's environment: their
        # temporary files go to `tmp` too. Only theirs: the reaper, started later, sweeps the real TMPDIR
        # address="local": always a fresh instance of our own; never attach to another Ray cluster on the host
        outer = {k: os.environ.get(k) for k in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
        os.environ.update(reaper.private_env(tmp))
        try:
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False,
                     log_to_driver=True, _temp_dir=os.path.join(tmp, "ray"))
        finally:
            _restore(outer)
    signal.signal(signal.SIGTERM, on_sigterm)  # ray.init's crash handler takes SIGTERM and aborts the driver
    try:
        yield
    finally:
        if started:
            ray.shutdown()
            # what this process starts next (another run in a test, a Slurm job it submits, whose `ray start` on a
            # second task would refuse to join a cluster) must not inherit this instance's settings
            ray_constants.ENABLE_RAY_CLUSTER = saved.pop("cluster")
            _restore(saved)


def _restore(saved: dict) -> None:
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.update({k: v})


_RAY_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")  # ray_session sets them
# One per process: Ray's token loader keeps the first token it read, so the next session in this process (a local
# sweep's next job) must use it too, or its driver is refused by its own cluster
_TOKEN = secrets.token_hex(32)


class Popper:
    """The rollout worker's finished items, one at a time, fetched in bulk: all it holds in one call
    (RolloutWorker.take), with the engines it saw failing. What one step leaves is the next one's."""

    def __init__(self):
        self.held: deque = deque()

    def pop(self, worker, fleet: Fleet, stop: threading.Event | None = None):
        """The next item; waits for the worker's next one, replacing engines that die meanwhile (or stopping the run:
        engine.max_restarts) every 2 s without one; ("stop", None) once `stop` is set (Ctrl-C)."""
        while not self.held:
            tracking.exit_if_terminated()
            if stop is not None and stop.is_set():
                return "stop", None
            items, down = ray.get(worker.take.remote(2.0))
            self.held.extend(items)
            fleet.reported.extend(down)
            if not self.held:
                fleet.check()
        return self.held.popleft()


def collect(pop, cfg, version: int, refund, failed: list | None = None):
    """Pop groups until `groups_per_step` usable ones are in hand; drop stale and failed ones, and (filter.enabled)
    groups whose rewards are all equal. A dropped group's credit is refunded at once, so that its replacement
    starts on the current weights and the step can still fill (with max_lag=0 every credit is needed). The failed
    rollouts are appended to `failed` (for the step's records)."""
    kept, counts, why = [], Counter(), Counter()  # counts: groups consumed, rollouts failed/retried, groups dropped
    budget = 10 * cfg.train.groups_per_step * cfg.rollout.n  # bound: a task that always fails stops the run
    while len(kept) < cfg.train.groups_per_step:
        kind, group = pop()
        if kind == "stop":
            return None, counts
        if kind == "error":
            raise group  # EngineDied, or the worker's own failure with its traceback
        counts["groups"] += 1  # consumed (trained or dropped): the data position a checkpoint resumes from
        ok = [r for r in group.rollouts if r.status != "failed"]
        counts["failed"] += len(group.rollouts) - len(ok)
        counts["retried"] += sum(r.info.get("retried", 0.0) > 0 for r in group.rollouts)
        why.update(r.error or "(no reason given)" for r in group.rollouts if r.status == "failed")
        if failed is not None:
            failed += [r for r in group.rollouts if r.status == "failed"]
        if counts["failed"] > budget:
            raise RuntimeError(f"{counts['failed']} rollouts failed in one step, most often: {why.most_common(1)[0][0]}")
        if group.min_version >= 0 and version - group.min_version > cfg.rollout.max_lag:
            counts["stale"] += 1
        elif ok and cfg.filter.enabled and len({r.reward for r in ok}) == 1:
            counts["filtered"] += 1  # no signal: every group baseline gives it zero advantages
            check_filter_budget(counts["filtered"], cfg)
        elif ok:
            group.rollouts = ok
            kept.append(group)
            continue
        refund(1)
    for reason, n in why.items():  # one line per kind of failure, not a traceback per rollout
        log.warning("step %d: %d rollout(s) failed: %s", version, n, reason)
    return sorted(kept, key=lambda g: g.index), counts  # in data order, whichever finished first: reproducible


def check_filter_budget(dropped: int, cfg) -> None:
    limit = cfg.filter.max_drop_factor * cfg.train.groups_per_step
    if dropped > limit:
        raise RuntimeError(f"filter.enabled: {dropped} groups with all-equal rewards while filling one step (limit "
                           f"filter.max_drop_factor x train.groups_per_step = {limit:g}): the task gives this policy "
                           "no signal; check the reward, or set filter.enabled=false or raise filter.max_drop_factor")


@dataclass
class Prepared:
    """One step's training input: segments, their advantages, and per-token targets of trainable helpers."""

    segments: list[Segment]
    advantages: list  # per segment: one float, or one per token
    helper_targets: dict[str, list[list[float]]]  # helper -> per segment, per token (e.g. the gae critic's returns)
    metrics: dict[str, float]


def prepare(groups, cfg, actor=None) -> Prepared:
    """Advantages from the estimator: per rollout, broadcast to every token of every segment, or per token (with
    per-token inputs from the helper models its registry entry names, scored by the actor)."""
    rollouts = [r for g in groups for r in g.rollouts]
    segments = [s for r in rollouts for s in r.segments]
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
    group_ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.rollouts])
    est = ESTIMATORS[cfg.estimator.name]
    scores = actor.score(segments, list(est.helpers), cfg.rollout.temperature) if est.helpers else {}
    tables = token_tables(est, rollouts, scores)
    adv = compute_advantages(cfg.estimator, rewards, group_ids, **tables)  # (R,) or (R, L)
    if adv.ndim == 1:  # every segment gets its rollout's advantage
        per_segment = [a for r, a in zip(rollouts, adv.tolist()) for _ in r.segments]
        adv = adv[:, None].expand_as(tables["mask"])  # (R, L)
    else:
        per_segment = untable(rollouts, adv)
    targets = helper_targets(cfg.estimator, rewards, group_ids, **tables)
    return Prepared(segments, per_segment, {n: untable(rollouts, t) for n, t in targets.items()},
                    batch_metrics(rewards, adv, tables["mask"]) | est.metrics(tables))


def batch_metrics(rewards, adv, mask) -> dict:
    """Reward per rollout; advantages (R, L) averaged over generated tokens (mask (R, L))."""
    mean = lambda x: ((x * mask).sum() / mask.sum()).item()  # noqa: E731
    return {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "advantage/mean": mean(adv), "advantage/abs_mean": mean(adv.abs())}


def rollout_metrics(groups, counts, version: int) -> dict:
    rollouts = [r for g in groups for r in g.rollouts]
    generated = sum(s.num_generated for r in rollouts for s in r.segments)
    starts, ends = zip(*(g.timing for g in groups))
    versions = [v for r in rollouts for s in r.segments for v, m in zip(s.versions, s.loss_mask) if m]
    return {"staleness/mean": sum(version - 1 - g.min_version for g in groups) / len(groups),  # oldest token per group
            "staleness/token_mean": sum(version - 1 - v for v in versions) / max(len(versions), 1),
            "rollout/failed": counts["failed"], "rollout/stale_dropped": counts["stale"],
            "rollout/retried": counts["retried"],
            "rollout/truncated": sum(r.status == "truncated" for r in rollouts),
            "rollout/cut": sum(r.info.get("cut", 0.0) > 0 for r in rollouts),  # chat: a reply cut by a budget
            "filter/dropped": counts["filtered"],
            "filter/dropped_frac": counts["filtered"] / (counts["filtered"] + len(groups)),
            "rollout/gen_tokens_mean": generated / len(rollouts), "rollout/gen_tokens": generated,
            "time/generate": max(ends) - min(starts), "version": version}


def maybe_eval(cfg, worker, fleet: Fleet, step: int) -> dict:
    last = step + 1 == cfg.train.steps
    if not cfg.eval.every or (step % cfg.eval.every and not last):
        return {}
    t0 = time.time()
    fleet.settle()  # the engines serve the weights just trained
    out = fleet.wait(worker.evaluate.remote(cfg.task.eval_path, cfg.eval.max_samples, cfg.eval.temperature))
    return out | {"time/eval": time.time() - t0}


def maybe_save(cfg, actor, position: int, step: int, model_dir) -> None:
    """`position`: groups consumed so far (trained or dropped); those still in flight are generated again on resume,
    so with max_lag=0 a resumed run trains exactly the groups an uninterrupted one would."""
    done = step + 1
    if done == cfg.train.steps or (cfg.train.save_every and done % cfg.train.save_every == 0):
        save(cfg, done, actor, position, model_dir)


def save(cfg, step: int, actor, position: int, model_dir) -> Path:
    mlflow.flush_async_logging()  # metrics go to MLflow on a thread (tracking.log_metrics): a checkpoint's are in it
    return checkpoint.save(cfg.checkpoint_dir, step, actor, position, model_dir)


def restore(cfg, actor) -> tuple[int, int]:
    """(step, data position) to start from: 0, 0 unless resume=true or a requeued Slurm job saved a checkpoint."""
    path = checkpoint.latest(cfg.checkpoint_dir)
    if not cfg.resume and not (cluster.requeued() and path):
        return 0, 0
    if path is None:
        raise FileNotFoundError(f"resume=true but no checkpoint in {cfg.checkpoint_dir} (set checkpoint_dir)")
    state = checkpoint.load(path, actor)  # any fsdp layout: the checkpoint reshards
    log.info("resume=true: continuing from %s (step %d, data position %d)", path, state["step"], state["data_position"])
    return state["step"], state["data_position"]


def record(cfg, groups, failed, advantages, step: int, kept, model_dir) -> None:
    """The step's rollouts as records (molt/view.py): appended to the dump (train.dump_rollouts), and on a page step
    (kept: the actor's log-probs the train step kept) shown on <output_dir>/view/step_N.html, an MLflow artifact."""
    if not cfg.train.dump_rollouts and kept is None:
        return
    records = view.records(groups, failed, advantages, step, kept, cfg.is_correction)
    if cfg.train.dump_rollouts:
        dump.append(cfg.train.dump_rollouts, records)
    if kept is not None:
        page = view.write(Path(cfg.output_dir) / "view", records, step, str(model_dir), cfg.view.max_tokens)
        mlflow.log_artifact(str(page), "view")
