"""Property-based fuzzing of the chat server's two wire protocols (issue 11): 4,000 generated requests in make test
(about 25 s on 2 cores; 10,000 took 125 s), and 1,000 dropped connections (issue 23).

Bodies are drawn by hypothesis from near-valid shapes (the protocols' own fields and blocks, with any JSON in any
slot) and from raw bytes, and sent through the server's real ASGI app (in process: no sockets, so the budget goes
to requests, not to the loopback stack). For every request: a protocol response (200, or 4xx in the protocol's
error shape; never a 5xx), and another session's trajectory untouched. At the end the server still serves a valid
request. Dropped connections go over real loopback sockets: a valid request cut at any byte (request line,
headers or body; content-length or chunked) and closed, then the same request whole, which must be served and
leave no error on the session. The engine is a scripted fake (tests/agents/test_chat_hostile.py).
More examples: MOLT_FUZZ_EXAMPLES.
(schemathesis is not used: the routes read their bodies themselves, so the app's OpenAPI schema says nothing
about them; the strategies below are the schema.)
"""
import json
import os
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from molt.agents.chat_server import build_app, close_session, open_session, shared_server
from molt.config import AgentConfig
from tests.agents.test_chat_hostile import Scripted, _settled, loop, run, tok  # noqa: F401 (fixtures)

EXAMPLES = int(os.environ.get("MOLT_FUZZ_EXAMPLES", "2000"))  # per protocol: 4,000 requests in all
CFG = AgentConfig(mode="chat", max_turns=10**9, max_tokens_per_turn=4, max_total_tokens=256, max_request_bytes=4096)
leaf = st.none() | st.booleans() | st.integers(-3, 10**12) | st.floats(allow_nan=False) | st.text(max_size=12)
anything = st.recursive(leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                        max_leaves=8)
kinds = st.sampled_from(["text", "image", "image_url", "tool_use", "tool_result", "document"]) | st.text(max_size=4)
block = st.fixed_dictionaries({"type": kinds}, optional={k: anything | st.text(max_size=20) for k in (
    "text", "content", "name", "input", "id", "is_error", "tool_use_id", "image_url", "source")})
content = st.text(max_size=40) | st.lists(block | anything, max_size=3) | anything
roles = st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | anything
message = st.fixed_dictionaries({"role": roles}, optional={"content": content, "tool_calls": anything,
                                                            "tool_call_id": anything, "name": anything})
common = {"model": anything, "stream": st.booleans() | anything, "tools": anything, "tool_choice": anything,
          "temperature": anything, "top_p": anything}
bodies = {
    "oai": st.fixed_dictionaries({"messages": st.lists(message, max_size=4) | anything}, optional={
        **common, "max_tokens": st.integers(-1, 9) | anything, "max_completion_tokens": anything, "stop": anything,
        "n": anything, "stream_options": anything}),
    "ant": st.fixed_dictionaries({"messages": st.lists(message, max_size=4) | anything,
                                  "max_tokens": st.integers(-1, 9) | anything}, optional={
        **common, "system": content, "stop_sequences": anything, "top_k": anything}),
}
ROUTES = {"oai": "/v1/chat/completions", "ant": "/v1/messages"}
# well-formed requests with fuzzed text, so that every run also exercises the served path (200s)
valid = st.fixed_dictionaries({"max_tokens": st.integers(1, 4), "messages": st.lists(st.fixed_dictionaries(
    {"role": st.just("user"), "content": st.text(max_size=20)}), min_size=1, max_size=1)})


def shape_ok(kind: str, status: int, body: bytes) -> bool:
    if status == 200:
        return True
    err = json.loads(body)
    if kind == "oai":
        return set(err) == {"error"} and isinstance(err["error"]["message"], str)
    return err["type"] == "error" and isinstance(err["error"]["type"], str)


