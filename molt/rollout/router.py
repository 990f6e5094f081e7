"""Sticky, least-loaded routing of rollout requests over engines.

Every request of one rollout goes to the engine that served its first request, so each turn
extends a prefix that engine already has cached. A new rollout goes to the engine with the
fewest requests in flight (ties: the fewest rollouts assigned, then the first engine). Weight
sync talks to the engines directly, never through here.

Identical requests bound for one engine in the same event-loop tick (the n rollouts of a group
asking for their first turn) are coalesced into one request with `n` samples: the engine's
per-request overhead, not its sampling, dominates short generations on CPU (64 requests of 4
tokens: 0.5-3 s; 8 requests of n=8: 0.11 s). The samples are independent either way.
"""
from __future__ import annotations

import asyncio

from molt.rollout.engine import EngineClient
from molt.types import Completion


class Router:
    def __init__(self, clients: list[EngineClient]):
        assert clients, "the router needs at least one engine (engine.num_engines >= 1)"
        self.clients = {c.name: c for c in clients}
        assert len(self.clients) == len(clients), "engine names must be unique"
        self.inflight = {c.name: 0 for c in clients}  # samples asked for and not yet answered
        self.rollouts = {c.name: 0 for c in clients}  # rollouts currently stuck to the engine
        self.assigned: dict[str, str] = {}  # rollout_id -> engine name
        self.pending: dict[tuple, list[asyncio.Future]] = {}  # coalescing requests, by (engine, request)
        self.features: dict[tuple, dict] = {}  # the images of a pending request (its key holds their hashes)

    async def render(self, rollout_id: str, messages: list[dict]) -> dict:
        """The engine's rendering of chat messages with images (molt/agents/images.py), on the rollout's engine."""
        return await self.clients[self.engine_for(rollout_id)].render(messages)

    def engine_for(self, rollout_id: str) -> str:
        name = self.assigned.get(rollout_id)
        if name is None:
            name = min(self.clients, key=lambda n: (self.inflight[n], self.rollouts[n]))
            self.assigned[rollout_id] = name
            self.rollouts[name] += 1
        return name

    async def generate(self, rollout_id: str, token_ids: list[int], max_tokens: int, features: dict | None = None,
                       **sampling) -> Completion:
        name = self.engine_for(rollout_id)
        key = (name, tuple(token_ids), max_tokens, tuple(sorted((k, _frozen(v)) for k, v in sampling.items())),
               _image_key(features))
        if sampling.get("temperature", 1.0) == 0:  # vLLM takes n=1 only for greedy decoding: never coalesce
            key += (object(),)
        if features:
            self.features[key] = features
        waiters = self.pending.setdefault(key, [])
        waiters.append(asyncio.get_running_loop().create_future())
        self.inflight[name] += 1  # counted from now, so placement sees requests not yet sent
        if len(waiters) == 1:  # the first asker sends, after the requests already scheduled had a chance to join
            asyncio.get_running_loop().create_task(self._send(key))
        return await waiters[-1]

    __call__ = generate  # the Router is itself a Generate, one that can also render

    async def _send(self, key: tuple) -> None:
        waiters = self.pending.pop(key)
        name, ids, max_tokens, sampling = key[:4]
        sampling = {k: list(v) if isinstance(v, tuple) else v for k, v in sampling}
        try:
            outs = await self.clients[name].generate_n(list(ids), max_tokens, len(waiters),
                                                       features=self.features.pop(key, None), **sampling)
            for w, out in zip(waiters, outs):
                if not w.done():  # an asker may have been cancelled meanwhile
                    w.set_result(out)
        except BaseException as e:  # every asker sees the engine's failure (EngineDied included)
            for w in waiters:
                if not w.done():
                    w.set_exception(e)
        finally:
            self.inflight[name] -= len(waiters)

    def release(self, rollout_id: str) -> None:
        """Forget a finished rollout; its next request (if any) is placed afresh."""
        name = self.assigned.pop(rollout_id, None)
        if name is not None:
            self.rollouts[name] -= 1

    def load(self) -> dict[str, int]:
        return dict(self.inflight)


def _image_key(features: dict | None) -> tuple:
    """Requests with the same ids coalesce only when their images are the same (by the engine's hashes)."""
    return () if not features else tuple(features["mm_hashes"].get("image", []))


def _frozen(v):
    return tuple(v) if isinstance(v, list) else v
