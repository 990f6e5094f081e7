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
- the first observation is rendered with the chat template (generation prompt on), loss mask 0;
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
  step returns something other than (messages, reward, done): the error goes, with its
  file:line, into `Rollout.error` (the loop logs one line per kind and step; tracebacks at debug level),
  `info["failed"] = 1.0`, and the group goes on. Engine errors (EngineDied) are not
  user code: they propagate.
"""
from __future__ import annotations

import functools
import inspect
import logging
import re
import secrets
import traceback
from typing import Any, Callable

from molt.agents import images
from molt.config import AgentConfig
from molt.types import Generate, Rollout, Segment

log = logging.getLogger(__name__)
MARK = "MOLT_TURN_MARK"  # dummy assistant content; everything the template adds after it is glue
_DUMMY = [{"role": "user", "content": "u"}, {"role": "assistant", "content": MARK}]


class EnvError(Exception):
    """An exception raised inside user code; the rollout fails, the run goes on."""


class TemplateError(RuntimeError):
    """The chat template cannot be extended by deltas: a setup error, fatal, never a failed rollout."""


def where(e: BaseException | None) -> str:
    """" (file:line)" of the innermost frame an exception was raised in (for one-line failure reports)."""
    tb = traceback.extract_tb(e.__traceback__) if e is not None else []
    return f" ({tb[-1].filename}:{tb[-1].lineno})" if tb else ""


async def _user(fn: Callable, *args) -> Any:
    """Call user code (sync or async) and wrap whatever it raises in EnvError."""
    try:
        out = fn(*args)
        return await out if inspect.isawaitable(out) else out
    except TemplateError:
        raise
    except Exception as e:
        raise EnvError(f"{getattr(fn, '__qualname__', fn)}: {type(e).__name__}: {e}") from e


def _special_texts(tokenizer) -> list[str]:
    return [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]


@functools.lru_cache(maxsize=8)
def _splitting(tokenizer):
    """A copy of the fast tokenizer's backend that reads special-token text as plain text. A copy, not the
    `split_special_tokens` flag: that flag flips shared state, and rendering runs on several threads."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.encode_special_tokens = True
    return backend


def _hold(tokenizer, messages: list[dict], spliced: dict[int, list[int]]) -> tuple[list[dict], dict]:
    """Messages with some contents swapped for placeholders, and what each placeholder stands for: ids to splice
    (`spliced`: message index -> the engine's own ids of that assistant turn) or text that holds special-token
    text (a tool result writing `<|im_end|>`), which must stay text and never become a control token."""
    specials, out, held = _special_texts(tokenizer), [], {}
    for i, m in enumerate(messages):
        c = m.get("content")
        if i in spliced or (isinstance(c, str) and any(t in c for t in specials)):
            key = f"MOLTHELD{i}Z{secrets.token_hex(6)}"
            held[key], m = spliced.get(i, c), dict(m, content=key)
        out.append(m)
    return out, held


def _encode(tokenizer, text: str, held: dict | None = None) -> list[int]:
    """Ids of template text (its own special tokens, BOS included where the template has one, stay control
    tokens); placeholders of `_hold` become their ids, or their text encoded with special tokens split."""
    if not held:
        return tokenizer.encode(text, add_special_tokens=False)
    parts = re.split("(" + "|".join(held) + ")", text)
    if sorted(p for p in parts if p in held) != sorted(held):
        raise ValueError("the chat template changes or repeats message content that holds special-token text or "
                         "model output, so it cannot be rendered safely")
    ids: list[int] = []
    for i, p in enumerate(parts):
        h = held.get(p)
        if isinstance(h, list):  # the engine's ids; when they end with the end-of-turn token the template adds, once
            last = tokenizer.decode(h[-1:], skip_special_tokens=False) if h and h[-1] in tokenizer.added_tokens_decoder else ""
            if last and i + 1 < len(parts) and parts[i + 1].startswith(last):
                parts[i + 1] = parts[i + 1][len(last):]
            ids += h
        elif h is not None:
            ids += _splitting(tokenizer).encode(h, add_special_tokens=False).ids
        elif p:
            ids += tokenizer.encode(p, add_special_tokens=False)
    return ids


