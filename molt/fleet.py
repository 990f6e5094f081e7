"""The run's engines as the loop drives them: verified weight sync, and replacement of engines that die.

    with Fleet(servers, cfg, actor) as fleet:   # servers: from launch_engines; its requests run on its own thread
        probe = fleet.sync(version, probe_segment)  # the actor's weights into every engine, checked on one
        last = fleet.sync(version, probe_segment, then=grant, wait=False)  # overlapped: taken now, delivered then
        fleet.check()                               # restart engines that died (polled while the loop waits)

An overlapped sync (rollout.max_lag >= 1, engine.sync reload or adapter) takes the weights and the probe's expected
log-probs in the caller's thread, then pauses, updates, verifies and resumes the engines on the fleet's thread while
the caller goes on training; `then` runs once every engine serves the version, and the next sync (or settle())
waits for it and returns its probe. It keeps the last weights it sent (a restarted engine gets them) until the next.

An engine dies when its process exits or the rollout worker sees it fail (a refused or reset connection, a 5xx,
a timeout: EngineDied; the loop hands the worker's reports to `fleet.reported`). It is restarted from config on its
own socket or port, given the current weights and version, verified with the log-prob probe and handed back to the
worker (`engine_up`), which starts the rollouts that were on it again (molt/agents/pool.py). More than
engine.max_restarts restarts within engine.restart_window_s stop the run with EngineDied.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque

import ray

from molt.net import free_port, node_address
from molt.rollout.features import engine_features
from molt.sync.reload import drop_adapters, sync_adapter, sync_weights, verify_sync
from molt.types import EngineDied, Segment

log = logging.getLogger(__name__)


class Fleet:
    def __init__(self, servers, cfg, actor):
        self.servers = {s.name: s for s in servers}
        self.cfg, self.actor = cfg, actor
        self.aio = asyncio.new_event_loop()  # the engines' requests: on this thread, so a sync can overlap training
        threading.Thread(target=self.aio.run_forever, name="molt-fleet", daemon=True).start()
        self.clients = {s.name: s.client() for s in servers}
        self.version, self.probe = 0, Segment()
        self.probe.append(list(range(1, 17)))  # until a step gives a real one: any ids score the weights
        self.epoch = dict.fromkeys(self.servers, 0)  # incarnation of each engine
        self.restarts: deque[float] = deque()  # when, within the window
        self.total = 0
        self.cache: dict[str, tuple[float, float]] = {}  # prefix-cache (hits, lookups) counters at the last step
        self.reported: deque[tuple[str, int]] = deque()  # (name, incarnation) of an engine the worker saw fail
        self.worker = None  # the rollout worker, told when an engine is back
        self.joined = False  # engine.sync=nccl: the actor and the engines form the weight-transfer group
        self.sent = None  # self.version's weights and expected probe log-probs while the actor may have moved on
        self.pending = None  # (future, then) of the sync in flight
        self.probed = None  # the probe of the last sync settled, until sync() hands it out

    def call(self, coro):
        """Run a coroutine on the fleet's thread and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.aio).result()

    def sync(self, version: int, probe: Segment | None = None, then=None, wait: bool = True) -> float | None:
        """Weights `version` into every engine, then the max |engine - actor| log-prob on `probe` (a segment,
        images included) on one of them; `then()` once they serve it, or with engine.sync=reload once every engine is
        paused for it (what it starts waits for the new weights). Not so for adapters: an engine fresh from a start or a
        restart serves no policy until its first adapter is loaded, and a request naming it meanwhile is refused;
        nor for NCCL, not verified here. An engine that dies meanwhile is replaced, and synced, instead. wait=False
        overlaps the engines' part with what the caller does next (NCCL syncs are collectives on the actor: they
        always wait) and returns the previous sync's probe (None if none is left)."""
        self.settle()
        last, self.probed = self.probed, None
        self.version, self.probe = version, probe.head(self.cfg.engine.probe_tokens) if probe else self.probe
        self.sent = self.take()
        then = then and functools.cache(then)  # once, also when an engine died and the sync is delivered again
        self.pending = asyncio.run_coroutine_threadsafe(
            self._push(list(self.clients.values()), self.sent, then), self.aio), then
        if not wait and self.cfg.engine.sync != "nccl":
            return last
        self.settle()
        probed, self.probed, self.sent = self.probed, None, None  # the actor holds these weights until it trains
        return probed

    def settle(self) -> float | None:
        """Wait for the sync in flight, if any (its probe: self.probed); an engine that died meanwhile is replaced
        and the sync delivered again."""
        if self.pending is not None:
            (done, then), self.pending = self.pending, None
            while True:
                try:
                    self.probed = done.result()
                    break
                except EngineDied as e:
                    self.restart(e.name, e.detail)
                    done = asyncio.run_coroutine_threadsafe(
                        self._push(list(self.clients.values()), self.sent, then), self.aio)
        return self.probed

    def take(self) -> tuple:
        """The actor's weights for self.version as the sync path sends them, and the probe's expected log-probs
        (in the caller's thread: with actor ranks these are collectives)."""
        e, weights = self.cfg.engine, None
        if e.sync == "adapter":  # at version 0 too: the engine serves the policy once its adapter is loaded
            weights = self.actor.export_adapters()
        elif self.version and e.sync != "nccl":  # a fresh engine serves version 0, the model directory's weights
            weights = self.actor.export_weights()
        return weights, self.actor.logprobs([self.probe], self.cfg.rollout.temperature)[0][1:]

    async def _push(self, clients, sent: tuple, then=None) -> float:
        e, (weights, expected) = self.cfg.engine, sent
        if self.version and e.sync == "nccl":  # every engine at once, over the group (formed again after a restart)
            from molt.sync import nccl  # imports vLLM (seconds): only on this path
            if not self.joined:
                address = node_address()
                await asyncio.to_thread(self.actor.apply, nccl.connect, list(self.clients.values()),
                                        e.sync_bucket_mb << 20, address, free_port(address), e.dtype)
                self.joined = True
            send = functools.partial(self.actor.apply, nccl.send)  # on every actor rank
            await nccl.sync_nccl(list(self.clients.values()), send, self.version, e.pause_mode)
        elif e.sync == "adapter":
            await sync_adapter(clients, weights, self.cfg.lora, self.cfg.model.path, self.version, e.sync_dir,
                               e.pause_mode)
        elif weights is not None:  # then() once paused: what it starts waits in the engines for the new weights
            await sync_weights(clients, weights, self.version, e.sync_dir, e.pause_mode, on_paused=then)
        if then is not None:  # (once) the engines serve the version at the latest: the next rollouts start while the
            then()  # probe scores it (a probe that fails stops the run all the same)
        features = await engine_features(clients[0], self.probe.images)  # an image prompt probes the vision tower
        return await verify_sync(clients[0], self.probe.token_ids, expected, tol=self.cfg.engine.probe_tol, **features)

    def check(self) -> None:
        """Restart every engine whose process exited, and every engine the worker reported, unless that incarnation
        was replaced already (a sync in flight settles first: it may be the one that replaces it)."""
        dead = {name: (self.epoch[name], f"the engine process exited (code {server.exit_code()})")
                for name, server in self.servers.items() if not server.alive()}
        while self.reported:
            name, epoch = self.reported.popleft()
            if epoch == self.epoch[name]:
                dead.setdefault(name, (epoch, "a request to it failed (see the engine log)"))
        if dead:
            self.settle()
        for name, (epoch, why) in dead.items():
            if epoch == self.epoch[name]:
                self.restart(name, why)

    def restart(self, name: str, why: str) -> None:
        e = self.cfg.engine
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > e.restart_window_s:
            self.restarts.popleft()
        if len(self.restarts) >= e.max_restarts:
            raise EngineDied(name, f"{why}; {len(self.restarts)} restart(s) within engine.restart_window_s="
                                   f"{e.restart_window_s:g} already (engine.max_restarts={e.max_restarts}); "
                                   f"see its log under engines/")
        self.restarts.append(now)
        self.total += 1
        log.warning("engine %s died (%s): restarting it (%d of engine.max_restarts=%d within %g s)", name, why,
                    len(self.restarts), e.max_restarts, e.restart_window_s)
        if self.joined:  # engine.sync=nccl: the group lost a member; the next push forms it again
            from molt.sync import nccl

            self.actor.apply(nccl.disconnect)
            self.joined = False
        self.servers[name].restart()
        self.epoch[name] += 1
        client = self.clients[name]
        self.call(client.aclose())  # pooled connections belong to the dead server
        try:
            self.call(self._push([client], self.sent or self.take()))
        except EngineDied as again:
            return self.restart(name, again.detail)
        if self.worker is not None:
            ray.get(self.worker.engine_up.remote(name))
        log.warning("engine %s is back, at version %d", name, self.version)

    def cache_metrics(self) -> dict[str, float]:
        """engine/prefix_cache_hit_rate: prefix-cache hits / lookups (tokens) of all engines since the last call, from
        their Prometheus counters ({} when nothing was looked up)."""
        hits = queries = 0.0
        for name, client in self.clients.items():
            h, q = self.call(_cache_counters(client))
            h0, q0 = self.cache.get(name, (0.0, 0.0))
            if h < h0 or q < q0:  # a restarted engine counts from 0 again
                h0 = q0 = 0.0
            hits, queries, self.cache[name] = hits + h - h0, queries + q - q0, (h, q)
        return {"engine/prefix_cache_hit_rate": hits / queries} if queries else {}

    def wait(self, ref):
        """ray.get(ref), restarting engines that die meanwhile (the worker's rollouts wait for them)."""
        while not ray.wait([ref], timeout=2.0)[0]:
            if self.worker is not None:
                self.reported.extend(ray.get(self.worker.downs.remote()))
            self.check()
        return ray.get(ref)

    def __enter__(self):
        return self

    def __exit__(self, kind, *_) -> None:
        self.close(settle=kind is None)  # a failed run does not wait for (nor replace engines of) a sync in flight

    def close(self, settle: bool = True) -> None:
        """Its HTTP sessions closed (aiohttp reports unclosed ones on stderr at exit), its thread stopped."""
        if settle:
            self.settle()
        for c in self.clients.values():
            self.call(c.aclose())
        self.aio.call_soon_threadsafe(self.aio.stop)
        drop_adapters(self.cfg.engine.sync_dir)  # engine.sync=adapter keeps the served version's folder until now


async def _cache_counters(client) -> tuple[float, float]:
    status, text = await client.send("GET", "/metrics")
    if status != 200:  # an engine that died meanwhile: check() replaces it
        return 0.0, 0.0
    totals = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in totals:
            totals[name] += float(line.split()[-1])
    return tuple(totals.values())
