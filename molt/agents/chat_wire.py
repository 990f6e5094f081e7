"""Wire formats of the loopback chat server (molt/agents/chat_server.py).

OpenAI Chat Completions and Anthropic Messages requests are decoded into one canonical
conversation, a list of plain dicts:

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "tool_calls": [{"id": str, "name": str, "arguments": dict | str}]}   # assistant only, optional

and a `Reply` (built from the engine's tokens) is encoded back as either protocol, whole or as
server-sent events. Nothing here touches tokens: that is the server's job.

Tools. The tiny test tokenizer's ChatML template has no tools section, so tools are rendered
into the system prompt in a Hermes/Qwen-style format (TOOLS_PROMPT): one JSON signature per line
inside <tools></tools>, and the model calls a tool by writing

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2+3"}}
    </tool_call>

A generation becomes tool calls only when every <tool_call> block in it holds such a JSON object;
otherwise the whole generation comes back as text. Assistant turns with tool calls that have to
be re-rendered (compaction) are written back in the same format; tool results are `tool` messages.

Reasoning. When the model's chat template has a thinking section (it mentions `</think>`), a reply's
text up to and including `</think>` (and the whitespace after it) is its reasoning. The canonical
message keeps the whole text; the Responses API shows the reasoning as a `reasoning` item and
Anthropic Messages as a `thinking` block, each carrying a handle (`encrypted_content`, `signature`:
the reasoning exactly as generated, base64) by which the agent's echo of it is read back as the very
same text, so the reply is recognised and its ids spliced.
"""
from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Any, Iterator, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

TOOLS_PROMPT = ("# Tools\n\nFunction signatures, one per line:\n<tools>\n{tools}\n</tools>\n\nTo call a function, write:\n"
                "<tool_call>\n{{\"name\": <function name>, \"arguments\": <JSON object>}}\n</tool_call>")
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
IMAGES = ("image_url", "image")  # OpenAI and Anthropic image parts


class WireError(ValueError):
    """A request the protocol rejects: answered 400 in the protocol's own error shape."""


# ---- request schemas (strict: a string where a number belongs is an error, as with the real APIs) ----


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class OAIFunctionCall(_Strict):
    name: str
    arguments: str


class OAIToolCall(_Strict):
    id: str = ""
    type: str = "function"
    function: OAIFunctionCall


class OAIMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict], None] = None
    tool_calls: Optional[list[OAIToolCall]] = None
    tool_call_id: Optional[str] = None


class FunctionDef(_Strict):
    name: str
    description: str = ""
    parameters: dict = Field(default_factory=dict)


class OAITool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class OAIRequest(_Strict):
    model: str = ""
    messages: list[OAIMessage] = Field(min_length=1)
    tools: Optional[list[OAITool]] = None
    tool_choice: Union[str, dict, None] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stop: Union[Annotated[list[str], Field(max_length=4)], str, None] = None  # the API's limit: up to 4
    n: Optional[int] = Field(1, ge=1, le=1)  # one rollout is one trajectory
    stream: bool = False
    stream_options: Optional[dict] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    response_format: Optional[dict] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None


class AToolDef(_Strict):
    name: str
    description: str = ""
    input_schema: dict = Field(default_factory=dict)
    type: Optional[str] = None  # None | "custom"; else a tool Anthropic defines (web_search_..., bash_...)
    defer_loading: Optional[bool] = None  # tool search: not shown to the model until a search finds it


class AMessage(_Strict):
    role: Literal["user", "assistant", "system"]  # system: a mid-conversation system message (Claude Code sends them)
    content: Union[str, list[dict]]


class AThinking(_Strict):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Optional[int] = Field(None, ge=1)
    display: Optional[str] = None  # "omitted": thinking blocks come back with their signature only


class ARequest(_Strict):
    model: str = ""
    max_tokens: int = Field(ge=1)  # required by the protocol
    messages: list[AMessage] = Field(min_length=1)
    system: Union[str, list[dict], None] = None
    tools: Optional[list[AToolDef]] = None
    tool_choice: Optional[dict] = None
    # each non-empty, as the API checks; the API documents no count limit, Claude on AWS Bedrock documents 8191
    stop_sequences: Optional[Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=8191)]] = None
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stream: bool = False
    thinking: Optional[AThinking] = None

    @property
    def omit_thinking(self) -> bool:
        return self.thinking is not None and self.thinking.display == "omitted"