def render_prompt(tokenizer, messages: list[dict], spliced: dict[int, list[int]] | None = None) -> list[int]:
    """The first observation as ids, ending with the generation prompt. `spliced`: message index -> ids that
    stand for that message's content (the engine's own ids of an earlier reply: never re-encoded from text)."""
    msgs, held = _hold(tokenizer, messages, spliced or {})
    return _encode(tokenizer, tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), held)


def render_delta(tokenizer, messages: list[dict], last_token_id: int | None) -> list[int]:
    """Ids the template adds after an assistant turn: its end-of-turn glue, `messages` and the next
    generation prompt. `last_token_id` is the turn's last generated id; when the glue starts with
    that token's text (the model emitted `<|im_end|>` itself) it is not appended twice.

    Found by rendering a dummy conversation with and without `messages` and taking what follows
    the dummy assistant content. Token-level splicing is exact when the glue begins at a special
    token boundary (ChatML and its relatives); the tests check this against the full rendering.
    """
    msgs, held = _hold(tokenizer, list(messages), {})
    base = tokenizer.apply_chat_template(_DUMMY, tokenize=False)
    full = tokenizer.apply_chat_template(_DUMMY + msgs, add_generation_prompt=True, tokenize=False)
    close, tail = base[base.rindex(MARK) + len(MARK):], full[full.rindex(MARK) + len(MARK):]
    if not tail.startswith(close):
        raise TemplateError(f"the chat template ends an assistant turn differently once messages follow it "
                            f"({close!r} vs {tail[:len(close)]!r}); env mode needs a prefix-stable template "
                            f"(the tokenizer of model.path)")
    if last_token_id in tokenizer.added_tokens_decoder:  # only a special token can be the end-of-turn marker
        last = tokenizer.decode([last_token_id], skip_special_tokens=False)
        if tail.startswith(last):
            tail = tail[len(last):]
    return _encode(tokenizer, tail, held)


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
    if images.has_images(first):  # rendered by the engine (molt/agents/images.py)
        ids, ims = await images.render(generate, ro.rollout_id, first, cfg)
        seg.append(ids, images=ims)
    else:
        seg.append(await _user(render_prompt, tokenizer, first))
    for turn in range(cfg.max_turns):
        budget = min(cfg.max_tokens_per_turn, cfg.max_total_tokens - len(seg.token_ids))
        if budget <= 0:
            break
        c = await generate(ro.rollout_id, list(seg.token_ids), budget, **sampling, **images.features(seg.images))
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
        if images.has_images(obs):
            delta, ims = await images.render_delta(generate, ro.rollout_id, tokenizer, obs, c.token_ids[-1], cfg,
                                                   len(seg.images))
        else:
            delta, ims = await _user(render_delta, tokenizer, obs, c.token_ids[-1]), []
        if len(seg.token_ids) + len(delta) >= cfg.max_total_tokens:
            break  # no room left to answer the observation
        seg.append(delta, images=ims)
    ro.status = "truncated"  # the env is not done


async def run_env_rollout(generate: Generate, tokenizer, make_env: Callable, sample: dict, rollout_id: str,
                          group_id: str, agent_cfg: AgentConfig, sampling: dict,
                          release: Callable[[str], None] | None = None) -> Rollout:
    """One rollout of the user's env. `sampling`: keyword arguments of `generate` (temperature, top_p, ...);
    `release` (e.g. `Router.release`) is called with the rollout id when it ends, however it ends."""
    ro = Rollout(rollout_id=rollout_id, group_id=group_id, segments=[Segment()], info={"turns": 0.0})
    try:
        await _drive(ro, generate, tokenizer, make_env, sample, agent_cfg, sampling)
    except (EnvError, images.ImageError) as e:  # the loop logs one line per kind and step; tracebacks at debug level
        log.debug("rollout %s failed in env code: %s", rollout_id, e, exc_info=e.__cause__)
        ro.status, ro.reward, ro.info["failed"], ro.error = "failed", 0.0, 1.0, f"{e}{where(e.__cause__)}"
        if isinstance(e, images.ImageError):
            ro.info[f"failed/image_{e.reason}"] = 1.0
    finally:
        if release is not None:
            release(rollout_id)
    seg = ro.segments[0]
    images.detach(seg)
    seg.check()
    ro.info.update(gen_tokens=float(seg.num_generated), tokens=float(len(seg.token_ids)))
    return ro
