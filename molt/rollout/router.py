"""Sticky, least-loaded routing of rollout requests over engines.

Every request of one rollout goes to the engine that served its first request, so each turn
extends a prefix that engine already has cached. A new rollout goes to the engine with the
fewest requests in flight (ties: the fewest rollouts assigned, then the first engine). Weight
sync talks to the engines directly, never through here.

Identical requests bound for one engine in the same event-loop tick (the n rollouts of a group
asking for their first turn) are coalesced into one request with `n` samples: the engine's
per-request overhead, not its sampling, dominates short generations on CPU (64 requests of 4
tokens: 0.5-3 s; 8 requests of n=8: 0.11 s). The samples are independent either way.

Seeded sampling (`seed`): rollout i of group g asks with seed base(seed, g, turn) + i, and a coalesced
request of samples i..j is sent with base + i, since vLLM seeds its k-th sample with seed + k: a rollout
draws the same tokens from the same weights alone or coalesced, on any engine, after a retry or a resume.

Engines that die (`on_down`): the first failure of an engine (EngineDied) is reported once per incarnation;
until `up(name)` says its replacement is ready, new requests go to the live engines, or wait for one.
"""
from __future__ import annotations

import asyncio
import hashlib
from typing import Callable

from molt.rollout.engine import EngineClient
from molt.types import Completion, EngineDied


