"""The loopback chat server of ChatAgent mode: OpenAI- and Anthropic-speaking agents, recorded token for token.

One server per rollout worker (FastAPI on uvicorn, in the worker's own event loop, bound to
127.0.0.1, port picked by the OS); one session per rollout:

    srv = await start_server()                        # or: await shared_server(), one per event loop
    s = open_session(srv, "g3/0", router.generate, tokenizer, agent_cfg, sampling)
    OpenAI(base_url=f"{srv.url}/s/{s.sid}/v1", api_key=s.key)       # POST .../v1/chat/completions, .../v1/responses
    Anthropic(base_url=f"{srv.url}/s/{s.sid}", api_key=s.key)       # POST .../v1/messages, .../count_tokens
    close_session(srv, s); s.segments                 # the trajectory; later requests get 404

Isolation: a session is addressed by a random id in the path *and* must present its own random key
(`Authorization: Bearer` or `x-api-key`), so a rollout can never write into another's trajectory.
Requests of one session are served one at a time, in arrival order.

Token-exact accumulation. A session keeps the canonical messages behind its current segment (the
last one being the reply it returned). A request whose conversation starts with exactly those
messages and adds new, non-generated ones *extends* it: the new messages are appended as ids, a
delta of the chat template (`render_delta`), after the ids the engine generated, which are never
re-tokenized. Any other request (the agent summarised, dropped or edited turns, changed the system
prompt or the tools, retried, or the template re-renders earlier turns) *compacts*: the current
segment is sealed and a new one starts from the rendering of the whole request, in which every
earlier reply of the session appears as the engine's own ids (spliced into the template, never
re-encoded from its text). Every reply's ids, behaviour log-probs and weight version are appended
with loss mask 1. A request that fails (bad input, budget, engine error) appends nothing, and
neither does one whose client disconnected before the reply was sent (the SDK's retry then
extends the same history).

Failures. Anything wrong with a request before generation (a body over agent.max_request_bytes:
413; bad JSON, wrong types, blocks the decoder cannot read, messages the template cannot render:
400) is the agent's fault: it gets the protocol's error and its rollout is marked failed; the run
goes on. A client that disconnects, or sends less than a whole request within the server's timeout
(then it is disconnected), fails nothing: its SDK retries. Only a failure of this server or the
engine (500, 503) stops the run. Unknown paths and
wrong methods answer in the protocol's error shape too. Decoding and rendering run on threads, so a
large request does not stall the other sessions.

Sampling and budgets. The rollout's sampling parameters (rollout.temperature/top_p/top_k) always
win over a request's `temperature`/`top_p`: the actor recomputes log-probs at the configured
temperature, so any other would make the importance ratios wrong. A request's `max_tokens` is capped
by agent.max_tokens_per_turn (which is also the default) and by the room left under
agent.max_total_tokens, the context budget of one request (prompt + reply). More than
agent.max_turns requests, or a prompt that fills the context budget, are refused with a 400 (the latter in
Anthropic's words, "prompt is too long: N tokens > M maximum", on which Claude Code compacts its context). A reply
the budget cut ends with `length` / `max_tokens` (Claude Code then asks the model to resume, 3 times at most, and
gives up: run the CLI with CLAUDE_CODE_MAX_OUTPUT_TOKENS=agent.max_tokens_per_turn so that its requests say so);
`Session.cut` tells chat_agent.py that an agent giving up then truncated its rollout.
`POST .../v1/messages/count_tokens` answers the prompt length the same request would have: nothing is generated.

Stop strings (`stop`, at most 4; `stop_sequences`, at most 8191) are applied to the decoded reply, on a
thread: generation is not cut early, but the reply is cut at the first stop string and so are the
recorded ids (at the token that completes it). Streaming: the reply is generated whole, then sent as
stream events. Options the policy cannot honour (constrained output, forced tool calls, penalties,
seeds, top log-probs) are refused with a 400 naming them (chat_wire.py), never ignored. Fields whose absence changes
no sampled token are accepted and counted in `Session.ignored`: of the Responses API built-in tools,
prompt_cache_key, reasoning, ... (responses.py); of Anthropic Messages thinking (the model thinks as its template
says; its reasoning comes back as a thinking block), tools Anthropic defines, redacted_thinking blocks,
context_management, output_config, metadata, ... (chat_wire.py). `cache_control` anywhere, `?beta=true` and
`anthropic-beta` headers are accepted as they are: the engine's prefix cache caches anyway.
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import logging
import secrets
import socket
import weakref
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from molt.agents import chat_wire as wire
from molt.agents import images, responses
from molt.agents.render import TemplateError, render
from molt.config import AgentConfig
from molt.rollout.features import image_features
from molt.types import Completion, EngineDied, Generate, Image, Segment

log = logging.getLogger(__name__)


class ChatError(StarletteHTTPException):
    """A request refused with an HTTP status (build_app answers it in the protocol's error shape)."""

    def __init__(self, status: int, message: str, code: Optional[str] = None, param: Optional[str] = None):
        super().__init__(status, message)
        self.code, self.param = code, param


@dataclass
class Session:
    rollout_id: str
    generate: Generate
    tokenizer: Any
    cfg: AgentConfig
    sampling: dict
    sid: str = field(default_factory=lambda: secrets.token_hex(8))
    key: str = field(default_factory=lambda: secrets.token_hex(16))
    segments: list[Segment] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)  # canonical messages behind segments[-1]
    turns: int = 0  # replies generated
    refused: int = 0  # requests refused for a budget (max_turns, context)
    cut: bool = False  # the latest reply was cut by a budget (max_tokens_per_turn, the context's room), not the request
    cuts: int = 0  # replies so cut
    rejected: int = 0  # requests refused as malformed (400, 413): the agent's fault, the rollout fails
    rejection: str = ""  # the last such refusal's message
    replies: list[tuple[dict, list[int]]] = field(default_factory=list)  # (message returned, the engine's ids)
    responses: dict[str, list[dict]] = field(default_factory=dict)  # stored Responses API id -> its conversation
    ignored: collections.Counter = field(default_factory=collections.Counter)  # accepted fields that change nothing
    error: Optional[BaseException] = None  # a failure that is not the agent's: the runner re-raises it
    bad_image: Optional[str] = None  # the reason a request's image was refused: the rollout fails
    closed: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


