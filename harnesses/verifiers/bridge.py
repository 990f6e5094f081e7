"""Molt's bridge to verifiers: runs in verifiers' own venv (harnesses/verifiers/.venv), never imports molt.

    bridge.py serve CONFIG      one process per rollout worker (molt/agents/verifiers.py starts it); JSON lines:
                                stdin  {"id": rollout id, "row": dataset row} | {"cancel": rollout id}
                                stdout {"ready": true}, once serving
                                       {"id", "trace", "seat", "trainable"} when an agent run starts (before any request)
                                       {"id", "reward", "metrics", "truncated", "error"} when the episode ends
                                EOF on stdin (the worker is gone): every episode is cancelled, then it exits
    bridge.py check CONFIG      load the environment, print its seats (Molt's guard rail)
    bridge.py export CONFIG OUT the taskset as Molt's JSONL: {"messages", "vf_task"} per task
    bridge.py prepare LOCK      build the null/bash harnesses' chat-program environment into the uv cache (make setup)

CONFIG (JSON): {"env": verifiers' [env] block (EnvConfig), "path": [directories put on sys.path (local tasksets)],
"base_url": Molt's stable route (".../v1"), "key_var": the variable holding its key, "model": the policy's name}.

Each episode's agents reach Molt through verifiers' eval client: one client config for the whole process (one route,
one key), so verifiers keeps one HTTP client, and Molt tells the episodes apart by X-Session-ID, the trace id, which
this bridge announces before the agent's first request. The episode's reward is the mean reward of its trainable
traces (one for a plain taskset; best-of-n: one per attempt). Seats that name no runtime run as local subprocesses.
"""
import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

EXCLUDE_NEWER = "2026-12-05T00:00:00Z"  # the chat program's dependencies: the versions published before this
LIMITS = ("max_turns", "max_input_tokens", "max_output_tokens", "max_total_tokens", "compaction_failed")  # truncated
OUT = sys.stdout  # the protocol channel; anything else printing to stdout goes to stderr


def emit(msg: dict) -> None:
    OUT.write(json.dumps(msg) + "\n")
    OUT.flush()


def load_env(cfg: dict):
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields

    sys.path[:0] = [str(p) for p in cfg.get("path", [])]
    raw = json.loads(json.dumps(cfg["env"]))
    for seat in agent_config_fields(vf.resolve_env_config(raw)):  # no container runtime here: local processes
        raw.setdefault(seat, {}).setdefault("runtime", {"type": "subprocess"})
    return vf.load_environment(vf.resolve_env_config(raw))


def task_of(env, row: dict):
    """A dataset row as the taskset's task: its exported `vf_task`, else the row itself (`messages` as the prompt)."""
    task_cls = type(env.taskset).task_type()
    data = row.get("vf_task") or {"prompt": row["messages"], **{k: v for k, v in row.items() if k != "messages"}}
    return task_cls(task_cls.data_type().model_validate(data), env.taskset.config.task)


def outcome(episode) -> dict:
    trained = [t for t in episode.traces if t.agent is None or t.agent.trainable]
    errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
    error = None if episode.ok else (f"{errors[-1].type}: {errors[-1].message}" if errors else "the episode failed")
    metrics: dict[str, float] = {}
    for t in trained:
        for k, v in [*t.metrics.items(), *((k, r.score if r else None) for k, r in t.rewards.items())]:
            if isinstance(v, (int, float)):
                metrics[k] = metrics.get(k, 0.0) + v / len(trained)
    reward = sum(t.reward for t in trained) / len(trained) if trained else 0.0
    return {"reward": reward, "metrics": metrics, "truncated": any(t.stop_condition in LIMITS for t in trained),
            "error": error and " ".join(error.split())[:500]}


async def episode(env, ctx, rid: str, row: dict) -> None:
    def started(trace):
        agent = trace.agent
        emit({"id": rid, "trace": trace.id, "seat": agent.name if agent else "", "trainable": agent.trainable
              if agent else True})

    try:
        out = outcome(await env.run_episode(task_of(env, row), ctx, on_trace=started))
    except Exception as e:  # the environment's own failure is this rollout's, never the bridge's
        out = {"error": " ".join(f"verifiers raised {type(e).__name__}: {e}".split())[:500]}
    emit({"id": rid, **out})


