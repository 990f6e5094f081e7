"""ChatAgent wire formats without an engine: request decoding, tool-call parsing, stop strings, templates."""
import collections
import json

import pytest
from transformers import AutoTokenizer

from molt.agents import chat_wire as wire
from molt.agents.chat_server import cut_at_stop
from molt.agents.render import render_delta, render_prompt
from molt.assets import ensure_model

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(ensure_model(tmp_path_factory.mktemp("m") / "tiny", "tiny"))


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_tool_calls_parse_from_generated_ids(tok):
    """Ids as the engine would return them (text + <|im_end|>) decode and parse into calls."""
    ids = ids_of(tok, "Let me add.\n" + CALL + "\n" + CALL.replace("2", "7")) + [tok.eos_token_id]
    content, calls = wire.parse_tool_calls(tok.decode(ids, skip_special_tokens=True))
    assert content == "Let me add."
    assert [(c["name"], c["arguments"]) for c in calls] == [("add", {"a": 2, "b": 3}), ("add", {"a": 7, "b": 3})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize("text", [
    "no call at all",
    '<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>',  # broken JSON
    '<tool_call>\n{"name": "add", "arguments": {"a": 2}}',  # cut off before the closing tag
    '<tool_call>\n["add"]\n</tool_call>',  # not an object
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>',  # arguments not an object
    CALL + '<tool_call>{"name": 1}</tool_call>',  # one bad block: all of it is text
])
def test_unparsable_generations_come_back_as_text(text):
    assert wire.parse_tool_calls(text) == (text, [])


def test_arguments_given_as_a_json_string_parse():
    _, calls = wire.parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert calls[0]["arguments"] == {"x": 1}


def test_stop_strings_cut_text_and_ids(tok):
    ids = ids_of(tok, "one two three four")
    keep, text, stop = cut_at_stop(tok, ids, ["three", "zzz"])
    assert (text, stop) == ("one two ", "three")
    assert "three" in tok.decode(ids[:keep]) and "three" not in tok.decode(ids[:keep - 1])  # the completing token
    assert cut_at_stop(tok, ids, ["zzz"]) == (len(ids), "one two three four", None)
    assert cut_at_stop(tok, ids, []) == (len(ids), "one two three four", None)
    assert cut_at_stop(tok, ids, ["zz"] * 8190 + ["four", "o t"]) == (keep, "one tw", "o t")  # thousands: one pass


def test_openai_request_to_canonical_conversation():
    body = {"model": "m", "max_tokens": 5, "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "add "}, {"type": "text", "text": "2 and 3"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}],
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]}
    convo = wire.openai_conversation(wire.parse_request(wire.OAIRequest, json.dumps(body).encode()))
    assert convo[0]["role"] == "system" and convo[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '{"type": "function", "function": {"name": "add", "description": "", ' in convo[0]["content"]
    assert convo[1:] == [{"role": "user", "content": "add 2 and 3"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"id": "call_1", "name": "add", "arguments": {"a": 2, "b": 3}}]},
                         {"role": "tool", "content": "5"}]


def test_anthropic_request_to_canonical_conversation():
    body = {"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Sys."}], "messages": [
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": [{"type": "text", "text": "Sure."},
                                          {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 2, "b": 3}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "5"},
                                     {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                                      "content": [{"type": "text", "text": "boom"}]},
                                     {"type": "text", "text": "so?"}]}]}
    convo = wire.anthropic_conversation(wire.parse_request(wire.ARequest, json.dumps(body).encode()))
    assert convo == [{"role": "system", "content": "Sys."}, {"role": "user", "content": "add 2 and 3"},
                     {"role": "assistant", "content": "Sure.",
                      "tool_calls": [{"id": "t1", "name": "add", "arguments": {"a": 2, "b": 3}}]},
                     {"role": "tool", "content": "5"}, {"role": "tool", "content": "Error: boom"},
                     {"role": "user", "content": "so?"}]


