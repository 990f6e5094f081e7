"""Agent CLIs (Claude Code, Codex CLI) as the agent of a ChatAgent rollout: one process tree per rollout.

An agent module (agent=chat) hands the rollout to a CLI and scores the directory it leaves:

    async def run_agent(ctx):                      # experiments/claude_code/agent.py
        return await run_cli(ctx, "Create hello.txt containing the word molt.", check=hello_check,
                             files={"notes.md": "..."})        # -> (reward, info)

with `agent.harness=claude` (or `codex`) naming the CLI in HARNESSES. Per rollout, run_cli:
- makes a scratch directory (0700): `work/` (the task's files, the CLI's working directory), `home/` (its HOME
  and config: Claude Code's ~/.claude, Codex's CODEX_HOME with a config.toml) and `tmp/` (its TMPDIR);
- starts the CLI in its own session and process group, stdin closed, with only the rollout's URL and key and a
  few harmless variables of the worker (PATH, LANG, ...) in its environment: no Ray token, no provider keys;
- appends its stdout and stderr to `agent.log_dir/<rollout id>.log` (conf/agent/chat.yaml: the run's
  `<output_dir>/agents/`; "" = not kept);
- when it exits, runs out of time or is cancelled (agent.timeout_s: run_chat_rollout cancels the agent), SIGKILLs
  its process group and every process that left the group (setsid: a PTY, a daemon) but carries the rollout's
  MARK in its environment; nothing it started outlives the rollout;
- scores the working directory with the task's `check(work) -> reward | (reward, info)` and removes the scratch.

Failures are the rollout's: a CLI that exits non-zero or runs out of time raises HarnessFailed, with the last line
of its output, and run_chat_rollout marks the rollout failed with that reason (truncated when the server had
refused a request for a budget); one that never called the model fails there too. A missing CLI is a guard rail
at startup (molt/guards.py agent_harness). The CLIs come pinned from npm (harnesses/package.json, package-lock.json),
installed by `make setup` into harnesses/node_modules; nothing is installed or downloaded at run time.

Isolation is by configuration, not a sandbox: the CLIs (and the shell commands the model makes them run) are
processes of the worker's user, which can see each other's scratch directories and environments.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import psutil

from molt.agents.chat_agent import ChatContext
from molt.config import REPO

BIN = REPO / "harnesses" / "node_modules" / ".bin"  # `make setup`: npm ci in harnesses/
MARK = "MOLT_SCRATCH"  # in every CLI's environment: its scratch directory, so strays can be found (no KEY/TOKEN in
# the name: Codex drops such variables from the environment of the commands it runs)
PASSED = ("PATH", "LANG", "LC_ALL", "TZ", "USER", "LOGNAME", "SHELL")  # the worker's variables a CLI sees

# Both CLIs are run with their shell tool only and a one-line system prompt: their defaults (12 tools and ~7k characters
# of instructions; Codex's skills, apps and collaboration sections, web search, agents and goals) make a first prompt
# of 12.7k (Claude Code) and 6.7k (Codex) tokens with SmolLM2's tokenizer, these 1.6k and 1.3k: a small policy's
# context holds them, and every turn (which re-sends the whole history) costs an eighth to a fifth as much. Codex's
# 1.3k: its exec_command and write_stdin tools, its sandbox's permissions and the environment (cwd, date); without
# its bundled skills' list (imagegen, openai-docs, ...: 0.6k), request_user_input (0.35k: `codex exec` has no user
# to ask) and view_image (0.1k), which made it 2.35k.
SYSTEM_PROMPT = "You are a coding agent. Run shell commands with {tool}."
CODEX_SHRUNK = ('include_apps_instructions = false\ninclude_collaboration_mode_instructions = false\n'
                'web_search = "disabled"')

Harness = Callable[[ChatContext, str, Path], tuple[list[str], dict[str, str]]]
# (ctx, task, home) -> (argv, environment); it may write its config files under `home`


class HarnessFailed(Exception):
    """The CLI failed its rollout: a non-zero exit or past its time limit."""


def claude(ctx: ChatContext, task: str, home: Path) -> tuple[list[str], dict[str, str]]:
    """Claude Code, Anthropic Messages: POST <anthropic_base_url>/v1/messages?beta=true. --max-turns is one more
    than the server allows, so that a long rollout ends on the server's refusal (truncated), not on Claude's own
    limit (an error exit: failed)."""
    argv = [str(BIN / "claude"), "-p", task, "--output-format", "json", "--max-turns", str(ctx.max_turns + 1),
            "--tools", "Bash", "--allowedTools", "Bash", "--system-prompt", SYSTEM_PROMPT.format(tool="the Bash tool")]
    return argv, {"ANTHROPIC_BASE_URL": ctx.anthropic_base_url, "ANTHROPIC_API_KEY": ctx.api_key,
                  "ANTHROPIC_MODEL": ctx.model, "ANTHROPIC_SMALL_FAST_MODEL": ctx.model,
                  "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(ctx.max_tokens),
                  "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}


def codex(ctx: ChatContext, task: str, home: Path) -> tuple[list[str], dict[str, str]]:
    """Codex CLI, OpenAI Responses (its only protocol): POST <base_url>/responses, configured in CODEX_HOME."""
    (home / "codex").mkdir()
    (home / "codex" / "instructions.md").write_text(SYSTEM_PROMPT.format(tool="exec_command"))
    (home / "codex" / "config.toml").write_text(
        f'model = {json.dumps(ctx.model)}\nmodel_provider = "molt"\n{CODEX_SHRUNK}\n'
        f'model_instructions_file = {json.dumps(str(home / "codex" / "instructions.md"))}\n\n[model_providers.molt]\n'
        f'name = "molt"\nbase_url = {json.dumps(ctx.base_url)}\nenv_key = "MOLT_API_KEY"\nwire_api = "responses"\n'
        '\n[features]\nmulti_agent = false\ngoals = false\nview_image = false\n'
        '\n[skills]\ninclude_instructions = false\n\n[tools.experimental_request_user_input]\nenabled = false\n'
        '\n[sandbox_workspace_write]\nexclude_slash_tmp = true\n')  # its own TMPDIR only: the sandboxes of rollouts
    # that share /tmp race on the mount points they make there ("bwrap: Can't mount tmpfs on /newroot/tmp/.git")
    argv = [str(BIN / "codex"), "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", task]
    return argv, {"CODEX_HOME": str(home / "codex"), "MOLT_API_KEY": ctx.api_key}


HARNESSES: dict[str, Harness] = {"claude": claude, "codex": codex}  # agent.harness; the binary is BIN / name


async def run_cli(ctx: ChatContext, task: str, check: Callable, files: dict[str, str | bytes] | None = None,
                  harness: str | Harness | None = None, timeout_s: float | None = None) -> tuple[float, dict]:
    """Run the CLI on `task` in a fresh directory holding `files` (relative path -> content); return check(work)
    as (reward, info). `harness`: a HARNESSES name or function (default agent.harness); `timeout_s`: a limit of its
    own (default none: agent.timeout_s bounds the rollout, which cancels this). Raises HarnessFailed."""
    make = harness if callable(harness) else HARNESSES.get(harness or ctx.harness)
    if make is None:
        raise ValueError(f"run_cli: no agent CLI {harness or ctx.harness!r}: set agent.harness to one of "
                         f"{sorted(HARNESSES)} or pass harness=")
    scratch = Path(tempfile.mkdtemp(prefix="molt-cli-"))
    try:
        work, home = _prepare(scratch, files or {})
        argv, env = make(ctx, task, home)
        env = {k: os.environ[k] for k in PASSED if k in os.environ} | env | {
            "HOME": str(home), "TMPDIR": str(scratch / "tmp"), MARK: str(scratch)}
        log = (Path(ctx.log_dir) / f"{ctx.rollout_id.replace('/', '_')}.log") if ctx.log_dir else scratch / "log"
        kept = f" (output: {log})" if ctx.log_dir else ""
        t0 = time.monotonic()
        code = await _run(argv, env, work, log, timeout_s)
        name = Path(argv[0]).name
        if code is None:
            raise HarnessFailed(f"{name} ran past timeout_s={timeout_s} and was killed{kept}")
        if code != 0:
            raise HarnessFailed(f"{name} exited with {code}: {_last_line(log)}{kept}")
        out = await asyncio.to_thread(check, work)
        reward, info = out if isinstance(out, tuple) else (out, {})
        return reward, {**info, "cli_seconds": time.monotonic() - t0}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _prepare(scratch: Path, files: dict[str, str | bytes]) -> tuple[Path, Path]:
    work, home = scratch / "work", scratch / "home"
    for d in (work, home, scratch / "tmp"):
        d.mkdir()
    for rel, content in files.items():
        path = (work / rel).resolve()
        if work.resolve() not in path.parents:
            raise ValueError(f"run_cli files: {rel!r} is not a relative path inside the working directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return work, home


async def _run(argv: list[str], env: dict, cwd: Path, log: Path, timeout_s: float | None) -> int | None:
    """The exit code, or None past timeout_s. However it ends (exit, timeout, cancellation), every process it
    started is killed before this returns."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(argv)}\n".encode())
        out.flush()
        proc = await asyncio.create_subprocess_exec(*argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                                    stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return await asyncio.wait_for(proc.wait(), timeout_s)
    except asyncio.TimeoutError:
        return None
    finally:
        tree = _descendants(proc.pid)  # before the group goes: those that left it are still its children now
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the session's leader started the group: pgid = pid
        await asyncio.to_thread(kill_strays, tree, env[MARK])  # psutil reads every process: not on the loop
        await proc.wait()


def _descendants(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


def kill_strays(tree: list[psutil.Process], mark: str) -> None:
    """SIGKILL the processes that left the CLI's group: its descendants (while it lived) and, after, any process
    that carries its mark (orphans reparent to init), until none is left (a stray may fork while we look)."""
    strays = [p for p in tree if p.is_running()]  # is_running also checks the start time: no reused pid
    for _ in range(10):
        strays += [p for p in psutil.process_iter(["environ"]) if (p.info["environ"] or {}).get(MARK) == mark]
        if not strays:
            return
        for p in strays:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(strays, timeout=1)
        strays = []


def _last_line(log: Path, limit: int = 300) -> str:
    """The output's last line, or its "result" when it is a JSON object (Claude Code's --output-format json)."""
    with contextlib.suppress(OSError):
        lines = [line for line in log.read_bytes()[-65536:].decode(errors="replace").splitlines() if line.strip()]
        last = lines[-1] if lines else "(no output)"
        with contextlib.suppress(ValueError, TypeError, KeyError):
            last = str(json.loads(last)["result"])
        return last[:limit]
    return "(no output)"