async def serve(cfg: dict) -> None:
    import verifiers.v1 as vf

    env = load_env(cfg)
    ctx = vf.ModelContext(model=cfg["model"], client=vf.EvalClientConfig(base_url=cfg["base_url"],
                                                                          api_key_var=cfg["key_var"]))
    loop, runs = asyncio.get_running_loop(), {}
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with env.serving():
        emit({"ready": True})
        while line := await reader.readline():
            msg = json.loads(line)
            if "cancel" in msg:
                if (run := runs.pop(msg["cancel"], None)) is not None:
                    run.cancel()
                continue
            runs[msg["id"]] = run = asyncio.create_task(episode(env, ctx, msg["id"], msg["row"]))
            run.add_done_callback(lambda t, rid=msg["id"]: runs.pop(rid, None) if runs.get(rid) is t else None)
        for run in runs.values():  # the worker is gone: its harness processes go with the episodes
            run.cancel()
        await asyncio.gather(*runs.values(), return_exceptions=True)


def export(cfg: dict, out: str) -> None:
    env = load_env(cfg)
    with open(out, "w") as f:
        for task in env.taskset:
            data = task.data.model_dump(mode="json", exclude_none=True)
            prompt = task.data.prompt
            msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
                [m.model_dump(mode="json", exclude_none=True) for m in prompt or []]
            if task.data.system_prompt:
                msgs.insert(0, {"role": "system", "content": task.data.system_prompt})
            if not msgs:
                raise SystemExit(f"task {task.data.idx} has no prompt: Molt's rows need `messages`")
            f.write(json.dumps({"messages": msgs, "vf_task": data}) + "\n")


async def prepare(lock: str) -> None:
    """The chat program of the null and bash harnesses gets its own uv environment, resolved from LOCK (a uv script
    lock), in the uv cache: at run time UV_FROZEN=1 and the lock beside the script make uv install it from there."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes import SubprocessConfig
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    script = script_path()
    if not Path(lock).exists():  # resolved once, as of EXCLUDE_NEWER: the same versions on every machine
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(CHAT_PROGRAM_SOURCE)
        subprocess.run(["uv", "lock", "--script", str(script), "-q", "--no-config", "--exclude-newer", EXCLUDE_NEWER],
                       check=True)
        shutil.copy(f"{script}.lock", lock)
    place_lock(lock)
    os.environ["UV_FROZEN"] = "1"  # as at run time: the environment is built from the lock alone
    runtime = SubprocessRuntime(SubprocessConfig(), name=f"prepare-{os.getpid()}")
    await runtime.start()
    try:
        print(" ".join(await runtime.prepare_uv_script(CHAT_PROGRAM_SOURCE)), file=sys.stderr)
    finally:
        shutil.rmtree(runtime.workdir, ignore_errors=True)


def script_path() -> Path:
    """Where verifiers writes the chat program (content-addressed under its scripts directory, in HOME)."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    return Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(CHAT_PROGRAM_SOURCE.encode()).hexdigest()}.py"


def place_lock(lock: str) -> None:
    """The lock beside the script: with UV_FROZEN=1 uv installs it from the cache, asking no index."""
    script = script_path()
    script.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(lock, f"{script}.lock")


def main() -> None:
    global OUT
    OUT = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints (libraries, hooks) must not corrupt the protocol
    cmd, *args = sys.argv[1:]
    if cmd == "prepare":
        asyncio.run(prepare(args[0]))
        return
    cfg = json.loads(args[0])
    if cmd == "serve":
        place_lock(cfg["lock"])
        asyncio.run(serve(cfg))
    elif cmd == "check":
        from verifiers.v1.configs.agent import agent_config_fields

        emit({"seats": list(agent_config_fields(load_env(cfg).config))})
    elif cmd == "export":
        export(cfg, args[1])


if __name__ == "__main__":
    main()