@pytest.mark.parametrize("schema, body, where", [
    (wire.OAIRequest, b'{"messages": [', "body"),
    (wire.OAIRequest, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}', "max_tokens"),
    (wire.OAIRequest, b'{"messages": [{"role": "robot", "content": "x"}]}', "messages.0.role"),
    (wire.OAIRequest, b'{"messages": []}', "messages"),
    (wire.OAIRequest, b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', "n"),
    (wire.ARequest, b'{"messages": [{"role": "user", "content": "x"}]}', "max_tokens"),
    (wire.ARequest, b'{"max_tokens": 4, "messages": "x"}', "messages"),
    (wire.OAIRequest, b'{"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}', "stop"),
    (wire.ARequest, b'{"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stop_sequences": ["a", ""]}',
     "stop_sequences.1"),
])
def test_bad_requests_name_the_field(schema, body, where):
    with pytest.raises(wire.WireError, match=f"^{where}"):
        wire.parse_request(schema, body)


def test_unsupported_blocks_are_rejected():
    req = wire.parse_request(wire.ARequest, json.dumps({"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "document", "source": {}}]}]}).encode())
    with pytest.raises(wire.WireError, match="messages.0.content.0: unsupported"):
        wire.anthropic_conversation(req)


def test_same_message_compares_values_not_ids_or_spelling():
    a = {"role": "assistant", "content": "", "tool_calls": [{"id": "x", "name": "f", "arguments": {"a": 1, "b": 2}}]}
    b = {"role": "assistant", "content": "", "tool_calls": [{"id": "y", "name": "f", "arguments": {"b": 2, "a": 1}}]}
    assert wire.same_message(a, b)
    assert not wire.same_message(a, dict(b, content=" "))
    assert not wire.same_message(a, {"role": "assistant", "content": ""})


def test_rerendered_tool_calls_parse_back(tok):
    """A compacted history renders tool calls in the format the parser reads."""
    msg = {"role": "assistant", "content": "ok", "tool_calls": [{"id": "i", "name": "add", "arguments": {"a": 1}}]}
    text = wire.template_messages([msg])[0]["content"]
    assert wire.parse_tool_calls(text)[0] == "ok" and wire.parse_tool_calls(text)[1][0]["arguments"] == {"a": 1}
    convo = [{"role": "user", "content": "q"}, msg, {"role": "tool", "content": "2"}]
    ids = render_prompt(tok, wire.template_messages(convo[:1]))
    ids += ids_of(tok, text) + [tok.eos_token_id]
    ids += render_delta(tok, wire.template_messages(convo[2:]), ids[-1])
    assert ids == render_prompt(tok, wire.template_messages(convo))


def test_replies_encode_in_both_protocols():
    r = wire.Reply("", [{"id": "call_1", "name": "add", "arguments": {"a": 1}}], "tool_calls", None, 7, 3)
    o = wire.openai_response(r, "policy")
    assert o["choices"][0]["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}
    assert o["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    a = wire.anthropic_response(r, "policy")
    assert a["content"] == [{"type": "tool_use", "id": "call_1", "name": "add", "input": {"a": 1}}]
    assert a["stop_reason"] == "tool_use"
    stop = wire.anthropic_response(wire.Reply("hi", [], "stop", "END"), "p")
    assert (stop["stop_reason"], stop["stop_sequence"], stop["content"]) == ("stop_sequence", "END",
                                                                             [{"type": "text", "text": "hi"}])
    chunks = list(wire.openai_chunks(r, "policy", include_usage=True))
    assert chunks[-1] == "data: [DONE]\n\n" and '"usage"' in chunks[-2]


def test_a_claude_code_request_decodes():
    """Claude Code's shape: fields and blocks it sends are read; what changes nothing is counted by name; deferred
    and server tools are not shown; a thinking block is the reasoning its signature holds (or, foreign, its text)."""
    eph, schema = {"type": "ephemeral"}, {"type": "object"}
    body = {"model": "m", "max_tokens": 64, "stream": True, "thinking": {"type": "adaptive", "display": "omitted"},
            "metadata": {"user_id": "{}"}, "context_management": {"edits": []}, "output_config": {"effort": "high"},
            "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B", "cache_control": eph}],
            "tools": [{"name": "add", "input_schema": schema, "cache_control": eph, "eager_input_streaming": True},
                      {"type": "custom", "name": "note", "input_schema": schema},
                      {"name": "later", "input_schema": schema, "defer_loading": True},
                      {"type": "web_search_20250305", "name": "web_search", "max_uses": 1}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "q", "cache_control": eph}]},
                {"role": "system", "content": [{"type": "text", "text": "env", "cache_control": eph}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "", "signature": wire.seal("<think>hm</think>\n\n")},
                    {"type": "redacted_thinking", "data": "x"}, {"type": "text", "text": "ok"},
                    {"type": "tool_use", "id": "t", "name": "add", "input": {"a": 1}, "cache_control": eph}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "1"}]},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "mine", "signature": "Zm9yZWlnbg=="},
                                                  {"type": "text", "text": "done"}]}]}
    req = wire.parse_request(wire.ARequest, json.dumps(body).encode())
    ignored = collections.Counter()
    convo = wire.anthropic_conversation(req, ignored)
    assert ignored == {"thinking": 1, "metadata": 1, "context_management": 1, "output_config": 1,
                       "tools.web_search_20250305": 1, "redacted_thinking": 1}
    assert req.omit_thinking and [m["role"] for m in convo] == ["system", "user", "system", "assistant", "tool",
                                                                 "assistant"]
    shown = [json.loads(line)["function"]["name"] for line in convo[0]["content"].split("<tools>\n")[1].split(
        "\n</tools>")[0].splitlines()]
    assert convo[0]["content"].startswith("AB\n\n# Tools") and shown == ["add", "note"]
    assert convo[3]["content"] == "<think>hm</think>\n\nok" and convo[3]["tool_calls"][0]["arguments"] == {"a": 1}
    assert convo[5]["content"] == "<think>\nmine\n</think>\n\ndone"  # not our handle: the shown text, wrapped
    assert wire.parse_request(wire.ACount, json.dumps({k: v for k, v in body.items() if k != "max_tokens"}).encode())


@pytest.mark.parametrize("text, calls", [("<think>\nhm\n</think>\n\nHello", []), ("<think>hm</think>", [CALL])])
@pytest.mark.parametrize("omit", [False, True])
def test_thinking_blocks_encode_and_read_back_as_the_reply(text, calls, omit):
    """A reply that starts with reasoning is a thinking block (its text, or none with display "omitted") and its
    signature; the blocks echoed back decode to the reply's own message, so it is recognised."""
    content, parsed = wire.parse_tool_calls(text + "".join(calls))
    r = wire.Reply(content, parsed, "tool_calls" if parsed else "stop", thinks=True)
    blocks = wire.anthropic_response(r, "p", omit)["content"]
    assert [b["type"] for b in blocks] == ["thinking"] + (["tool_use"] if calls else ["text"])
    assert blocks[0]["thinking"] == ("" if omit else "hm") and wire.unseal(blocks[0]["signature"], "") == r.reasoning[0]
    events = [json.loads(e.split("data: ")[1]) for e in wire.anthropic_events(r, "p", omit)]
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0] == \
           ["thinking_delta"] * (not omit) + ["signature_delta"]
    assert events[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    echo = {"max_tokens": 4, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": blocks}]}
    convo = wire.anthropic_conversation(wire.parse_request(wire.ARequest, json.dumps(echo).encode()))
    assert wire.same_message(convo[-1], r.message) and convo[-1]["content"] == r.text
