"""The rollout worker: a Ray actor running an asyncio pool of agent rollouts (either agent mode, molt/agents/).

It keeps prompt groups in flight and holds every finished group until the loop takes it (`take`: one Ray call
for all it holds) while the actor trains. Admission is by credits: it starts a group only while it holds a credit;
the loop hands a credit back for every group it popped, after the weight sync that follows. So at most
(max_lag + 1) * groups_per_step groups exist between two syncs, which bounds how stale a trained token can be
(max_lag=0 is synchronous on-policy RL).

Engines that die: the router reports an engine's first failure, as (name, incarnation), and the loop takes the
reports with the groups (or with `downs` while it evaluates); the driver replaces the engine (molt/fleet.py; or
stops the run past engine.max_restarts) and calls `engine_up`; the rollouts that were on it start again from
scratch, those not yet started wait for a live engine.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import time
import traceback

import ray
from omegaconf import OmegaConf

from molt.agents import load_agent, run_group
from molt.config import AgentConfig
from molt.data import DataStream, load_jsonl
from molt.rollout.engine import EngineClient
from molt.rollout.router import Router
from molt.types import EngineDied

STOP_S = 30.0  # stop(): how long the cancelled tasks' cleanup (an agent CLI's process tree killed, ...) may take


def sampling_params(rollout_cfg, temperature=None) -> dict:
    t = rollout_cfg.temperature if temperature is None else temperature
    return {"temperature": t, "top_p": rollout_cfg.top_p, "top_k": rollout_cfg.top_k}


@ray.remote(num_cpus=0)
class RolloutWorker:
    def __init__(self, cfg, engines: list[EngineClient], model_dir: str, initial_credits: int, retry: bool = False):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.retry = retry  # the driver replaces dead engines: rollouts on one start again
        # clients pickle as (name, url, timeout, key): fresh connections here
        self.router = Router(engines, seed=cfg.rollout.seed, on_down=self._engine_down if self.retry else None,
                             sticky=cfg.rollout.sticky)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.agent = load_agent(cfg.agent.mode, importlib.import_module(cfg.agent.module))
        self.agent_cfg = AgentConfig(**OmegaConf.to_container(cfg.agent))  # read per turn: plain attributes are cheap
        self.stream = DataStream(load_jsonl(cfg.task.train_path), seed=cfg.seed)
        self.credits, self.wake = initial_credits, asyncio.Event()
        self.task = None
        self.outbox, self.down = [], []  # finished groups (or an error), engines seen failing: not taken yet
        self.ready = asyncio.Event()

    async def start(self, position: int = 0) -> None:
        self.stream.skip_to(position)
        self.task = asyncio.create_task(self._run())

    async def grant(self, n: int) -> None:
        self.credits += n
        self.wake.set()

    async def stop(self) -> None:
        """Cancel everything this worker runs (admission, rollouts in flight, their engine requests) and wait for it
        to end, before the actor is killed."""
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for t in tasks:
            t.cancel()
        if tasks:  # bounded: the actor is killed next whatever a task's cleanup still awaits
            await asyncio.wait(tasks, timeout=STOP_S)

    def _engine_down(self, name: str, epoch: int) -> None:
        self.down.append((name, epoch))
        self.ready.set()

    async def downs(self) -> list[tuple[str, int]]:
        """The engines seen failing since the last take (or call), as (name, incarnation)."""
        down, self.down = self.down, []
        return down

    async def engine_up(self, name: str) -> None:
        await self.router.up(name)

    async def _run(self) -> None:
        inflight: set[asyncio.Task] = set()
        try:
            while True:
                while self.credits > 0 and len(inflight) < self.cfg.rollout.max_inflight_groups:
                    self.credits -= 1
                    inflight.add(asyncio.create_task(self._group(*self.stream.next())))
                self.wake.clear()
                waker = asyncio.create_task(self.wake.wait())
                done, _ = await asyncio.wait(inflight | {waker}, return_when=asyncio.FIRST_COMPLETED)
                waker.cancel()
                for t in done - {waker}:
                    inflight.discard(t)
                    t.result()  # an engine failure surfaces here
        except Exception as e:  # report to the loop, which shuts everything down
            err = e if isinstance(e, EngineDied) else RuntimeError(f"rollout worker failed:\n{traceback.format_exc()}")
            self._emit(("error", err))
            for t in inflight:
                t.cancel()

    def _run_group(self, sample: dict, group_id: str, n: int, sampling: dict):
        return run_group(self.cfg.agent.mode, self.router, self.tokenizer, self.agent, sample, group_id, n,
                         self.agent_cfg, sampling, release=self.router.release, retry=self.retry)

    async def _group(self, index: int, sample: dict):
        t0 = time.time()
        group = await self._run_group(sample, f"g{index}", self.cfg.rollout.n, sampling_params(self.cfg.rollout))
        group.index = index
        group.timing = (t0, time.time())
        self._emit(("group", group))

    def _emit(self, item) -> None:
        self.outbox.append(item)
        self.ready.set()

    async def take(self, timeout_s: float) -> tuple[list, list[tuple[str, int]]]:
        """Every finished item (("group", g), or ("error", e)) and every engine seen failing, not taken yet, once
        there is one or after timeout_s: the loop's one call per batch of groups (molt/loop.py Popper). Ray queues
        between the two cost a call to put, calls to get, and processes that copied every group twice
        (docs/step_cost.md, "The groups' handoff")."""
        if not self.outbox and not self.down:
            self.ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ready.wait(), timeout_s)
        items, self.outbox = self.outbox, []
        return items, await self.downs()

    async def evaluate(self, path: str, max_samples: int, temperature: float) -> dict:
        """Mean reward of one greedy (temperature 0) rollout per held-out sample; as reward/mean in training, failed
        rollouts are left out of the mean and counted (eval/failed)."""
        rows = load_jsonl(path)[:max_samples]
        sampling = sampling_params(self.cfg.rollout, temperature)
        groups = await asyncio.gather(*(self._run_group(row, f"eval{i}", 1, sampling) for i, row in enumerate(rows)))
        rollouts = [r for g in groups for r in g.rollouts]
        rewards = [r.reward for r in rollouts if r.status != "failed"]
        return {"eval/reward": sum(rewards) / max(len(rewards), 1), "eval/samples": float(len(rollouts)),
                "eval/failed": float(len(rollouts) - len(rewards))}