# ---- accumulation ----


def cut_at_stop(tokenizer, ids: list[int], stops: list[str]) -> tuple[int, str, Optional[str]]:
    """(ids kept, reply text, stop string hit). Kept: the shortest prefix whose text holds a stop string. Each stop
    string is searched for once (thousands may come: Anthropic's stop_sequences)."""
    decode = lambda n: tokenizer.decode(ids[:n], skip_special_tokens=True)  # noqa: E731  the first n ids as text
    text = decode(len(ids))
    hits = [s for s in stops if s in text]
    if not hits:
        return len(ids), text, None
    first = min(hits, key=lambda s: text.index(s) + len(s))  # the one completed first decides where the cut falls
    # "the text holds it" is monotone in the prefix length: bisect
    keep = 1 + bisect.bisect_left(range(1, len(ids)), True, key=lambda n: first in decode(n))
    text = decode(keep)
    at, stop = min((text.index(s), s) for s in hits if s in text)
    return keep, text[:at], stop


def _spliced(s: Session, convo: list[dict]) -> dict[int, list[int]]:
    """Message index -> the engine's ids, for each assistant message of `convo` that is a reply this session
    returned (matched in order): a rebuilt segment holds model output as its own ids, never re-encoded text."""
    out, j = {}, 0
    for i, m in enumerate(convo):
        k = next((k for k in range(j, len(s.replies)) if wire.same_message(s.replies[k][0], m)), None) \
            if m["role"] == "assistant" else None
        if k is not None:
            out[i], j = s.replies[k][1], k + 1
    return out


