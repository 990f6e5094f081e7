"""Env mode: the framework drives the LLM loop; the user's module only says what the world does.

The contract of a user module (`agent.module=experiments.quickstart.task`):

    def make_env(sample: dict) -> Env      # sample: one dataset row ({"messages": [...], ...task fields})

    class Env:                             # any object with these methods; each may be sync or async
        def reset(self) -> list[dict]      # first observation as chat messages; optional:
                                           #   without `reset` the first observation is sample["messages"]
        def step(self, action: str) -> tuple[list[dict], float, bool]
                                           # action: the assistant's reply text (special tokens skipped)
                                           # returns (new observation messages, reward, done)

The runner (`run_env_rollout`) keeps the rollout token-first (ARCHITECTURE.md §1):
- the first observation is rendered (molt/agents/render.py: the chat template, or the engine for
  messages with images) with the generation prompt, loss mask 0;
- each assistant turn appends exactly the engine's ids with their log-probs and weight version
  (loss mask 1); the text handed to `step` is decoded from those ids and never re-tokenized;
- message content that holds special-token text (a tool result writing `<|im_end|>`) is encoded
  with special tokens split: it stays text and cannot forge a turn boundary;
- each later observation is appended as a *delta* of the chat template: the end-of-turn glue
  after the assistant's ids (e.g. the "\n" after `<|im_end|>`), the new messages and the next
  generation prompt. Earlier turns are never re-rendered.

Choices:
- reward = the sum of the rewards `step` returned (an env with only a final reward returns 0.0
  before it); a truncated rollout keeps the sum collected so far, a failed one gets 0.0.
- status "truncated" when the env is not done but the rollout must stop: `agent.max_turns`
  assistant turns reached, `agent.max_total_tokens` reached, or a turn cut off by its token budget
  (finish_reason != "stop"). A cut-off turn ends the rollout because the template has no way to
  continue from a half-finished assistant message. The rollout never exceeds max_total_tokens and
  never ends with an observation nobody answers: such a last observation is not appended.
- status "failed" when user code (make_env, reset, step, or rendering its messages) raises, or
  step returns something other than (messages, reward, done), or an image is bad: the runner raises
  RolloutFailed and run_group records it (molt/agents/__init__.py). Engine errors (EngineDied) are
  not user code: they propagate; so does a TemplateError (a setup error).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from molt.agents import images
from molt.agents.render import TemplateError, render
from molt.config import AgentConfig
from molt.rollout.features import image_features
from molt.types import EngineDied, Generate, Rollout, RolloutFailed, Segment


class EnvError(Exception):
    """An exception raised inside user code; the rollout fails, the run goes on."""


async def _user(fn: Callable, *args) -> Any:
    """Call user code (sync or async) and wrap whatever it raises in EnvError."""
    try:
        out = fn(*args)
        return await out if inspect.isawaitable(out) else out
    except (TemplateError, images.ImageError, EngineDied):  # a setup error, a bad image, not the env's fault
        raise
    except Exception as e:
        raise EnvError(f"{getattr(fn, '__qualname__', fn)}: {type(e).__name__}: {e}") from e


async def _step(env, action: str) -> tuple[list[dict], float, bool]:
    out = await _user(env.step, action)
    try:
        obs, reward, done = out
        return list(obs), float(reward), bool(done)
    except (TypeError, ValueError) as e:  # a malformed reply is the env's fault too
        raise EnvError(f"step() must return (observation messages, reward, done), got {out!r}") from e


async def _drive(ro: Rollout, generate: Generate, tokenizer, make_env, sample: dict, cfg: AgentConfig,
                 sampling: dict) -> None:
    """The turn loop; sets ro.reward, ro.status and ro.info["turns"] as it goes."""
    assert cfg.max_turns >= 1 and cfg.max_tokens_per_turn >= 1, "set agent.max_turns, agent.max_tokens_per_turn >= 1"
    seg = ro.segments[0]
    env = await _user(make_env, sample)
    first = await _user(env.reset) if hasattr(env, "reset") else sample["messages"]
    ids, ims = await _user(render, tokenizer, first, generate, ro.rollout_id, cfg)
    seg.append(ids, images=ims)
    for turn in range(cfg.max_turns):
        budget = min(cfg.max_tokens_per_turn, cfg.max_total_tokens - len(seg.token_ids))
        if budget <= 0:
            break
        c = await generate(ro.rollout_id, list(seg.token_ids), budget, **sampling, **image_features(seg.images))
        assert c.token_ids, f"engine returned no tokens for rollout {ro.rollout_id}"
        seg.append(list(c.token_ids), generated=True, logprobs=c.logprobs, version=c.token_versions)
        seg.attach_routes(c.routed_experts)  # the call covered the whole segment: its routes replace older ones
        ro.info["turns"] = turn + 1.0
        obs, reward, done = await _step(env, tokenizer.decode(c.token_ids, skip_special_tokens=True))
        ro.reward += reward
        if done:
            return
        if c.finish_reason != "stop" or turn + 1 == cfg.max_turns:
            break  # cut off mid-message, or no turn left to answer the observation
        delta, ims = await _user(render, tokenizer, obs, generate, ro.rollout_id, cfg, None, seg)
        if len(seg.token_ids) + len(delta) >= cfg.max_total_tokens:
            break  # no room left to answer the observation
        seg.append(delta, images=ims)
    ro.status = "truncated"  # the env is not done


async def run_env_rollout(generate: Generate, tokenizer, make_env: Callable, sample: dict, rollout_id: str,
                          group_id: str, agent_cfg: AgentConfig, sampling: dict,
                          release: Callable[[str], None] | None = None) -> Rollout:
    """One rollout of the user's env. `sampling`: keyword arguments of `generate` (temperature, top_p, ...);
    `release` (e.g. `Router.release`) is called with the rollout id when it ends, however it ends. Raises
    RolloutFailed when the env's code failed it (run_group marks it)."""
    ro = Rollout(rollout_id=rollout_id, group_id=group_id, segments=[Segment()], info={"turns": 0.0})
    try:
        await _drive(ro, generate, tokenizer, make_env, sample, agent_cfg, sampling)
    except (EnvError, images.ImageError) as e:
        raise RolloutFailed(ro, str(e), getattr(e, "reason", "")) from e.__cause__
    finally:
        if release is not None:
            release(rollout_id)
    return ro