class ACount(ARequest):
    """POST /v1/messages/count_tokens: a Messages request without max_tokens."""

    max_tokens: Optional[int] = Field(None, ge=1)


def parse_request(schema: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body against a schema; malformed JSON and wrong types both raise WireError."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise WireError(f"{where}: {err['msg']}") from None


# ---- requests -> canonical conversation ----

# Options the policy cannot honour are refused (a 400 naming them), never ignored. Most would change the distribution
# a reply is sampled from, which must stay the one the trainer recomputes (ARCHITECTURE.md §1).
_SAMPLED = "it would change the distribution the reply is sampled from, which the run fixes (rollout.*)"


def _refuse(options: dict[str, Any]) -> None:
    """A WireError for the first option given a reason (a false value: the request's setting is served)."""
    for name, why in options.items():
        if why:
            raise WireError(f"{name}: not supported: {why}")


def _openai_options(r: OAIRequest) -> None:
    fmt = (r.response_format or {}).get("type", "text")
    _refuse({"response_format": fmt != "text" and f"{fmt!r} needs constrained decoding, and {_SAMPLED}",
             "tool_choice": r.tool_choice not in (None, "auto", "none") and f"forcing a tool call ({r.tool_choice!r}) "
                            f"needs constrained decoding, and {_SAMPLED}; use 'auto'",
             "presence_penalty": bool(r.presence_penalty) and _SAMPLED,
             "frequency_penalty": bool(r.frequency_penalty) and _SAMPLED,
             "logit_bias": bool(r.logit_bias) and _SAMPLED,
             "seed": r.seed is not None and "the run seeds sampling (rollout.seed), per rollout of a group",
             "top_logprobs": bool(r.top_logprobs) and "the engine returns the sampled token's log-prob only (use 0)"})


def _anthropic_options(r: ARequest) -> None:
    choice = (r.tool_choice or {}).get("type", "auto")
    _refuse({"tool_choice": choice not in ("auto", "none") and f"forcing a tool call ({choice!r}) needs constrained "
                            f"decoding, and {_SAMPLED}; use 'auto'"})


def _anthropic_ignored(r: ARequest) -> list[str]:
    """The names of the fields given that change nothing here: thinking (the model thinks as its template says,
    whatever the budget or effort), tools Anthropic defines (only custom tools are shown to the model), unknown
    fields (context_management, output_config, metadata, ...)."""
    return ([k for k, v in (r.model_extra or {}).items() if v is not None]
            + (["thinking"] if r.thinking is not None and r.thinking.type != "disabled" else [])
            + [f"tools.{t.type}" for t in r.tools or [] if t.type not in (None, "custom")])


def _text(content, where: str) -> str | list[dict]:
    """Message content (a string or a list of text parts/blocks) as one string; a list with images stays a list
    of parts, which the engine renders (images.py)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise WireError(f"{where}: content must be a string or a list of parts, got {type(content).__name__}")
    images = any(isinstance(p, dict) and p.get("type") in IMAGES for p in content)
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        if not (kind == "text" and isinstance(p.get("text"), str) or images and kind in IMAGES):
            raise WireError(f"{where}.{j}: only text{' and image' if images else ''} parts are supported, "
                            f"got a {kind!r} part")
    return content if images else "".join(p["text"] for p in content)


def _json(raw):
    """A string decoded as JSON when it is valid JSON, else `raw` as is: tool-call arguments become a dict when they
    are a JSON object (compared by value, not by spelling)."""
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return raw


def with_tools(msgs: list[dict], tools: list[dict]) -> list[dict]:
    """Fold the tool signatures into the system message (a new one when there is none)."""
    if not tools:
        return msgs
    section = TOOLS_PROMPT.format(tools="\n".join(json.dumps({"type": "function", "function": t}) for t in tools))
    if msgs and msgs[0]["role"] == "system":
        return [{"role": "system", "content": f"{msgs[0]['content']}\n\n{section}"}] + msgs[1:]
    return [{"role": "system", "content": section}] + msgs


def openai_conversation(req: OAIRequest) -> list[dict]:
    _openai_options(req)
    msgs = []
    for i, m in enumerate(req.messages):
        c = {"role": "system" if m.role == "developer" else m.role, "content": _text(m.content, f"messages.{i}")}
        if m.role == "assistant" and m.tool_calls:
            c["tool_calls"] = [{"id": t.id, "name": t.function.name, "arguments": _json(t.function.arguments)}
                               for t in m.tool_calls]
        msgs.append(c)
    return with_tools(msgs, [t.function.model_dump() for t in req.tools or []])


def _anthropic_blocks(role: str, content, where: str, ignored: Counter) -> list[dict]:
    """One Anthropic message as canonical messages: tool_result blocks become `tool` messages; an assistant's thinking
    block is the reasoning text it stands for (`unseal`), a redacted_thinking block nothing (counted)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    out, text, calls = [], [], []
    for j, b in enumerate(content):
        kind = b.get("type")
        if kind == "text" and isinstance(b.get("text"), str) or kind == "image" and role == "user":
            text.append(b)
        elif kind == "thinking" and role == "assistant" and isinstance(b.get("thinking"), str):
            text.append({"type": "text", "text": unseal(b.get("signature"), b["thinking"])})
        elif kind == "redacted_thinking" and role == "assistant":
            ignored["redacted_thinking"] += 1
        elif kind == "tool_use" and role == "assistant" and isinstance(b.get("name"), str):
            calls.append({"id": str(b.get("id", "")), "name": b["name"], "arguments": b.get("input", {})})
        elif kind == "tool_result" and role == "user":
            result = _text(b.get("content"), f"{where}.content.{j}.content")
            out.append({"role": "tool", "content": ("Error: " if b.get("is_error") else "") + result})
        else:
            raise WireError(f"{where}.content.{j}: unsupported or malformed {kind!r} block for role {role}")
    if text or calls or not out:
        body = text if any(b["type"] == "image" for b in text) else "".join(b["text"] for b in text)
        out.append({"role": role, "content": body} | ({"tool_calls": calls} if calls else {}))
    return out


def anthropic_conversation(req: ARequest, ignored: Optional[Counter] = None) -> list[dict]:
    """The canonical conversation of a Messages request; what it gives but is not honoured is counted in `ignored`.
    Deferred tools (tool search) are not shown to the model, as with the API."""
    ignored = Counter() if ignored is None else ignored
    _anthropic_options(req)
    ignored.update(_anthropic_ignored(req))
    msgs = [{"role": "system", "content": _text(req.system, "system")}] if req.system else []
    for i, m in enumerate(req.messages):
        msgs += _anthropic_blocks(m.role, m.content, f"messages.{i}", ignored)
    return with_tools(msgs, [{"name": t.name, "description": t.description, "parameters": t.input_schema}
                              for t in req.tools or [] if t.type in (None, "custom") and not t.defer_loading])


def same_message(a: dict, b: dict) -> bool:
    """Equal for accumulation: role, content and tool calls by (name, arguments); ids may be rewritten."""
    calls = lambda m: [(t["name"], json.dumps(t["arguments"], sort_keys=True)) for t in m.get("tool_calls", [])]
    return a["role"] == b["role"] and a["content"] == b["content"] and calls(a) == calls(b)


def template_messages(msgs: list[dict]) -> list[dict]:
    """Canonical messages as plain {role, content} for the chat template; tool calls written as text."""
    out = []
    for m in msgs:
        text = m["content"]
        for t in m.get("tool_calls", []):
            call = json.dumps({"name": t["name"], "arguments": t["arguments"]})
            text += f"{chr(10) if text else ''}<tool_call>\n{call}\n</tool_call>"
        out.append({"role": m["role"], "content": text})
    return out


# ---- reasoning ----

THINK_END = "</think>"


def split_thinking(text: str) -> tuple[str, str]:
    """(the reasoning as generated: up to `</think>` and the whitespace after it, the rest); ("", text) if none."""
    i = text.find(THINK_END)
    if i < 0:
        return "", text
    rest = text[i + len(THINK_END):]
    j = len(text) - len(rest.lstrip())
    return text[:j], text[j:]


def thinking_text(prefix: str) -> str:
    """What a reasoning item or thinking block shows of a reasoning prefix: the text between the tags."""
    return prefix.strip().removeprefix("<think>").removesuffix(THINK_END).strip()


def seal(prefix: str) -> str:
    """The handle of a reasoning prefix (encrypted_content, signature): the prefix itself, base64."""
    return base64.b64encode(prefix.encode()).decode()


def unseal(handle: Any, shown: str) -> str:
    """The reasoning prefix an echoed reasoning item or thinking block stands for: its handle's text when the handle
    is one of ours (decodes to a prefix showing `shown`), else the shown text wrapped in the tags."""
    try:
        prefix = base64.b64decode(handle, validate=True).decode() if isinstance(handle, str) and handle else ""
    except (binascii.Error, UnicodeDecodeError):
        prefix = ""
    ok = prefix.rstrip().endswith(THINK_END) and (not shown or thinking_text(prefix) == shown.strip())
    return prefix if ok else f"<think>\n{shown}\n{THINK_END}\n\n" if shown else ""


# ---- generated text -> reply ----


@dataclass
class Reply:
    """One assistant turn, protocol-neutral. finish: stop | length | tool_calls."""

    text: str
    tool_calls: list[dict] = field(default_factory=list)
    finish: str = "stop"
    stop_sequence: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    logprobs: Optional[list[tuple[str, float]]] = None  # (token text, behaviour log-prob) per generated token
    thinks: bool = False  # the model's template has a thinking section: `text` may start with reasoning

    @property
    def reasoning(self) -> tuple[str, str]:
        """(reasoning prefix as generated, the rest of the text): see split_thinking."""
        return split_thinking(self.text) if self.thinks else ("", self.text)

    @property
    def message(self) -> dict:
        """The canonical assistant message, as the agent will send it back."""
        return {"role": "assistant", "content": self.text} | ({"tool_calls": self.tool_calls} if self.tool_calls else {})


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content, calls) from generated text; (text, []) unless every <tool_call> block parses."""
    calls = []
    for body in TOOL_CALL.findall(text):
        obj = _json(body)
        args = _json(obj.get("arguments", {})) if isinstance(obj, dict) else None
        if not isinstance(args, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append({"id": f"call_{secrets.token_hex(8)}", "name": obj["name"], "arguments": args})
    return (TOOL_CALL.sub("", text).strip(), calls) if calls else (text, [])


# ---- reply -> OpenAI ----


def openai_response(r: Reply, model: str) -> dict:
    msg = {"role": "assistant", "content": r.text or (None if r.tool_calls else "")}
    if r.tool_calls:
        msg["tool_calls"] = [{"id": t["id"], "type": "function",
                              "function": {"name": t["name"], "arguments": json.dumps(t["arguments"])}}
                             for t in r.tool_calls]
    usage = {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
             "total_tokens": r.prompt_tokens + r.completion_tokens}
    return {"id": f"chatcmpl-{r.id}", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": msg, "finish_reason": r.finish, "logprobs": _logprobs(r)}],
            "usage": usage}


def _logprobs(r: Reply) -> Optional[dict]:
    """OpenAI's `logprobs` of a reply; `bytes` is null for a token that is part of a UTF-8 character."""
    if r.logprobs is None:
        return None
    return {"content": [{"token": t, "logprob": x, "bytes": None if "\ufffd" in t else list(t.encode()),
                         "top_logprobs": []} for t, x in r.logprobs], "refusal": None}