async def _render(s: Session, convo: list[dict]) -> tuple[list[int], bool, list[Image]]:
    """(prompt ids, fresh, the prompt's images): extend the current segment by a template delta, or start a new
    one (molt/agents/render.py)."""
    n = len(s.history)
    try:
        if n and len(convo) > n and all(map(wire.same_message, s.history, convo)):
            seg, new = s.segments[-1], wire.template_messages(convo[n:])
            with contextlib.suppress(TemplateError):  # the template rewrites earlier turns once more follow: compact
                delta, ims = await render(s.tokenizer, new, s.generate, s.rollout_id, s.cfg, after=seg)
                return seg.token_ids + delta, False, seg.images + images.shifted(ims, len(seg.token_ids))
        ids, ims = await render(s.tokenizer, wire.template_messages(convo), s.generate, s.rollout_id, s.cfg,
                                _spliced(s, convo))
        return ids, True, ims
    except (images.ImageError, EngineDied):
        raise
    except Exception as e:  # the template raising on the request's messages (e.g. a role it refuses)
        raise _reject(s, 400, f"the chat template cannot render these messages: {type(e).__name__}: {e}") from e


def _reject(s: Session, status: int, message: str, param: Optional[str] = None) -> ChatError:
    s.rejected, s.rejection = s.rejected + 1, message
    return ChatError(status, message, param=param)


def _refuse(s: Session, message: str, code: str) -> ChatError:
    s.refused += 1
    return ChatError(400, message, code)


def _record(s: Session, prompt: list[int], fresh: bool, ims: list[Image], c: Completion, keep: int) -> None:
    if fresh:
        s.segments.append(Segment())
    seg = s.segments[-1]
    seg.append(prompt[len(seg.token_ids):], images=images.shifted(ims[len(seg.images):], -len(seg.token_ids)))
    seg.append(c.token_ids[:keep], generated=True, logprobs=c.logprobs[:keep], version=c.token_versions[:keep])
    seg.attach_routes(c.routed_experts)  # the prompt was this segment's prefix


def _reply(s: Session, text: str, stop: Optional[str], c: Completion, keep: int, tools_on: bool,
           n_prompt: int) -> wire.Reply:
    thinks = wire.THINK_END in (getattr(s.tokenizer, "chat_template", None) or "")
    content, calls = wire.parse_tool_calls(text) if tools_on else (text, [])
    finish = "tool_calls" if calls else "stop" if stop is not None or c.finish_reason == "stop" else "length"
    return wire.Reply(content, calls, finish, stop, prompt_tokens=n_prompt, completion_tokens=keep, thinks=thinks)


async def complete(s: Session, convo: list[dict], max_tokens: Optional[int], stops: list[str], tools_on: bool,
                   gone: Callable[[], Awaitable[bool]], logprobs: bool = False) -> wire.Reply:
    """Serve one request of a session: accumulate, generate, record, reply. `gone()` says whether the client
    disconnected: a reply it never received is not recorded (its SDK's retry then extends the same history).
    `logprobs`: the reply carries each generated token's behaviour log-prob."""
    async with s.lock:
        if s.closed:
            raise ChatError(404, f"session of rollout {s.rollout_id} has ended")
        if s.turns >= s.cfg.max_turns:
            raise _refuse(s, f"this rollout already made agent.max_turns={s.cfg.max_turns} requests", "max_turns")
        try:
            prompt, fresh, ims = await _render(s, convo)
        except images.ImageError as e:  # the rollout fails with the reason counted (chat_agent.py)
            s.bad_image = e.reason
            raise ChatError(400, f"bad image: {e}", f"image_{e.reason}") from e
        room = s.cfg.max_total_tokens - len(prompt)
        if room < 1:  # Anthropic's words, which Claude Code reads as "compact the context" (shared/HARNESSES.md)
            raise _refuse(s, f"prompt is too long: {len(prompt)} tokens > {s.cfg.max_total_tokens - 1} maximum "
                             f"(agent.max_total_tokens={s.cfg.max_total_tokens} leaves no room to reply)",
                          "context_length_exceeded")
        budget = min(s.cfg.max_tokens_per_turn, room)
        limit = min(max_tokens or budget, budget)
        c = await s.generate(s.rollout_id, prompt, limit, **s.sampling, **image_features(ims))
        if s.closed:  # the rollout ended while the engine worked: its trajectory is final
            raise ChatError(404, f"session of rollout {s.rollout_id} has ended")
        if await gone():
            raise ChatError(499, "the client disconnected before the reply: the turn is not recorded")
        keep, text, stop = await asyncio.to_thread(cut_at_stop, s.tokenizer, c.token_ids, [x for x in stops if x])
        _record(s, prompt, fresh, ims, c, keep)
        s.turns += 1
        reply = _reply(s, text, stop, c, keep, tools_on, len(prompt))
        s.cut = reply.finish == "length" and limit == budget
        s.cuts += s.cut
        if logprobs:
            reply.logprobs = [(s.tokenizer.decode([t]), x) for t, x in zip(c.token_ids[:keep], c.logprobs[:keep])]
        s.history = convo + [reply.message]
        s.replies.append((reply.message, c.token_ids[:keep]))
        return reply


