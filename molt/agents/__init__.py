"""Agent modes, by `agent.mode`: what the user's `agent.module` must define, and the runner of one rollout.

Adding a mode = one runner (`run_rollout(generate, tokenizer, agent, sample, rollout_id, group_id, agent_cfg, sampling,
release) -> Rollout`) and one `MODES` entry; `run_group` runs a prompt group of any mode. A runner returns its rollout
(status ok or truncated) or raises: RolloutFailed when the agent's code failed it, EngineDied when an engine did.
run_group does the rest one way for every mode: the failure bookkeeping, the segment checks and the token counts.
"""
from __future__ import annotations

import asyncio
import logging
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from molt.agents import images
from molt.agents.chat_agent import run_chat_rollout
from molt.agents.env import run_env_rollout
from molt.agents.verifiers import run_verifiers_rollout
from molt.types import EngineDied, Group, Rollout, RolloutFailed

log = logging.getLogger(__name__)
# times a rollout whose engine failed (EngineDied) starts again before it fails: engine deaths are bounded by
# engine.max_restarts, but an engine that answers one request with a 5xx every time (a render that always fails on
# this sample's images) would otherwise loop the rollout forever
RESTARTS = 3


@dataclass(frozen=True)
class Mode:
    entry: str  # the callable agent.module must define
    run_rollout: Callable
    contract: str  # where the contract of `entry` is written down


MODES = {"env": Mode("make_env", run_env_rollout, "molt/agents/env.py"),
         "chat": Mode("run_agent", run_chat_rollout, "molt/agents/chat_agent.py"),
         # the agent is the verifiers environment agent.verifiers names; the module is Molt's bridge to it
         "verifiers": Mode("run_verifiers_rollout", run_verifiers_rollout, "molt/agents/verifiers.py")}


def load_agent(mode: str, module: Any) -> Callable:
    """The entry point of an imported agent.module, checked (for the rollout pool and the guard rails)."""
    m = MODES[mode]
    fn = getattr(module, m.entry, None)
    if not callable(fn):
        raise AttributeError(f"agent.mode={mode} needs agent.module={module.__name__} to define {m.entry} "
                             f"(see {m.contract} and the README's agent sections)")
    return fn


async def run_group(mode: str, generate, tokenizer, agent: Callable, sample: dict, group_id: str, n: int, agent_cfg,
                    sampling: dict, release: Callable[[str], None] | None = None, retry: bool = False) -> Group:
    """n rollouts of one sample, concurrently; rollout ids are f"{group_id}/{i}". With `retry` (engines are replaced
    when they die: molt/fleet.py), a rollout whose engine died starts again from scratch: its partial trajectory is
    discarded and info["retried"] counts the restarts, at most RESTARTS, after which it fails; otherwise
    EngineDied propagates."""
    run = MODES[mode].run_rollout

    async def one(i: int):
        attempt = 0
        while True:
            try:
                ro = await run(generate, tokenizer, agent, sample, f"{group_id}/{i}", group_id, agent_cfg, sampling,
                               release)
            except RolloutFailed as e:
                ro = _failed(e)
            except EngineDied as e:
                if not retry:
                    raise
                if attempt < RESTARTS:
                    attempt += 1
                    log.info("rollout %s/%d: %s; starting it again", group_id, i, e)
                    continue
                ro = _failed(RolloutFailed(Rollout(f"{group_id}/{i}", group_id),
                                           f"its engine failed it {RESTARTS + 1} times, the last: {e}"))
            ro.info["retried"] = float(attempt)
            return _checked(ro)

    return Group(group_id=group_id, sample=sample, rollouts=list(await asyncio.gather(*(one(i) for i in range(n)))))


def where(e: BaseException | None) -> str:
    """" (file:line)" of the innermost frame an exception was raised in (for one-line failure reports)."""
    tb = traceback.extract_tb(e.__traceback__) if e is not None else []
    return f" ({tb[-1].filename}:{tb[-1].lineno})" if tb else ""


def _failed(e: RolloutFailed) -> Rollout:
    """The rollout as far as it got, failed: reward 0.0, the reason in one line (the loop logs one line per kind and
    step; the traceback is at debug level here)."""
    ro = e.rollout
    log.debug("rollout %s failed: %s", ro.rollout_id, e, exc_info=e.__cause__)
    ro.status, ro.reward, ro.error, ro.info["failed"] = "failed", 0.0, f"{e}{where(e.__cause__)}", 1.0
    if e.image:
        ro.info[f"failed/image_{e.image}"] = 1.0
    return ro


def _checked(ro: Rollout) -> Rollout:
    """Every segment checked, without the engine's image tensors (the actor recomputes pixels), and counted."""
    for seg in ro.segments:
        images.detach(seg)
        seg.check()
    ro.info.update(gen_tokens=float(sum(s.num_generated for s in ro.segments)),
                   tokens=float(sum(len(s.token_ids) for s in ro.segments)))
    return ro