def openai_chunks(r: Reply, model: str, include_usage: bool) -> Iterator[str]:
    """The reply as `chat.completion.chunk` events: role, content, one chunk per tool call, finish."""
    full = openai_response(r, model)
    msg, head = full["choices"][0]["message"], {k: full[k] for k in ("id", "created", "model")}
    deltas = [{"role": "assistant", "content": ""}] + ([{"content": msg["content"]}] if msg["content"] else [])
    deltas += [{"tool_calls": [dict(t, index=i)]} for i, t in enumerate(msg.get("tool_calls", []))]
    for i, d in enumerate(deltas + [{}]):  # the log-probs of the whole reply ride on its first chunk
        choice = {"index": 0, "delta": d, "finish_reason": None if d else r.finish,
                  "logprobs": full["choices"][0]["logprobs"] if i == 0 else None}
        yield _sse({**head, "object": "chat.completion.chunk", "choices": [choice]})
    if include_usage:
        yield _sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": full["usage"]})
    yield "data: [DONE]\n\n"


def openai_error(message: str, status: int, code: Optional[str] = None, param: Optional[str] = None) -> dict:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind if status < 500 else "server_error", "param": param,
                      "code": code}}


# ---- reply -> Anthropic ----

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def anthropic_response(r: Reply, model: str, omit_thinking: bool = False) -> dict:
    """A Messages response: its reasoning (if any) as a thinking block whose signature is the handle of the generated
    text (`display: "omitted"` empties the shown text, as the API does), then text and tool_use blocks."""
    prefix, rest = r.reasoning
    content = [{"type": "thinking", "thinking": "" if omit_thinking else thinking_text(prefix),
                "signature": seal(prefix)}] if prefix else []
    content += [{"type": "text", "text": rest}] if rest or not r.tool_calls else []
    content += [{"type": "tool_use", "id": t["id"], "name": t["name"], "input": t["arguments"]} for t in r.tool_calls]
    reason = "stop_sequence" if r.stop_sequence is not None else STOP_REASONS[r.finish]
    return {"id": f"msg_{r.id}", "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": r.stop_sequence,
            "usage": {"input_tokens": r.prompt_tokens, "output_tokens": r.completion_tokens}}