# ---- the three protocols ----


@dataclass
class Wire:
    schema: type
    conversation: Callable[[Any, Session], list[dict]]
    options: Callable[[Any], dict]  # complete()'s max_tokens, stops, tools_on, logprobs
    response: Callable[[wire.Reply, str, Any], dict]
    events: Callable[[wire.Reply, str, Any], Iterator[str]]
    keep: Optional[Callable[[Session, Any, wire.Reply], None]] = None  # after a reply: what the protocol stores


OPENAI = Wire(
    wire.OAIRequest, lambda r, s: wire.openai_conversation(r),
    lambda r: dict(max_tokens=r.max_completion_tokens or r.max_tokens,
                   stops=[r.stop] if isinstance(r.stop, str) else r.stop or [],
                   tools_on=bool(r.tools) and r.tool_choice != "none", logprobs=bool(r.logprobs)),
    lambda reply, model, r: wire.openai_response(reply, model),
    lambda reply, model, r: wire.openai_chunks(reply, model, bool((r.stream_options or {}).get("include_usage"))))
ANTHROPIC = Wire(
    wire.ARequest, lambda r, s: wire.anthropic_conversation(r, s.ignored),
    lambda r: dict(max_tokens=r.max_tokens, stops=r.stop_sequences or [],
                   tools_on=bool(r.tools) and (r.tool_choice or {}).get("type") != "none"),
    lambda reply, model, r: wire.anthropic_response(reply, model, r.omit_thinking),
    lambda reply, model, r: wire.anthropic_events(reply, model, r.omit_thinking))
COUNT = Wire(wire.ACount, lambda r, s: wire.anthropic_conversation(r), ANTHROPIC.options, None, None)  # nothing counted
RESPONSES = Wire(responses.RRequest, responses.conversation, responses.options, responses.response, responses.events,
                 responses.keep)


# ---- the server ----


RELAY_HEADER = "X-Session-ID"  # verifiers' eval client sends its trace id in it, the same on every turn of a run


@dataclass
class Relay:
    """A stable route for one client that serves many sessions (verifiers' eval client keeps one HTTP client per
    base URL for as long as it runs): one key; each request names its session by RELAY_HEADER. The relay's owner
    registers a session under that name before the client's first request of it is sent, but the announcement may
    be read after the request arrives: an unknown name is waited for, `wait_s` at most."""

    sid: str = field(default_factory=lambda: secrets.token_hex(8))
    key: str = field(default_factory=lambda: secrets.token_hex(16))
    sessions: dict[str, Session] = field(default_factory=dict)
    wait_s: float = 10.0

    async def session(self, name: str) -> Session:
        for _ in range(int(self.wait_s / 0.01)):
            if name in self.sessions:
                break
            await asyncio.sleep(0.01)
        if name not in self.sessions:
            raise ChatError(404, f"unknown {RELAY_HEADER} {name!r} on this route: it has ended or never existed")
        return self.sessions[name]


