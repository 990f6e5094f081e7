"""Chat messages as prompt token ids, for every agent mode: the one home of the chat-template token machinery.

    ids, ims = await render(tokenizer, messages, generate, rollout_id, agent_cfg)              # a fresh prompt
    ids, ims = await render(tokenizer, messages, generate, rollout_id, agent_cfg, spliced)     # earlier replies as ids
    delta, ims = await render(tokenizer, obs, generate, rollout_id, agent_cfg, after=segment)  # extends `segment`

Text is rendered with the tokenizer's chat template; messages with images by the rollout's engine
(`/v1/chat/completions/render`, shared/VLM.md; images are read and checked in images.py), so image tokens and
tensors come from one place. Either way the rendering keeps the rollout token-first (ARCHITECTURE.md §1):
- an earlier reply (`spliced`: message index -> the engine's ids of that assistant turn) goes through the template
  as a unique placeholder whose ids are then the reply's own: model output is never re-encoded from text;
- content that holds special-token text (a tool result writing `<|im_end|>`) is encoded with special tokens split:
  it stays text and cannot forge a turn boundary;
- a later observation is a *delta*: what the template adds after a dummy conversation ending in an assistant turn
  (the end-of-turn glue, the new messages, the next generation prompt). Earlier turns and their images are never
  rendered again. The engine's sampling parameters from render are not used (its omit-defaults serialisation drops
  max_tokens=16): every generate call sets its own.
"""
from __future__ import annotations

import asyncio
import functools
import json
import re
import secrets
import time
from dataclasses import replace

from molt.agents import images
from molt.types import Image, Segment

MARK = "MOLT_TURN_MARK"  # dummy assistant content; everything the template adds after it is glue
_DUMMY = [{"role": "user", "content": "u"}, {"role": "assistant", "content": MARK}]


class TemplateError(RuntimeError):
    """The chat template cannot be extended by deltas: a setup error, fatal, never a failed rollout."""


async def render(tokenizer, messages: list[dict], generate, rollout_id: str, cfg,
                 spliced: dict[int, list[int]] | None = None,
                 after: Segment | None = None) -> tuple[list[int], list[Image]]:
    """Ids of `messages` and their images (offsets into those ids): a prompt ending with the generation prompt, or,
    with `after` (a segment that ends with an assistant turn), the delta that extends it. Messages with images are
    rendered by the rollout's engine (`generate.render`, within `cfg`'s image limits), text in place or, past
    INLINE_CHARS, on a thread: a large request must not stall the event loop every other rollout of the worker
    shares. In place, the rollouts of a group reach the engine in one event-loop tick, where the router coalesces
    them into one request (on threads they straggled in: 1.9 requests per group on the quickstart, not 1)."""
    if after is not None:
        last = after.token_ids[-1] if after.token_ids else None
        if images.has_images(messages):
            return await _engine_delta(generate, rollout_id, tokenizer, messages, last, cfg, len(after.images))
        return await _text(render_delta, tokenizer, messages, last), []
    if images.has_images(messages):
        return await _engine_prompt(generate, rollout_id, tokenizer, messages, spliced or {}, cfg)
    if spliced:
        return await _text(render_prompt, tokenizer, messages, spliced), []
    return await _text(_first_prompt, tokenizer, messages), []


_FIRST: dict[tuple, tuple[float, list[int]]] = {}  # (tokenizer, messages) -> (when, ids) of recent first prompts


def _first_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """render_prompt of a conversation's first messages, once for the rollouts of a group that start alike (64
    renders of a quickstart step, 8 of them different). Reused for a second at most: a template may read the clock."""
    key, now = (id(tokenizer), json.dumps(messages, sort_keys=True, default=str)), time.monotonic()
    when, ids = _FIRST.get(key, (-2.0, []))
    if now - when > 1.0:
        if len(_FIRST) > 256:
            _FIRST.clear()
        ids = render_prompt(tokenizer, messages)
        _FIRST[key] = (now, ids)
    return list(ids)


INLINE_CHARS = 16384  # text rendered in place up to this size (a fraction of a millisecond), on a thread past it


async def _text(fn, tokenizer, messages: list[dict], *args) -> list[int]:
    if sum(len(str(m.get("content") or "")) for m in messages) <= INLINE_CHARS:
        return fn(tokenizer, messages, *args)
    return await asyncio.to_thread(fn, tokenizer, messages, *args)


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
    (`spliced`) or text that holds special-token text, which must stay text and never become a control token."""
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
    """Text messages as ids, ending with the generation prompt; `spliced` as in `render`."""
    msgs, held = _hold(tokenizer, messages, spliced or {})
    return _encode(tokenizer, tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), held)


def render_delta(tokenizer, messages: list[dict], last_token_id: int | None) -> list[int]:
    """Ids the template adds after an assistant turn: its end-of-turn glue, text `messages` and the next
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


async def _engine_prompt(generate, rollout_id: str, tokenizer, messages: list[dict], spliced: dict[int, list[int]],
                         cfg) -> tuple[list[int], list[Image]]:
    """render_prompt by the engine: each held content goes to the engine as its placeholder, whose ids in the
    rendering are then swapped for the reply's own ids (or the text, encoded with special tokens split). Later
    images move along."""
    msgs, held = _hold(tokenizer, messages, spliced)
    ids, ims = await images.render(generate, rollout_id, msgs, cfg)
    for key, h in held.items():
        new = h if isinstance(h, list) else _splitting(tokenizer).encode(h, add_special_tokens=False).ids
        old = tokenizer.encode(key, add_special_tokens=False)
        at = [i for i in range(len(ids) - len(old) + 1) if ids[i:i + len(old)] == old]
        if len(at) != 1:  # the template dropped, repeated or merged it into its neighbours
            raise ValueError(f"the engine's rendering holds the placeholder of an earlier message {len(at)} times, "
                             "not once: this chat template cannot rebuild the conversation from the engine's ids")
        start, end = at[0], at[0] + len(old)
        if isinstance(h, list) and h and h[-1] in tokenizer.added_tokens_decoder and ids[end:end + 1] == h[-1:]:
            end += 1  # the reply ends with the end-of-turn token the template adds after it: once
        ids = ids[:start] + new + ids[end:]
        ims = [im if im.offset < start else replace(im, offset=im.offset + len(new) - (end - start)) for im in ims]
    return ids, ims


async def _engine_delta(generate, rollout_id: str, tokenizer, messages: list[dict], last_token_id: int | None, cfg,
                        seen: int) -> tuple[list[int], list[Image]]:
    """render_delta by the engine: what follows a known dummy conversation in the engine's rendering of dummy +
    messages, with the images' offsets moved into the delta; `seen` images earlier in the rollout count towards
    agent.image_max_per_prompt."""
    base = tokenizer.apply_chat_template(_DUMMY, tokenize=False)
    cut = base.rindex(MARK) + len(MARK)
    head, close = _encode(tokenizer, base[:cut]), _encode(tokenizer, base[cut:])
    ids, ims = await images.render(generate, rollout_id, _DUMMY + list(messages), cfg, seen)
    if ids[:len(head) + len(close)] != head + close:
        raise TemplateError("the engine's rendering does not extend the dummy conversation token by token; env mode "
                            "with images needs a prefix-stable chat template")
    tail = ids[len(head):]
    if tail and tail[0] == last_token_id and last_token_id in tokenizer.added_tokens_decoder:
        tail = tail[1:]  # the model emitted the end-of-turn token itself
    return tail, images.shifted(ims, len(tail) - len(ids))
