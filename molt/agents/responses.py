"""The OpenAI Responses API on the loopback chat server (`POST /s/{sid}/v1/responses`): what Codex CLI speaks.

A request is decoded into the canonical conversation of chat_wire.py; the one accumulation of chat_server.py
does the token work; the `Reply` is encoded back as a response object or its stream events. The mapping:

    instructions                                  -> a system message first (not carried over by previous_response_id)
    message (user | system | developer)           -> user | system | system  (input_text, input_image parts)
    reasoning, message (assistant), function_call -> consecutive ones form ONE assistant message: its content the
                                                     reasoning's generated text + the message text, its tool_calls the
                                                     function calls, as the server's own reply reads (`Reply.message`),
                                                     so a re-sent history is recognised and its ids spliced
    function_call_output                          -> a `tool` message (its call_id must name an earlier function call)
    function tools                                -> rendered into the system prompt (chat_wire.with_tools)

A reply comes back as a `reasoning` item (when the template thinks and the reply starts with reasoning; its
`encrypted_content`, asked for by `include`, is chat_wire.seal's handle), a `message` and `function_call` items.
With `store` (the default) the conversation behind each response is kept in the session, for
`previous_response_id`; an echoed reasoning item without encrypted content is then read back by its id.
Fields the policy cannot honour but whose absence changes no sampled token (built-in tools, prompt_cache_key,
reasoning, metadata, ...) are accepted and counted in `Session.ignored`; options that would change the sampled
distribution (a non-text `text.format`, a forced `tool_choice`, `top_logprobs`) are refused with a 400.
"""
from __future__ import annotations

import itertools
import json
import time
from typing import Annotated, Iterator, Literal, Optional, Union

from pydantic import Discriminator, Field, PrivateAttr, Tag, field_validator

from molt.agents import chat_wire as wire
from molt.agents.chat_wire import _Strict

SEALED, LOGPROBS = "reasoning.encrypted_content", "message.output_text.logprobs"  # the `include` values served
_PARTS = {"input_text": "text", "output_text": "text", "input_image": "image_url"}


# ---- request schema ----


class RText(_Strict):
    text: str


class RMessage(_Strict):
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[dict]]


class RFunctionCall(_Strict):
    call_id: str
    name: str
    arguments: str


class RFunctionCallOutput(_Strict):
    call_id: str
    output: Union[str, list[dict]]


class RReasoning(_Strict):
    id: Optional[str] = None
    summary: list[RText] = Field(default_factory=list)
    encrypted_content: Optional[str] = None


class RFunctionTool(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None


def item_type(v) -> Optional[str]:
    """An input item's type; a message may leave it out."""
    return v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)


def tool_type(v) -> str:
    """A function tool, or a built-in one (web_search, namespace, ...): accepted, counted, not offered to the model."""
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return "function" if kind == "function" else "builtin"


Item = Annotated[Union[Annotated[RMessage, Tag("message")], Annotated[RFunctionCall, Tag("function_call")],
                       Annotated[RFunctionCallOutput, Tag("function_call_output")],
                       Annotated[RReasoning, Tag("reasoning")]], Discriminator(item_type)]
Tool = Annotated[Union[Annotated[RFunctionTool, Tag("function")], Annotated[dict, Tag("builtin")]],
                 Discriminator(tool_type)]


class RRequest(_Strict):
    model: str = ""
    input: list[Item] = Field(default_factory=list)
    instructions: Optional[str] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    stream: bool = False
    store: Optional[bool] = True
    previous_response_id: Optional[str] = None
    include: Optional[list[str]] = None
    text: Optional[dict] = None
    _convo: list = PrivateAttr(default_factory=list)  # the conversation without instructions and tools (store)

    @field_validator("input", mode="before")
    @classmethod
    def _one_message(cls, v):
        return [{"role": "user", "content": v}] if isinstance(v, str) else v


def _bad(where: str, message: str) -> wire.WireError:
    e = wire.WireError(f"{where}: {message}")
    e.param = where.split(".")[0]  # the OpenAI error's `param`: the request field
    return e


# ---- request -> canonical conversation ----