@dataclass
class ChatServer:
    model: str = "policy"  # the name /v1/models lists; replies echo the request's model (any name: there is one policy)
    sessions: dict[str, Session] = field(default_factory=dict)
    relays: dict[str, Relay] = field(default_factory=dict)  # route id -> Relay: routes shared by many sessions
    port: int = 0
    server: Optional[uvicorn.Server] = None
    task: Optional[asyncio.Task] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _check_key(request: Request, key: str) -> None:
    given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
    if not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise ChatError(401, "wrong API key for this session (use the key the rollout was given)")


async def _session(srv: ChatServer, sid: str, request: Request, named: bool = True) -> Optional[Session]:
    """The request's session: by its route, or on a relay's route by its X-Session-ID (None when not `named`)."""
    relay = srv.relays.get(sid)
    if relay is not None:
        _check_key(request, relay.key)
        return await relay.session(request.headers.get(RELAY_HEADER, "")) if named else None
    s = srv.sessions.get(sid)
    if s is None:
        raise ChatError(404, f"unknown session {sid!r}: it has ended or never existed")
    _check_key(request, s.key)
    return s


async def _body(s: Session, request: Request) -> bytes:
    """The request body, refused with 413 past agent.max_request_bytes before it is read whole or parsed."""
    limit, body = s.cfg.max_request_bytes, bytearray()
    if int(request.headers.get("content-length") or 0) > limit:
        raise _reject(s, 413, f"the request is larger than agent.max_request_bytes={limit}")
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _reject(s, 413, f"the request is larger than agent.max_request_bytes={limit}")
    return bytes(body)


def _read(s: Session, w: Wire, body: bytes) -> tuple[Any, list[dict], dict]:
    """(request, conversation, complete()'s options). Any failure before generation is the agent's: a 400."""
    try:
        req = wire.parse_request(w.schema, body)
        return req, w.conversation(req, s), w.options(req)
    except Exception as e:
        raise _reject(s, 400, str(e) if isinstance(e, wire.WireError) else
                      f"malformed request: {type(e).__name__}: {e}", getattr(e, "param", None)) from e


async def _serve(srv: ChatServer, sid: str, request: Request, w: Wire):
    s = await _session(srv, sid, request)
    try:
        req, convo, options = await asyncio.to_thread(_read, s, w, await _body(s, request))
        reply = await complete(s, convo, **options, gone=request.is_disconnected)
        if w.keep is not None:
            w.keep(s, req, reply)
    except ChatError:
        raise
    except ClientDisconnect:  # mid-upload: the agent's event (its SDK retries), never the run's; nothing to answer
        log.info("a client of session %s disconnected while sending its request", sid)
        raise ChatError(499, "the client disconnected while sending the request") from None
    except EngineDied as e:  # not the agent's fault: the runner re-raises it
        s.error = e
        raise ChatError(503, f"the policy engine is gone: {e}") from e
    except Exception as e:  # a server-side failure: answer 500, and the runner re-raises it (not the agent's fault)
        log.exception("chat server failed on a request of session %s", sid)
        if s.error is None:
            s.error = e
        raise ChatError(500, f"internal error: {type(e).__name__}: {e}") from e
    model = req.model or srv.model
    if req.stream:
        return StreamingResponse(w.events(reply, model, req), media_type="text/event-stream")
    return JSONResponse(w.response(reply, model, req))


async def _count_tokens(srv: ChatServer, sid: str, request: Request) -> dict:
    """The prompt length of a Messages request as complete() would render it (extending the current segment or not),
    from the chat template; nothing is generated, recorded or counted as a turn."""
    s = await _session(srv, sid, request)
    _, convo, _ = await asyncio.to_thread(_read, s, COUNT, await _body(s, request))
    async with s.lock:
        try:
            prompt, _, _ = await _render(s, convo)
        except images.ImageError as e:
            raise ChatError(400, f"bad image: {e}", f"image_{e.reason}") from e
    return {"input_tokens": len(prompt)}