_DELTAS = {"text": lambda b: [{"type": "text_delta", "text": b["text"]}],
           "thinking": lambda b: [{"type": "thinking_delta", "thinking": b["thinking"]}] * bool(b["thinking"])
           + [{"type": "signature_delta", "signature": b["signature"]}],
           "tool_use": lambda b: [{"type": "input_json_delta", "partial_json": json.dumps(b["input"])}]}
_STARTS = {"text": {"text": ""}, "thinking": {"thinking": "", "signature": ""}, "tool_use": {"input": {}}}


def anthropic_events(r: Reply, model: str, omit_thinking: bool = False) -> Iterator[str]:
    """The reply as named Messages stream events; each block is sent whole (a thinking block: its text, then its
    signature)."""
    full = anthropic_response(r, model, omit_thinking)
    start = {**full, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": r.prompt_tokens, "output_tokens": 0}}
    yield _sse({"type": "message_start", "message": start}, named=True)
    for i, b in enumerate(full["content"]):
        start = {"type": "content_block_start", "index": i, "content_block": {**b, **_STARTS[b["type"]]}}
        yield _sse(start, named=True)
        for delta in _DELTAS[b["type"]](b):
            yield _sse({"type": "content_block_delta", "index": i, "delta": delta}, named=True)
        yield _sse({"type": "content_block_stop", "index": i}, named=True)
    delta = {"stop_reason": full["stop_reason"], "stop_sequence": full["stop_sequence"]}
    yield _sse({"type": "message_delta", "delta": delta, "usage": {"output_tokens": r.completion_tokens}}, named=True)
    yield _sse({"type": "message_stop"}, named=True)


def anthropic_error(message: str, status: int) -> dict:
    kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}.get(status)
    return {"type": "error", "error": {"type": kind or ("invalid_request_error" if status < 500 else "api_error"),
                                       "message": message}}


def _sse(obj: dict, named: bool = False) -> str:
    """One server-sent event; a named one (Anthropic's) is named by the type of its data."""
    return (f"event: {obj['type']}\n" if named else "") + f"data: {json.dumps(obj)}\n\n"