def _options(req: RRequest) -> None:
    fmt, extra = ((req.text or {}).get("format") or {}).get("type", "text"), req.model_extra or {}
    wire._refuse({"text.format": fmt != "text" and f"{fmt!r} needs constrained decoding, and {wire._SAMPLED}",
                  "tool_choice": req.tool_choice not in (None, "auto", "none") and f"forcing a tool call "
                                 f"({req.tool_choice!r}) needs constrained decoding, and {wire._SAMPLED}; use 'auto'",
                  "top_logprobs": bool(req.top_logprobs) and "the engine returns the sampled token's log-prob only",
                  "conversation": extra.get("conversation") is not None and "no conversations are stored here: send "
                                  "the history as input or use previous_response_id",
                  "prompt": extra.get("prompt") is not None and "no prompt templates are stored here"})


def _ignored(req: RRequest) -> list[str]:
    """The names of the fields given that change nothing here: built-in tools, unknown fields, text.verbosity, ..."""
    return ([k for k, v in (req.model_extra or {}).items() if v is not None]
            + [f"tools.{t.get('type')}" for t in req.tools or [] if isinstance(t, dict)]
            + [f"text.{k}" for k in req.text or {} if k != "format"]
            + [f"include.{x}" for x in req.include or [] if x not in (SEALED, LOGPROBS)])


def _part(p) -> dict:
    """A content part as chat_wire._text reads it: input_text/output_text as text, input_image as image_url."""
    kind = _PARTS.get(p.get("type")) if isinstance(p, dict) else None
    if kind == "image_url":
        return {"type": "image_url", "image_url": {"url": p.get("image_url")}}
    return {"type": "text", "text": p.get("text")} if kind == "text" else p


def _content(content, where: str) -> str | list[dict]:
    return wire._text([_part(p) for p in content] if isinstance(content, list) else content, where)


def _reasoning(it: RReasoning, s) -> str:
    """The generated text a reasoning item stands for: its handle's, or (stored) that of the reply it came with."""
    handle, stored = it.encrypted_content, s.responses.get("resp_" + (it.id or "").removeprefix("rs_"))
    if handle is None and stored:
        handle = wire.seal(wire.split_thinking(stored[-1]["content"])[0])
    return wire.unseal(handle, "\n\n".join(p.text for p in it.summary))


def _messages(items: list, s, before: list[dict]) -> list[dict]:
    calls, out = {t["id"] for m in before for t in m.get("tool_calls", [])}, []
    for i, it in enumerate(items):
        where = f"input.{i}"
        if isinstance(it, RFunctionCallOutput):
            if it.call_id not in calls:
                raise _bad(f"{where}.call_id", f"no function_call with call_id {it.call_id!r} precedes it")
            out.append({"role": "tool", "content": _content(it.output, f"{where}.output")})
        elif isinstance(it, RMessage) and it.role != "assistant":
            out.append({"role": "system" if it.role == "developer" else it.role,
                        "content": _content(it.content, f"{where}.content")})
        else:  # the assistant side: consecutive items are one turn
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            if isinstance(it, RFunctionCall):
                calls.add(it.call_id)
                out[-1].setdefault("tool_calls", []).append(
                    {"id": it.call_id, "name": it.name, "arguments": wire._json(it.arguments)})
                continue
            text = _reasoning(it, s) if isinstance(it, RReasoning) else _content(it.content, f"{where}.content")
            if not isinstance(text, str):
                raise _bad(f"{where}.content", "an assistant message holds text only")
            out[-1]["content"] += text
    return out


def conversation(req: RRequest, s) -> list[dict]:
    """The canonical conversation of a request of session `s` (its stored responses: previous_response_id)."""
    _options(req)
    before = s.responses.get(req.previous_response_id) if req.previous_response_id is not None else []
    if before is None:
        raise _bad("previous_response_id", f"no response {req.previous_response_id!r} is stored in this session "
                                           "(unknown, or created with store=false)")
    req._convo = before + _messages(req.input, s, before)
    if len(req._convo) == len(before):
        raise _bad("input", "no input items")
    s.ignored.update(_ignored(req))
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return wire.with_tools(system + req._convo, [{"name": t.name, "description": t.description or "",
                                                  "parameters": t.parameters or {}} for t in _functions(req)])


def _functions(req: RRequest) -> list[RFunctionTool]:
    return [t for t in req.tools or [] if isinstance(t, RFunctionTool)]


def options(req: RRequest) -> dict:
    return dict(max_tokens=req.max_output_tokens, stops=[], logprobs=LOGPROBS in (req.include or []),
                tools_on=bool(_functions(req)) and req.tool_choice != "none")