def build_app(srv: ChatServer) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(StarletteHTTPException)  # a ChatError; unknown paths, wrong methods: the same shapes
    async def http_error(request: Request, e: StarletteHTTPException):
        body = (wire.anthropic_error(str(e.detail), e.status_code) if "/v1/messages" in request.url.path else
                wire.openai_error(str(e.detail), e.status_code, getattr(e, "code", None), getattr(e, "param", None)))
        return JSONResponse(body, status_code=e.status_code)

    @app.get("/s/{sid}/v1/models")
    async def models(sid: str, request: Request):
        await _session(srv, sid, request, named=False)
        return {"object": "list", "data": [{"id": srv.model, "object": "model", "created": 0, "owned_by": "molt"}]}

    @app.post("/s/{sid}/v1/chat/completions")
    async def chat_completions(sid: str, request: Request):
        return await _serve(srv, sid, request, OPENAI)

    @app.post("/s/{sid}/v1/messages")
    async def messages(sid: str, request: Request):
        return await _serve(srv, sid, request, ANTHROPIC)

    @app.post("/s/{sid}/v1/messages/count_tokens")
    async def count_tokens(sid: str, request: Request):
        return await _count_tokens(srv, sid, request)

    @app.post("/s/{sid}/v1/responses")
    async def responses_(sid: str, request: Request):
        return await _serve(srv, sid, request, RESPONSES)

    return app


class _Deadline(AutoHTTPProtocol):
    """uvicorn's HTTP protocol, plus a deadline: a request must arrive whole within `timeout_keep_alive` of the
    connection opening or of the previous response, else the connection is closed (a request cut off in its body
    then ends as a client disconnect). uvicorn has no such timeout: its keep-alive timer stops at the first byte,
    so a client that sent half its headers or half its body held its connection open forever."""

    deadline: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport):
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self):
        super().on_response_complete()
        self._arm()

    def _arm(self):
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = self.loop.call_later(self.timeout_keep_alive, self._expire)

    def _expire(self):
        c = self.cycle  # the latest request: none yet, its body still arriving, or answered (the next one is late)
        if c is None or c.more_body or c.response_complete:
            self.transport.close()


async def start_server(timeout: float = 30) -> ChatServer:
    """Serve on 127.0.0.1 (a free port) inside the running event loop; returns once it accepts connections.
    A request must arrive whole within `timeout` seconds of the connection or of the previous reply."""
    srv = ChatServer()
    # proto IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and
    # accepted sockets inherit it; without it every reply waits ~40 ms for a delayed ACK (Nagle)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    srv.port = sock.getsockname()[1]
    # log_config=None: leave the process's logging alone; lifespan off: the app has no startup hooks
    config = uvicorn.Config(build_app(srv), log_config=None, access_log=False, lifespan="off",
                            timeout_keep_alive=timeout, http=_Deadline)
    srv.server = uvicorn.Server(config)
    srv.task = asyncio.create_task(srv.server.serve(sockets=[sock]))
    while not srv.server.started:
        if srv.task.done():
            srv.task.result()  # raises what stopped the server from starting
            raise RuntimeError("the chat server exited while starting")
        await asyncio.sleep(0.005)
    return srv


_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> Future[ChatServer]


async def shared_server() -> ChatServer:
    """The running event loop's server, started on first use: one per rollout worker."""
    loop = asyncio.get_running_loop()
    if loop not in _SHARED:
        _SHARED[loop] = asyncio.ensure_future(start_server())
    return await asyncio.shield(_SHARED[loop])


async def stop_shared_server() -> None:
    fut = _SHARED.pop(asyncio.get_running_loop(), None)
    if fut is not None:
        srv = await fut
        srv.server.should_exit = True
        await srv.task


def open_session(srv: ChatServer, rollout_id: str, generate: Generate, tokenizer, cfg: AgentConfig,
                 sampling: dict) -> Session:
    assert cfg.max_turns >= 1 and cfg.max_tokens_per_turn >= 1, "set agent.max_turns, agent.max_tokens_per_turn >= 1"
    s = Session(rollout_id, generate, tokenizer, cfg, dict(sampling))
    srv.sessions[s.sid] = s
    return s


def close_session(srv: ChatServer, s: Session) -> list[Segment]:
    """End a session: later requests get 404 and its segments are final."""
    s.closed = True
    srv.sessions.pop(s.sid, None)
    return s.segments
