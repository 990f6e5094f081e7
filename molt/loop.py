"""The main job: one asynchronous RL loop over vLLM engines, a Ray queue and the policy actor.

    python -m molt experiment=quickstart

Rollout workers generate groups into a Ray queue while the actor trains; after every optimizer
step the weights go to the engines (verified with a log-prob probe) and the worker gets back a
credit for every group it trained (after the sync) or dropped (at once), which bounds staleness
by `rollout.max_lag`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import Counter
from pathlib import Path
from queue import Empty

import ray
import torch
from omegaconf import OmegaConf
from ray.util.queue import Queue

from molt import checkpoint, tracking
from molt.actor.actor import Actor
from molt.algo.advantages import compute_advantages
from molt.assets import ensure_model
from molt.config import derived
from molt.rollout.engine import EngineClient, EngineDied, launch_engines, sync_weights, verify_sync
from molt.rollout.worker import RolloutWorker


def run(cfg) -> None:
    """Start engines, Ray and MLflow; train; always tear everything down (exit, Ctrl-C, crash)."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # plain values, picklable for Ray
    model_dir = ensure_model(cfg.model.path, cfg.model.build)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine request otherwise
    with contextlib.ExitStack() as stack:
        engines = stack.enter_context(launch_engines(cfg.engine, model_dir, Path(cfg.output_dir) / "engines"))
        stack.enter_context(ray_session(cfg))
        stack.enter_context(tracking.mlflow_run(cfg, derived(cfg)))
        train(cfg, model_dir, engines)


def train(cfg, model_dir: Path, engines) -> None:
    aio = asyncio.new_event_loop()
    actor = Actor(str(model_dir), cfg.train, cfg.model.dtype)
    clients = [EngineClient(e.name, e.url, cfg.engine.request_timeout_s) for e in engines]
    start, position = restore(cfg, actor)
    version = start
    if start:  # the engines still serve the initial weights: give them the restored ones
        aio.run_until_complete(sync_weights(clients, actor.export_weights(), version, cfg.engine.sync_dir))
    queue = Queue()
    credits = min((cfg.rollout.max_lag + 1) * cfg.train.groups_per_step, cfg.rollout.max_inflight_groups)
    worker = RolloutWorker.remote(cfg, [(e.name, e.url) for e in engines], queue, str(model_dir), credits)
    ray.get(worker.start.remote(position))
    bar = tracking.progress(start, cfg.train.steps)
    for step in bar:
        t0 = time.time()
        groups, counts = collect(queue, engines, cfg, version, worker)
        t_wait = time.time() - t0
        segments, advantages, adv_metrics = prepare(groups, cfg)
        metrics = actor.train_step(segments, advantages, cfg.rollout.temperature)
        t_train = time.time() - t0 - t_wait
        sync_s, probe = aio.run_until_complete(sync_and_verify(clients, actor, segments[0], version + 1, cfg))
        version += 1
        worker.grant.remote(len(groups))  # after the sync: the next groups start on the new weights
        dump_rollouts(cfg, groups, advantages, step)
        metrics |= maybe_eval(cfg, worker, step)
        maybe_save(cfg, actor, worker, step)
        step_s = time.time() - t0
        metrics |= adv_metrics | step_metrics(groups, counts, version, t_wait, t_train, sync_s, probe, step_s)
        tracking.log_metrics(metrics, step)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{step_s:.2f}")
    aio.run_until_complete(close_all(clients))


@contextlib.contextmanager
def ray_session(cfg):
    """A local Ray instance bound to loopback (a Slurm launcher connects to its cluster instead)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False, log_to_driver=True,
                 _node_ip_address="127.0.0.1")
    try:
        yield
    finally:
        if started:
            ray.shutdown()


async def close_all(clients) -> None:
    await asyncio.gather(*(c.aclose() for c in clients))


def next_item(queue, engines):
    """Block on the queue, checking every two seconds that every engine is still alive."""
    while True:
        try:
            return queue.get(timeout=2.0)
        except Empty:
            for e in engines:
                if not e.alive():
                    raise EngineDied(e.name, "the engine process exited; see its log under engines/")


def collect(queue, engines, cfg, version: int, worker):
    """Pop groups until `groups_per_step` usable ones are in hand; drop stale and failed ones.
    A dropped group's credit goes back at once (its replacement starts on the current weights)."""
    kept, counts = [], Counter()
    budget = 10 * cfg.train.groups_per_step * cfg.rollout.n  # bound: a task that always fails stops the run
    while len(kept) < cfg.train.groups_per_step:
        kind, group = next_item(queue, engines)
        if kind == "error":
            raise group  # EngineDied, or the worker's own failure with its traceback
        ok = [r for r in group.rollouts if r.status != "failed"]
        counts["failed"] += len(group.rollouts) - len(ok)
        if counts["failed"] > budget:
            raise RuntimeError(f"{counts['failed']} rollouts failed in one step: check agent.module")
        if group.min_version >= 0 and version - group.min_version > cfg.rollout.max_lag:
            counts["stale"] += 1
        elif ok:
            group.rollouts = ok
            kept.append(group)
            continue
        worker.grant.remote(1)
    return kept, counts


