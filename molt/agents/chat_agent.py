"""ChatAgent mode: existing OpenAI- or Anthropic-SDK agent code runs verbatim; Molt records its model calls.

The contract of a user module (`agent.mode=chat agent.module=experiments.calculator.agent`):

    def run_agent(ctx: ChatContext) -> float | tuple[float, dict[str, float]]
        # async, or sync (then it runs in a thread, so the blocking SDK clients work)
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        reply = await client.chat.completions.create(model=ctx.model, messages=ctx.messages, ...)
        # or client.responses.create(model=ctx.model, input=ctx.messages, ...) (the OpenAI Responses API)
        # or anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key)
        return reward                                  # optionally (reward, info)

Every rollout gets its own session on the worker's loopback chat server (chat_server.py); the
rollout's trajectory is what the server recorded: one segment, or several when the agent compacted
its context. All segments share the rollout's id and reward.

Status: "ok"; "truncated" when the server refused a request for a budget (agent.max_turns or
agent.max_total_tokens) -- if the agent then raised, its reward is 0.0 -- or when the agent raised
right after a reply that a budget cut (agent.max_tokens_per_turn, or the room left under
agent.max_total_tokens; reward 0.0); "failed" when the agent raised otherwise, returned something
that is not a reward, ran past agent.timeout_s, never called the model, or sent a request the
server refused as malformed (400/413, even if the agent caught the error). `Rollout.error` says why
in one line. A failure of the server or engine (not the agent's fault) propagates.
"""
from __future__ import annotations

import asyncio
import inspect
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from molt.agents.chat_server import close_session, open_session, shared_server
from molt.config import AgentConfig
from molt.types import Generate, Rollout, RolloutFailed

_THREADS = ThreadPoolExecutor(max_workers=256, thread_name_prefix="molt-chat-agent")  # sync agents; lazy threads


@dataclass
class ChatContext:
    """What an agent gets. Keys and URLs are valid for this rollout only."""

    base_url: str  # OpenAI SDK base_url (".../v1")
    anthropic_base_url: str  # Anthropic SDK base_url (the session root; the SDK adds "/v1/messages")
    api_key: str
    model: str
    sample: dict  # the dataset row: {"messages": [...], task fields}
    max_tokens: int  # agent.max_tokens_per_turn: the most one reply can hold
    max_turns: int  # agent.max_turns: the most model calls one rollout can make
    rollout_id: str
    harness: str = ""  # agent.harness: the agent CLI that molt/agents/harness.py run_cli starts ("" = none)
    log_dir: str = ""  # agent.log_dir: where run_cli keeps the CLI's output ("" = not kept)

    @property
    def messages(self) -> list[dict]:
        return list(self.sample["messages"])


class AgentError(Exception):
    """The agent raised or returned something that is not a reward."""


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


async def _call_agent(agent_fn: Callable, ctx: ChatContext) -> tuple[float, dict]:
    try:
        if _is_async(agent_fn):
            out = await agent_fn(ctx)
        else:
            out = await asyncio.get_running_loop().run_in_executor(_THREADS, agent_fn, ctx)
    except Exception as e:  # not a cancellation: CancelledError is a BaseException
        raise AgentError(f"{type(e).__name__}: {e}") from e
    reward, info = out if isinstance(out, tuple) and len(out) == 2 else (out, {})
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise AgentError(f"run_agent must return a finite reward or (reward, info), got {out!r}")
    return float(reward), {k: float(v) for k, v in dict(info).items()}


async def run_chat_rollout(generate: Generate, tokenizer, agent_fn: Callable, sample: dict, rollout_id: str,
                           group_id: str, agent_cfg: AgentConfig, sampling: dict,
                           release: Callable[[str], None] | None = None) -> Rollout:
    """One rollout of the user's agent against its own session; `release` is called when it ends. Raises
    RolloutFailed when the agent failed it (run_group marks it)."""
    srv = await shared_server()
    s = open_session(srv, rollout_id, generate, tokenizer, agent_cfg, sampling)
    root = f"{srv.url}/s/{s.sid}"
    ctx = ChatContext(f"{root}/v1", root, s.key, srv.model, sample, agent_cfg.max_tokens_per_turn,
                      agent_cfg.max_turns, rollout_id, agent_cfg.harness, agent_cfg.log_dir)
    ro, why, cause, truncated = Rollout(rollout_id=rollout_id, group_id=group_id), "", None, False
    timeout = agent_cfg.timeout_s or None  # agent.timeout_s: wall-clock bound of one rollout
    try:
        ro.reward, ro.info = await asyncio.wait_for(_call_agent(agent_fn, ctx), timeout)
    except AgentError as e:
        # after a budget refused a request or cut the last reply, the agent giving up (raising, not returning a
        # non-reward) is a truncation (reward 0.0): Claude Code re-asks 3 times after a reply cut at max_tokens, then
        # exits 1
        truncated = bool(s.refused) or s.cut and e.__cause__ is not None
        if not truncated:
            why, cause = f"agent: {e}", e.__cause__
    except asyncio.TimeoutError:
        why = f"agent ran past agent.timeout_s={timeout}"
    finally:
        ro.segments = close_session(srv, s)
        if release is not None:
            release(rollout_id)
    if s.error is not None:
        raise s.error
    ro.status = "truncated" if s.refused or truncated else "ok"
    ro.info.update(turns=float(s.turns), segments=float(len(ro.segments)), refused=float(s.refused),
                   rejected=float(s.rejected), ignored=float(sum(s.ignored.values())), cut=float(s.cuts))
    if s.cuts and agent_cfg.cut_reward is not None:  # agent.cut_reward: a reply ran past its budget
        ro.reward = float(agent_cfg.cut_reward)
    if s.bad_image:  # the policy would have trained without seeing an image the agent sent (images.py)
        why, cause = f"bad image: {s.bad_image}", None
    elif not why and s.rejected:
        why = f"the server refused a malformed request of the agent: {s.rejection}"
    elif not why and not ro.segments:
        why = "the agent never called the model"
    if why:
        raise RolloutFailed(ro, why, s.bad_image or "") from cause
    return ro