@pytest.fixture(scope="module")
def fuzz(loop, tok):  # noqa: F811
    async def start():
        srv = await shared_server()
        victim = open_session(srv, "fuzz/victim", Scripted([tok.encode("kept") + [2]]), tok, CFG, {})
        target = open_session(srv, "fuzz/target", Scripted([tok.encode("ok") + [2]]), tok, CFG, {})
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(srv)), base_url="http://fuzz")
        r = await client.post(f"/s/{victim.sid}/v1/chat/completions", headers={"Authorization": f"Bearer {victim.key}"},
                              json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        return srv, victim, target, client

    srv, victim, target, client = run(loop, start())
    before = [list(s.token_ids) for s in victim.segments]
    yield srv, victim, target, client
    assert [s.token_ids for s in victim.segments] == before, "another session was touched"

    async def stop():
        await client.aclose()
        for seg in close_session(srv, victim) + close_session(srv, target):
            seg.check()  # whatever was sent, what the sessions recorded is well formed

    run(loop, stop())


def send(loop, fuzz, kind: str, raw: bytes):  # noqa: F811
    _, _, target, client = fuzz
    headers = {"Authorization": f"Bearer {target.key}", "x-api-key": target.key, "content-type": "application/json"}

    async def go():
        r = await client.post(f"/s/{target.sid}{ROUTES[kind]}", content=raw, headers=headers)
        return r.status_code, await r.aread()

    return run(loop, go())


@pytest.mark.parametrize("kind", ["oai", "ant"])
def test_fuzzed_requests_get_protocol_answers(loop, fuzz, kind):  # noqa: F811
    statuses, t0 = [], time.perf_counter()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=(valid | bodies[kind]).map(lambda b: json.dumps(b).encode()) | st.binary(max_size=64))
    def one(body):
        status, answer = send(loop, fuzz, kind, body)
        statuses.append(status)
        assert status == 200 or 400 <= status < 500, (status, body, answer)
        assert shape_ok(kind, status, answer), (status, body, answer)

    one()
    print(f"\n{kind}: {len(statuses)} requests in {time.perf_counter() - t0:.1f} s, {statuses.count(200)} served, "
          f"{sum(400 <= s < 500 for s in statuses)} refused")
    assert len(statuses) >= EXAMPLES and statuses.count(200) > 0 and 400 in statuses
    ok = {"model": "p", "max_tokens": 2, "messages": [{"role": "user", "content": "still there?"}]}
    assert send(loop, fuzz, kind, json.dumps(ok).encode())[0] == 200  # the server is alive


def raw_request(kind: str, s, body: bytes, chunked: bool) -> bytes:
    """A whole HTTP/1.1 request to session `s`, asking the server to close the connection after its answer."""
    if chunked:
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    head = [f"POST /s/{s.sid}{ROUTES[kind]} HTTP/1.1", "host: 127.0.0.1", f"authorization: Bearer {s.key}",
            f"x-api-key: {s.key}", "content-type: application/json", "connection: close",
            "transfer-encoding: chunked" if chunked else f"content-length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def exchange(port: int, raw: bytes) -> bytes:
    """Send `raw` on a fresh loopback connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        return b"".join(iter(lambda: sock.recv(1 << 16), b""))


@pytest.mark.parametrize("kind", ["oai", "ant"])
def test_dropped_connections_leave_the_session_healthy(loop, fuzz, kind):  # noqa: F811
    srv, _, target, _ = fuzz
    n, t0 = [0], time.perf_counter()

    @settings(max_examples=max(EXAMPLES // 4, 10), deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=valid.map(lambda b: json.dumps(b).encode()), chunked=st.booleans(), data=st.data())
    def one(body, chunked, data):
        raw = raw_request(kind, target, body, chunked)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(raw[:data.draw(st.integers(0, len(raw) - 1), label="cut")])  # then closed
        answer = exchange(srv.port, raw)
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        assert target.error is None, target.error
        n[0] += 1

    one()
    run(loop, _settled(srv))  # every dropped request has been handled
    print(f"\n{kind}: {n[0]} dropped connections in {time.perf_counter() - t0:.1f} s")
    assert n[0] >= EXAMPLES // 4 and target.error is None