def keep(s, req: RRequest, r: wire.Reply) -> None:
    """Store the conversation behind a response (its input and its output), for a later previous_response_id."""
    if req.store is not False:
        s.responses[f"resp_{r.id}"] = req._convo + [r.message]


# ---- reply -> response ----


def output(r: wire.Reply, sealed: bool) -> list[dict]:
    """The output items of a reply: reasoning (if any), the message (unless only tool calls), function calls."""
    prefix, rest = r.reasoning
    items = [{"type": "reasoning", "id": f"rs_{r.id}", "summary": [{"type": "summary_text",
                                                                     "text": wire.thinking_text(prefix)}],
              "encrypted_content": wire.seal(prefix) if sealed else None}] if prefix else []
    if rest or not r.tool_calls:
        lp = (wire._logprobs(r) or {}).get("content", [])
        items.append({"type": "message", "id": f"msg_{r.id}", "role": "assistant",
                      "status": "incomplete" if r.finish == "length" else "completed",
                      "content": [{"type": "output_text", "text": rest, "annotations": [], "logprobs": lp}]})
    return items + [{"type": "function_call", "id": f"fc_{t['id'].removeprefix('call_')}", "call_id": t["id"],
                     "name": t["name"], "arguments": json.dumps(t["arguments"]), "status": "completed"}
                    for t in r.tool_calls]


def response(r: wire.Reply, model: str, req: RRequest) -> dict:
    cut = r.finish == "length"
    usage = {"input_tokens": r.prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
             "output_tokens": r.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": r.prompt_tokens + r.completion_tokens}
    return {"id": f"resp_{r.id}", "object": "response", "created_at": int(time.time()), "model": model,
            "status": "incomplete" if cut else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": output(r, SEALED in (req.include or [])), "usage": usage,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "store": req.store is not False,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "tool_choice": req.tool_choice or "auto",
            "tools": [t if isinstance(t, dict) else t.model_dump() for t in req.tools or []],
            "temperature": req.temperature, "top_p": req.top_p, "text": req.text or {"format": {"type": "text"}},
            "truncation": "disabled", "metadata": {}, "reasoning": None, "user": None}


def events(r: wire.Reply, model: str, req: RRequest) -> Iterator[str]:
    """The response as named stream events: created, in_progress, each output item whole, completed/incomplete."""
    full, seq = response(r, model, req), itertools.count()

    def ev(kind: str, **body) -> str:
        return wire._sse({"type": f"response.{kind}", "sequence_number": next(seq), **body}, named=True)

    start = {**full, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield ev("created", response=start)
    yield ev("in_progress", response=start)
    for i, item in enumerate(full["output"]):
        yield from _item_events(ev, i, item)
    yield ev(full["status"], response=full)


_EMPTY = {"reasoning": {"summary": []}, "message": {"content": [], "status": "in_progress"},
          "function_call": {"arguments": "", "status": "in_progress"}}


def _item_events(ev, i: int, item: dict) -> Iterator[str]:
    at = {"output_index": i, "item_id": item["id"]}
    yield ev("output_item.added", output_index=i, item={**item, **_EMPTY[item["type"]]})
    if item["type"] == "message":
        part = item["content"][0]
        yield ev("content_part.added", **at, content_index=0, part={**part, "text": "", "logprobs": []})
        yield ev("output_text.delta", **at, content_index=0, delta=part["text"], logprobs=part["logprobs"])
        yield ev("output_text.done", **at, content_index=0, text=part["text"], logprobs=part["logprobs"])
        yield ev("content_part.done", **at, content_index=0, part=part)
    elif item["type"] == "reasoning":
        part = item["summary"][0]
        yield ev("reasoning_summary_part.added", **at, summary_index=0, part={**part, "text": ""})
        yield ev("reasoning_summary_text.delta", **at, summary_index=0, delta=part["text"])
        yield ev("reasoning_summary_text.done", **at, summary_index=0, text=part["text"])
        yield ev("reasoning_summary_part.done", **at, summary_index=0, part=part)
    else:
        yield ev("function_call_arguments.delta", **at, delta=item["arguments"])
        yield ev("function_call_arguments.done", **at, arguments=item["arguments"])
    yield ev("output_item.done", output_index=i, item=item)
