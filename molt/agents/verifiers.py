"""verifiers environments as the agent (`agent=verifiers`): each rollout is one verifiers episode, trained token-exact.

    molt agent=verifiers agent.verifiers.env.taskset.id=molt_count      # conf/agent/verifiers.yaml; experiment=verifiers

verifiers (prime-rl's environment library: the Environments Hub, and through its tasksets Harbor, NeMo-Gym, OpenEnv,
TextArena) pins mcp and openai<3, so it runs in its own venv, harnesses/verifiers/.venv (`make setup`), as one
long-lived bridge process per rollout worker (harnesses/verifiers/bridge.py: JSON lines on its stdin and stdout). The
bridge runs each episode with verifiers' eval client pointed at one stable route of the worker's loopback chat server
(a Relay: verifiers keeps one HTTP client per base URL until it stops, so a URL per rollout would leak one per
rollout). verifiers relays its harnesses' requests nearly unchanged and names each agent run in X-Session-ID (its
trace id), which the bridge announces, with the seat's standing, before the run's first request. Every agent run gets
its own chat session, so the tokens are recorded as in ChatAgent mode: the engine's ids, never re-tokenized.

- Seats: a trainable run's segments join the rollout (best-of-n: one or more per attempt, sharing the reward, as with
  compaction); an untrainable one (user-sim's user, a judge) is served by the engine and never trained
  (info["vf_untrained_turns"]). The reward is the mean reward of the trainable runs (verifiers' `trace.reward`, the
  weighted sum of the task's rewards); the runs' metrics and reward terms come as info["vf/<name>"].
- Rows: a dataset row's `vf_task` is the task's data (as `bridge.py export` writes it); a row without one is read as
  the task's data with `messages` as its prompt.
- Failures are the rollout's: an episode that ends in error (a harness error, a verifiers exception) fails with its
  last error; after the server refused a request for a budget it is truncated instead (reward 0.0). A bridge that
  dies fails its episodes in flight; each starts once more on a new bridge, then fails.
- Lifetime: the bridge is started with the worker's first rollout and exits when its stdin closes (the worker is
  gone); whatever its harnesses left running is killed by their mark (harness.py), as for the agent CLIs.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf

from molt.agents.chat_server import Relay, Session, close_session, open_session, shared_server
from molt.agents.harness import MARK, PASSED, kill_strays
from molt.config import REPO, AgentConfig
from molt.types import Generate, Rollout, RolloutFailed

log = logging.getLogger(__name__)
VF = REPO / "harnesses" / "verifiers"  # `make setup`: .venv (requirements.lock), uv-cache and home (the chat program)
PYTHON, BRIDGE, LOCK = VF / ".venv" / "bin" / "python", VF / "bridge.py", VF / "chat-program.lock"
KEY_VAR = "MOLT_VF_API_KEY"  # verifiers keeps variables whose name holds API_KEY out of its harnesses' environment
START_S = 300.0  # the bridge's start (importing verifiers, loading the taskset) on busy cores


class BridgeDied(Exception):
    """The bridge process exited (or never started): its episodes are lost."""


@dataclass
class Bridge:
    proc: asyncio.subprocess.Process
    relay: Relay
    scratch: Path
    log: Path
    ready: asyncio.Future
    waiting: dict[str, asyncio.Future] = field(default_factory=dict)  # rollout id -> the episode's outcome
    announced: dict[str, Callable[[str, bool], None]] = field(default_factory=dict)  # rollout id -> on an agent run
    died: str = ""

    async def episode(self, rollout_id: str, row: dict, on_run: Callable[[str, bool], None]) -> dict:
        """The episode's outcome: {"reward", "metrics", "truncated", "error"}. Raises BridgeDied."""
        done = self.waiting[rollout_id] = asyncio.get_running_loop().create_future()
        self.announced[rollout_id] = on_run
        try:
            self._send({"id": rollout_id, "row": row})
            return await done
        except asyncio.CancelledError:
            with contextlib.suppress(OSError, RuntimeError):
                self._send({"cancel": rollout_id})  # past agent.timeout_s: its harness processes go too
            raise
        finally:
            self.waiting.pop(rollout_id, None)
            self.announced.pop(rollout_id, None)

    def _send(self, msg: dict) -> None:
        if self.died:
            raise BridgeDied(self.died)
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())


