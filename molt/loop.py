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

from molt import checkpoint, guards, tracking
from molt.actor.actor import Actor, load_model, segment_logprobs
from molt.algo.advantages import NEEDS, compute_advantages, gae_raw, token_table, untable
from molt.algo.critic import Critic
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
    actor = make_actor(cfg, model_dir)
    helpers = load_helpers(cfg, model_dir)  # a teacher (opd) or a critic (gae), else nothing
    clients = [EngineClient(e.name, e.url, cfg.engine.request_timeout_s) for e in engines]
    start, position = restore(cfg, actor, helpers.get("critic"))
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
        segments, advantages, adv_metrics, returns = prepare(groups, cfg, helpers)
        metrics = actor.train_step(segments, advantages, cfg.rollout.temperature)
        metrics |= train_critic(helpers, segments, returns)
        t_train = time.time() - t0 - t_wait
        sync_s, probe = aio.run_until_complete(sync_and_verify(clients, actor, segments[0], version + 1, cfg))
        version += 1
        worker.grant.remote(len(groups))  # after the sync: the next groups start on the new weights
        dump_rollouts(cfg, groups, advantages, step)
        metrics |= maybe_eval(cfg, worker, step)
        maybe_save(cfg, actor, worker, step, helpers.get("critic"))
        step_s = time.time() - t0
        metrics |= adv_metrics | step_metrics(groups, counts, version, t_wait, t_train, sync_s, probe, step_s)
        tracking.log_metrics(metrics, step)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{step_s:.2f}")
    aio.run_until_complete(close_all(clients))


def make_actor(cfg, model_dir: Path):
    """One in-process Actor for world size 1 (the reference path); else a group of ranks on the (dp, ep, cp) mesh."""
    if cfg.cluster.actor_ranks > 1:
        from molt.actor.group import ActorGroup

        return ActorGroup(cfg, model_dir)
    return Actor(str(model_dir), cfg.train, cfg.model.dtype, is_correction=cfg.is_correction)


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
    """Pop groups until `groups_per_step` usable ones are in hand; drop stale and failed ones, and (filter.enabled)
    groups whose rewards are all equal. A dropped group's credit goes back at once (its replacement starts on the
    current weights)."""
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
        elif ok and cfg.filter.enabled and len({r.reward for r in ok}) == 1:
            counts["filtered"] += 1  # no signal: every group baseline gives it zero advantages
            check_filter_budget(counts["filtered"], cfg)
        elif ok:
            group.rollouts = ok
            kept.append(group)
            continue
        worker.grant.remote(1)
    return kept, counts


def check_filter_budget(dropped: int, cfg) -> None:
    limit = cfg.filter.max_drop_factor * cfg.train.groups_per_step
    if dropped > limit:
        raise RuntimeError(f"filter.enabled: {dropped} groups with all-equal rewards while filling one step (limit "
                           f"filter.max_drop_factor x train.groups_per_step = {limit:g}): the task gives this policy "
                           "no signal; check the reward, or set filter.enabled=false or raise filter.max_drop_factor")


def load_helpers(cfg, model_dir: Path) -> dict:
    """Models the estimator needs beside the actor (`NEEDS`): a frozen teacher for opd, a critic for gae."""
    make = {"teacher": lambda: load_teacher(cfg), "critic": lambda: Critic(model_dir, cfg)}
    return {need: make[need]() for need in NEEDS.get(cfg.estimator.name, ())}


def load_teacher(cfg):
    msg = guards.opd_teacher(cfg, {})  # again: the student may have been built after the guards ran
    if msg:
        raise guards.GuardError(msg)
    return load_model(cfg.estimator.teacher_path, cfg.model.dtype, "sdpa", "cpu", trainable=False)


def token_inputs(rollouts, segments, helpers: dict, cfg) -> dict:
    """Per-token (R, L) tables for token estimators: generated-token mask, behaviour (= student) log-probs, and the
    teacher's log-probs or the critic's values when those models are loaded."""
    out = {"mask": token_table(rollouts, [s.loss_mask for s in segments]),
           "student_logp": token_table(rollouts, [s.logprobs for s in segments])}
    if "teacher" in helpers:
        lp = segment_logprobs(helpers["teacher"], segments, cfg.rollout.temperature, cfg.train, "cpu")
        out["teacher_logp"] = token_table(rollouts, lp)
    if "critic" in helpers:
        out["values"] = token_table(rollouts, helpers["critic"].values(segments))
    return out


def prepare(groups, cfg, helpers: dict | None = None):
    """Advantages from the estimator: per rollout, broadcast to every token of every segment, or per token.
    Also the critic's lambda-returns per segment when there is a critic (else None)."""
    rollouts = [r for g in groups for r in g.rollouts]
    segments = [s for r in rollouts for s in r.segments]
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    group_ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.rollouts])
    tables = token_inputs(rollouts, segments, helpers or {}, cfg)
    adv = compute_advantages(cfg.estimator, rewards, group_ids, **tables)  # (R,) or (R, L)
    if adv.ndim == 1:  # every segment gets its rollout's advantage
        per_segment = [a for r, a in zip(rollouts, adv.tolist()) for _ in r.segments]
        adv = adv[:, None].expand_as(tables["mask"])  # (R, L)
    else:
        per_segment = untable(rollouts, adv)
    returns = None
    if "values" in tables:  # the critic's targets: lambda-returns A + V (before whitening)
        est, v = cfg.estimator, tables["values"]
        returns = untable(rollouts, gae_raw(rewards, v, tables["mask"], est.gamma, est.lam) + v)
    return segments, per_segment, batch_metrics(rewards, adv, tables), returns


def batch_metrics(rewards, adv, tables: dict) -> dict:
    """Reward per rollout; advantages (R, L) averaged over generated tokens; opd's reverse-KL estimate."""
    mask = tables["mask"]
    mean = lambda x: ((x * mask).sum() / mask.sum()).item()  # noqa: E731
    metrics = {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
               "advantage/mean": mean(adv), "advantage/abs_mean": mean(adv.abs())}
    if "teacher_logp" in tables:  # sampled estimate of KL(student || teacher) per generated token
        metrics["opd/reverse_kl"] = mean(tables["student_logp"] - tables["teacher_logp"])
    return metrics


def train_critic(helpers: dict, segments, returns) -> dict:
    return helpers["critic"].train_step(segments, returns) if "critic" in helpers else {}


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
            "filter/dropped": counts["filtered"],
            "filter/dropped_frac": counts["filtered"] / (counts["filtered"] + len(groups)),
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


def maybe_save(cfg, actor, worker, step: int, critic=None) -> None:
    done = step + 1
    if done == cfg.train.steps or (cfg.train.save_every and done % cfg.train.save_every == 0):
        checkpoint.save(cfg.checkpoint_dir, done, actor.state_dict(), ray.get(worker.position.remote()),
                        critic_state=critic.state_dict() if critic else None)


def restore(cfg, actor, critic=None) -> tuple[int, int]:
    """(step, data position) to start from: 0, 0 unless resume=true."""
    if not cfg.resume:
        return 0, 0
    path = checkpoint.latest(cfg.checkpoint_dir)
    if path is None:
        raise FileNotFoundError(f"resume=true but no checkpoint in {cfg.checkpoint_dir} (set checkpoint_dir)")
    state = checkpoint.load(path)
    actor.load_state_dict(state["actor"])
    if critic is not None:
        if "critic" not in state:
            raise ValueError(f"resume=true with estimator=gae but {path} holds no critic: it was not a gae run")
        critic.load_state_dict(state["critic"])
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