def prepare(groups, cfg):
    """Per-rollout advantages from the estimator, broadcast to every token of every segment."""
    rollouts = [r for g in groups for r in g.rollouts]
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    group_ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.rollouts])
    adv = compute_advantages(cfg.estimator, rewards, group_ids).tolist()
    segments = [s for r in rollouts for s in r.segments]
    per_segment = [a for r, a in zip(rollouts, adv) for _ in r.segments]  # every segment gets its rollout's
    metrics = {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
               "advantage/mean": sum(adv) / len(adv), "advantage/abs_mean": sum(map(abs, adv)) / len(adv)}
    return segments, per_segment, metrics


async def sync_and_verify(clients, actor, probe_segment, version: int, cfg):
    """Push the new weights to every engine, then check one engine's log-probs on a probe sequence."""
    seconds = await sync_weights(clients, actor.export_weights(), version, cfg.engine.sync_dir)
    ids = probe_segment.token_ids
    expected = actor.logprobs([probe_segment], cfg.rollout.temperature)[0][1:]
    diff = await verify_sync(clients[0], ids, expected, tol=1e-3)
    return seconds, diff


def step_metrics(groups, counts, version, t_wait, t_train, t_sync, probe, step_s) -> dict:
    rollouts = [r for g in groups for r in g.rollouts]
    generated = sum(s.num_generated for r in rollouts for s in r.segments)
    starts, ends = zip(*(g.timing for g in groups))
    return {"staleness/mean": sum(version - 1 - g.min_version for g in groups) / len(groups),
            "rollout/failed": counts["failed"], "rollout/stale_dropped": counts["stale"],
            "rollout/truncated": sum(r.status == "truncated" for r in rollouts),
            "rollout/gen_tokens_mean": generated / len(rollouts),
            "sync/probe_abs_max": probe, "time/step": step_s, "time/wait": t_wait,
            "time/generate": max(ends) - min(starts), "time/train": t_train, "time/sync": t_sync,
            "time/other": step_s - t_wait - t_train - t_sync, "throughput/tokens_per_s": generated / step_s,
            "version": version}


def maybe_eval(cfg, worker, step: int) -> dict:
    last = step + 1 == cfg.train.steps
    if not cfg.eval.every or (step % cfg.eval.every and not last):
        return {}
    t0 = time.time()
    out = ray.get(worker.evaluate.remote(cfg.task.eval_path, cfg.eval.max_samples, cfg.eval.temperature))
    return out | {"time/eval": time.time() - t0}


def maybe_save(cfg, actor, worker, step: int) -> None:
    done = step + 1
    if done == cfg.train.steps or (cfg.train.save_every and done % cfg.train.save_every == 0):
        checkpoint.save(cfg.checkpoint_dir, done, actor.state_dict(), ray.get(worker.position.remote()))


def restore(cfg, actor) -> tuple[int, int]:
    """(step, data position) to start from: 0, 0 unless resume=true."""
    if not cfg.resume:
        return 0, 0
    path = checkpoint.latest(cfg.checkpoint_dir)
    if path is None:
        raise FileNotFoundError(f"resume=true but no checkpoint in {cfg.checkpoint_dir} (set checkpoint_dir)")
    state = checkpoint.load(path)
    actor.load_state_dict(state["actor"])
    return state["step"], state["data_position"]


def dump_rollouts(cfg, groups, advantages, step: int) -> None:
    """Append every trained group as JSONL lines (one per rollout); format in the README."""
    if not cfg.train.dump_rollouts:
        return
    out = Path(cfg.train.dump_rollouts)
    out.mkdir(parents=True, exist_ok=True)
    adv = iter(advantages)
    with open(out / "rollouts.jsonl", "a") as f:
        for g in groups:
            for r in g.rollouts:
                segs = [{"token_ids": s.token_ids, "loss_mask": s.loss_mask, "logprobs": s.logprobs,
                         "versions": s.versions, "advantage": next(adv),
                         "routed_experts": None if s.routed_experts is None else s.routed_experts.tolist()}
                        for s in r.segments]
                f.write(json.dumps({"step": step, "group_id": g.group_id, "rollout_id": r.rollout_id,
                                    "reward": r.reward, "status": r.status, "info": r.info, "segments": segs}) + "\n")