async def _read(b: Bridge) -> None:
    """Dispatch the bridge's lines; once it exits, fail what waits on it and kill what it left running."""
    while line := await b.proc.stdout.readline():
        msg = json.loads(line)
        if "ready" in msg:
            b.ready.set_result(True)
        elif "trace" in msg and msg["id"] in b.announced:
            b.announced[msg["id"]](msg["trace"], msg["trainable"])
        elif msg.get("id") in b.waiting:
            b.waiting[msg["id"]].set_result(msg)
    code = await b.proc.wait()
    b.died = f"the verifiers bridge exited with {code}: {_last_line(b.log)}"
    for f in [b.ready, *b.waiting.values()]:
        if not f.done():
            f.set_exception(BridgeDied(b.died))
    b.ready.exception()  # retrieved: a bridge that never started is reported by its starter
    srv = await shared_server()
    srv.relays.pop(b.relay.sid, None)
    await asyncio.to_thread(kill_strays, [], str(b.scratch))
    shutil.rmtree(b.scratch, ignore_errors=True)


def _last_line(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [x for x in path.read_bytes()[-8192:].decode(errors="replace").splitlines() if x.strip()]
        return lines[-1][:300] if lines else "(no output)"
    return "(no output)"


def bridge_config(cfg: AgentConfig, base_url: str = "") -> dict:
    """What bridge.py reads: the [env] block, the local taskset directories, Molt's route and the chat program's lock."""
    vf = OmegaConf.to_container(cfg.verifiers) if OmegaConf.is_config(cfg.verifiers) else dict(cfg.verifiers)
    return {"env": vf.get("env", {}), "path": [str(REPO / p) for p in vf.get("path", [])], "base_url": base_url,
            "key_var": KEY_VAR, "model": "policy", "lock": str(LOCK)}


def bridge_env(scratch: Path, key: str = "") -> dict[str, str]:
    """The bridge's environment: the worker's harmless variables, the verifiers venv first on PATH, the chat program's
    uv environment built at `make setup` (UV_FROZEN: nothing resolved or downloaded), the repo for local tasksets."""
    env = {k: os.environ[k] for k in PASSED if k in os.environ}
    return env | {"PATH": f"{PYTHON.parent}:{env.get('PATH', '/usr/bin:/bin')}", "HOME": str(VF / "home"),
                  "TMPDIR": str(scratch), "UV_CACHE_DIR": str(VF / "uv-cache"), "UV_FROZEN": "1",
                  "UV_PYTHON_DOWNLOADS": "never", "PYTHONPATH": str(REPO), KEY_VAR: key, MARK: str(scratch)}


async def start_bridge(cfg: AgentConfig) -> Bridge:
    srv = await shared_server()
    relay, scratch = Relay(), Path(tempfile.mkdtemp(prefix="molt-vf-"))
    srv.relays[relay.sid] = relay
    logfile = Path(cfg.log_dir or scratch) / "verifiers-bridge.log"
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "ab") as out:
        proc = await asyncio.create_subprocess_exec(
            str(PYTHON), str(BRIDGE), "serve", json.dumps(bridge_config(cfg, f"{srv.url}/s/{relay.sid}/v1")),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out, env=bridge_env(scratch, relay.key),
            cwd=scratch, start_new_session=True, limit=1 << 24)
    b = Bridge(proc, relay, scratch, logfile, asyncio.get_running_loop().create_future())
    reader = asyncio.create_task(_read(b))
    _READERS.add(reader)  # the event loop keeps only a weak reference to a task
    reader.add_done_callback(_READERS.discard)
    try:
        await asyncio.wait_for(asyncio.shield(b.ready), START_S)
    except asyncio.TimeoutError:
        proc.kill()
        raise BridgeDied(f"the verifiers bridge did not start within {START_S:.0f} s (its log: {logfile})") from None
    return b


_BRIDGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> {config: Future[Bridge]}
_READERS: set[asyncio.Task] = set()


async def shared_bridge(cfg: AgentConfig) -> Bridge:
    """The worker's bridge for this environment (a run has one), started on first use and again after it died."""
    bridges = _BRIDGES.setdefault(asyncio.get_running_loop(), {})
    key = json.dumps(bridge_config(cfg), sort_keys=True)
    f = bridges.get(key)
    if f is None or f.done() and (f.exception() is not None or f.result().died):
        f = bridges[key] = asyncio.ensure_future(start_bridge(cfg))
    return await asyncio.shield(f)


async def _episode(cfg: AgentConfig, sample: dict, rollout_id: str, runs: list, open_run: Callable) -> dict:
    """The episode's outcome, started once more on a new bridge if its bridge died."""
    for attempt in (0, 1):
        try:
            b = await shared_bridge(cfg)
            return await b.episode(rollout_id, sample, lambda name, trainable: runs.append(
                (b.relay, name, open_run(b.relay, name), trainable)))
        except BridgeDied as e:
            if attempt:
                raise
            log.info("rollout %s: %s; starting it again on a new bridge", rollout_id, e)
            _close(await shared_server(), runs)
            runs.clear()


def _close(srv, runs: list) -> None:
    for relay, name, s, _ in runs:
        relay.sessions.pop(name, None)
        close_session(srv, s)


async def run_verifiers_rollout(generate: Generate, tokenizer, agent, sample: dict, rollout_id: str, group_id: str,
                                agent_cfg: AgentConfig, sampling: dict,
                                release: Callable[[str], None] | None = None) -> Rollout:
    """One verifiers episode of `sample` (molt/agents/__init__.py MODES). Raises RolloutFailed when it failed."""
    srv = await shared_server()
    runs: list[tuple[Relay, str, Session, bool]] = []  # (relay, X-Session-ID, session, trainable), one per agent run

    def open_run(relay: Relay, name: str) -> Session:
        relay.sessions[name] = s = open_session(srv, rollout_id, generate, tokenizer, agent_cfg, sampling)
        return s

    ro, timeout = Rollout(rollout_id=rollout_id, group_id=group_id), agent_cfg.timeout_s or None
    try:
        out = await asyncio.wait_for(_episode(agent_cfg, sample, rollout_id, runs, open_run), timeout)
    except asyncio.TimeoutError:
        out = {"error": f"the episode ran past agent.timeout_s={timeout}"}
    except BridgeDied as e:
        out = {"error": f"{e} (twice)"}
    finally:
        _close(srv, runs)
        if release is not None:
            release(rollout_id)
    return _result(ro, out, runs)


def _result(ro: Rollout, out: dict, runs: list) -> Rollout:
    sessions = [s for _, _, s, _ in runs]
    if err := next((s.error for s in sessions if s.error is not None), None):
        raise err  # the server's or the engine's failure, not the episode's
    ro.segments = [seg for _, _, s, trainable in runs if trainable for seg in s.segments]
    refused, rejected = sum(s.refused for s in sessions), [s.rejection for s in sessions if s.rejected]
    ro.info = {f"vf/{k}": float(v) for k, v in out.get("metrics", {}).items()} | {
        "turns": float(sum(s.turns for s in sessions)), "segments": float(len(ro.segments)), "refused": float(refused),
        "vf_runs": float(len(runs)), "vf_untrained_turns": float(sum(s.turns for _, _, s, t in runs if not t))}
    ro.status = "truncated" if refused or out.get("truncated") else "ok"
    ro.reward = 0.0 if out.get("error") else float(out["reward"])
    why = "" if refused else out.get("error") or ""
    if not why and rejected:
        why = f"the server refused a malformed request of the environment: {rejected[-1]}"
    elif not why and not ro.segments:
        why = "the environment never called the model (no trainable agent run)" if not refused else (
            f"the server refused all {refused} requests of the environment for a budget (agent.max_total_tokens, "
            "agent.max_turns)")
    if why:
        raise RolloutFailed(ro, why)
    return ro