class Router:
    def __init__(self, clients: list[EngineClient], seed: int | None = None,
                 on_down: Callable[[str, int], None] | None = None, sticky: bool = True):
        assert clients, "the router needs at least one engine (engine.num_engines >= 1)"
        self.clients = {c.name: c for c in clients}
        assert len(self.clients) == len(clients), "engine names must be unique"
        self.inflight = {c.name: 0 for c in clients}  # samples asked for and not yet answered
        self.rollouts = {c.name: 0 for c in clients}  # rollouts currently stuck to the engine
        self.assigned: dict[str, str] = {}  # rollout_id -> engine name
        self.pending: dict[tuple, list[tuple[int | None, asyncio.Future]]] = {}  # coalescing: (seed, future) each
        self.features: dict[tuple, dict] = {}  # the images of a pending request (its key holds their hashes)
        self.seed, self.turns = seed, {}  # rollout_id -> engine calls so far (the turn of its next call)
        self.on_down, self.down, self.epoch = on_down, set(), {c.name: 0 for c in clients}  # incarnations
        self.changed = asyncio.Event()  # an engine came back
        self.sticky = sticky  # false: every request to the least-loaded engine (a baseline for prefix-cache reuse)

    async def render(self, rollout_id: str, messages: list[dict]) -> dict:
        """The engine's rendering of chat messages with images (molt/agents/images.py), on the rollout's engine."""
        return await self.clients[await self.engine_for(rollout_id)].render(messages)

    async def engine_for(self, rollout_id: str) -> str:
        name = self.assigned.get(rollout_id)
        if name in self.down:  # its engine died: place the rest of the rollout afresh
            name = self._unassign(rollout_id)
        while name is None and not (live := [n for n in self.clients if n not in self.down]):
            self.changed.clear()
            await self.changed.wait()
        if name is None:
            name = min(live, key=lambda n: (self.inflight[n], self.rollouts[n]))
            if self.sticky:
                self.assigned[rollout_id] = name
                self.rollouts[name] += 1
        return name

    async def generate(self, rollout_id: str, token_ids: list[int], max_tokens: int, features: dict | None = None,
                       **sampling) -> Completion:
        name = await self.engine_for(rollout_id)
        seed = self._seed(rollout_id, sampling.get("temperature", 1.0))
        key = (name, tuple(token_ids), max_tokens, tuple(sorted((k, _frozen(v)) for k, v in sampling.items())),
               _image_key(features))
        if sampling.get("temperature", 1.0) == 0:  # vLLM takes n=1 only for greedy decoding: never coalesce
            key += (object(),)
        if features:
            self.features[key] = features
        waiters = self.pending.setdefault(key, [])
        waiters.append((seed, asyncio.get_running_loop().create_future()))
        self.inflight[name] += 1  # counted from now, so placement sees requests not yet sent
        if len(waiters) == 1:  # the first asker sends, after the requests already scheduled had a chance to join
            asyncio.get_running_loop().create_task(self._send(key))
        return await waiters[-1][1]

    __call__ = generate  # the Router is itself a Generate, one that can also render

    def _seed(self, rollout_id: str, temperature: float) -> int | None:
        """base(seed, group, turn) + sample index, from the rollout id "group/i"; None when unseeded or greedy."""
        turn = self.turns.get(rollout_id, 0)
        self.turns[rollout_id] = turn + 1
        if self.seed is None or temperature == 0:
            return None
        group, _, index = rollout_id.rpartition("/")
        digest = hashlib.blake2b(f"{self.seed}/{group}/{turn}".encode(), digest_size=6).digest()
        return int.from_bytes(digest, "big") + (int(index) if index.isdigit() else 0)

    async def _send(self, key: tuple) -> None:
        waiters = sorted(self.pending.pop(key), key=lambda w: w[0] or 0)
        name, ids, max_tokens, sampling = key[:4]
        sampling = {k: list(v) if isinstance(v, tuple) else v for k, v in sampling}
        features, epoch = self.features.pop(key, None), self.epoch[name]
        try:
            await asyncio.gather(*(self._send_run(name, epoch, ids, max_tokens, run, features, sampling)
                                   for run in _consecutive(waiters)))
        finally:
            self.inflight[name] -= len(waiters)

    async def _send_run(self, name, epoch, ids, max_tokens, run, features, sampling) -> None:
        """One engine request for waiters whose seeds run seed, seed + 1, ... (or are all None)."""
        try:
            outs = await self.clients[name].generate_n(list(ids), max_tokens, len(run), features=features,
                                                       seed=run[0][0], **sampling)
            for (_, w), out in zip(run, outs):
                if not w.done():  # an asker may have been cancelled meanwhile
                    w.set_result(out)
        except BaseException as e:  # every asker sees the engine's failure (EngineDied included)
            if isinstance(e, EngineDied):  # before the askers hear of it: their next request avoids it
                self.mark_down(name, epoch)
            for _, w in run:
                if not w.done():
                    w.set_exception(e)

    def mark_down(self, name: str, epoch: int) -> None:
        """The incarnation `epoch` of engine `name` failed: report it once (to whoever replaces engines) and send
        no more requests its way until up(name). Without on_down nothing replaces engines: requests keep going."""
        if self.on_down is not None and epoch == self.epoch[name] and name not in self.down:
            self.down.add(name)
            self.on_down(name, epoch)

    async def up(self, name: str) -> None:
        """Engine `name` was replaced (same address, synced weights): route to it again."""
        self.epoch[name] += 1
        self.down.discard(name)
        await self.clients[name].aclose()  # pooled connections belong to the dead server
        self.changed.set()

    def release(self, rollout_id: str) -> None:
        """Forget a finished rollout; its next request (if any) is placed afresh, with its turns counted from 0."""
        self.turns.pop(rollout_id, None)
        self._unassign(rollout_id)

    def _unassign(self, rollout_id: str) -> None:
        name = self.assigned.pop(rollout_id, None)
        if name is not None:
            self.rollouts[name] -= 1

    def load(self) -> dict[str, int]:
        return dict(self.inflight)


def _consecutive(waiters: list) -> list[list]:
    """Waiters sorted by seed, cut into runs of consecutive seeds (one run when unseeded)."""
    runs = [[waiters[0]]]
    for w in waiters[1:]:
        prev = runs[-1][-1][0]
        if w[0] is None or (prev is not None and w[0] == prev + 1):
            runs[-1].append(w)
        else:
            runs.append([w])
    return runs


def _image_key(features: dict | None) -> tuple:
    """Requests with the same ids coalesce only when their images are the same (by the engine's hashes)."""
    return () if not features else tuple(features["mm_hashes"].get("image", []))


def _frozen(v):
    return tuple(v) if isinstance(v, list) else v
