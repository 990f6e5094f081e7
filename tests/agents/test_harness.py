"""Agent CLIs as the agent of a rollout (molt/agents/harness.py), with real processes.

Stand-in harnesses are short Python programs (they call the model with urllib through the rollout's real session on
the loopback chat server, whose engine is a scripted fake: tests/agents/test_chat_hostile.py); the real Claude Code
and Codex CLI binaries (harnesses/node_modules, `make setup`) are pointed at a loopback listener that records their
first request and answers 400 or never answers.
"""
import contextlib
import http.server
import json
import os
import sys
import threading
from pathlib import Path

import psutil
import pytest

from molt import guards
from molt.agents import harness, run_group
from molt.agents.chat_agent import ChatContext
from molt.agents.harness import BIN, MARK, PASSED, HarnessFailed, run_cli
from molt.assets import build_tokenizer
from molt.config import REPO, AgentConfig
from molt.rollout.engine import group_pids
from tests.agents.test_chat import loop, run  # noqa: F401 (the event-loop fixture)
from tests.agents.test_chat_hostile import Scripted
from tests.test_config import compose

ASK = r"""
import json, os, subprocess, sys, time, urllib.request
def ask(text):
    body = {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", json.dumps(body).encode(),
                                 {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    return json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["message"]["content"]
def daemon():  # a grandchild in its own session whose parent exits at once: outside the group and the tree
    cmd = "import subprocess as s; print(s.Popen(['sleep', '601'], start_new_session=True, stdout=s.DEVNULL).pid)"
    return int(subprocess.run([sys.executable, "-c", cmd], stdout=subprocess.PIPE, text=True).stdout)
"""


def program(source: str):
    """A stand-in harness: `python -c ASK+source`, with the rollout's OpenAI URL and key in its environment."""
    def make(ctx, task, home):
        return [sys.executable, "-c", ASK + source], {"OPENAI_BASE_URL": ctx.base_url, "OPENAI_API_KEY": ctx.api_key}
    return make


def agent(source: str, check=lambda work: 1.0, files=None):
    async def run_agent(ctx):
        return await run_cli(ctx, "the task", check, files=files(ctx) if callable(files) else files,
                             harness=program(source))
    return run_agent


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def rollouts(loop, tok, run_agent, cfg, n=1):
    return run(loop, run_group("chat", Scripted([tok.encode("ok")]), tok, run_agent, {"messages": []}, "g", n, cfg,
                               {"temperature": 1.0}), timeout=120).rollouts


def gone(pid: int) -> bool:
    """Dead (a zombie counts: this container's init may never reap the orphans it inherits)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    return True


def test_the_rollout_deadline_kills_every_process_of_the_harness(loop, tok, tmp_path):
    """agent.timeout_s cancels the agent: the CLI, a child in its group and a daemon that left it (setsid, orphaned)
    are all killed; the rollout fails with the reason; the output is kept, the scratch removed."""
    src = """
kid = subprocess.Popen(["sleep", "600"])
print(kid.pid, daemon(), os.getpid(), os.environ["MOLT_SCRATCH"], flush=True)
time.sleep(600)
"""
    cfg = AgentConfig(mode="chat", max_turns=2, max_tokens_per_turn=4, timeout_s=5, log_dir=str(tmp_path))
    (ro,) = rollouts(loop, tok, agent(src), cfg)
    assert ro.status == "failed" and "agent ran past agent.timeout_s=5" in ro.error
    *pids, scratch = (tmp_path / "g_0.log").read_text().splitlines()[-1].split()
    assert len(pids) == 3 and all(gone(int(p)) for p in pids), [psutil.Process(int(p)).cmdline() for p in pids
                                                                 if not gone(int(p))]
    assert group_pids(int(pids[2])) == [] and not Path(scratch).exists()


@pytest.mark.parametrize("source, files, why", [
    ("print('working', flush=True); sys.exit('boom: it crashed')", None, "exited with 1: boom: it crashed"),
    ("print('done without asking')", None, "the agent never called the model"),
    ("ask('hi')", {"../outside.txt": "x"}, "'../outside.txt' is not a relative path inside the working directory"),
], ids=["crash", "never-called-the-model", "file-outside"])
def test_a_harness_that_fails_fails_its_rollout_with_the_reason(loop, tok, tmp_path, source, files, why):
    cfg = AgentConfig(mode="chat", max_turns=2, max_tokens_per_turn=4, timeout_s=60, log_dir=str(tmp_path))
    (ro,) = rollouts(loop, tok, agent(source, files=files), cfg)
    assert (ro.status, ro.reward) == ("failed", 0.0) and why in ro.error, ro.error
    assert "\n" not in ro.error


def test_sixteen_rollouts_are_isolated_and_scored_by_their_check(loop, tok, tmp_path, monkeypatch):
    """16 at once: each has its own working directory (holding only its task's files), HOME, TMPDIR and key, none
    of the worker's environment beyond PASSED; each calls the model, writes its answer and leaves two processes
    behind (one in its group, one daemon), which are killed; the reward is the check of each directory."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", "the-run-secret")  # what a worker holds and a CLI must not see
    src = """
seen = {"cwd": os.getcwd(), "files": sorted(os.listdir(".")), "env": sorted(os.environ), "home": os.environ["HOME"],
        "tmp": os.environ["TMPDIR"], "key": os.environ["OPENAI_API_KEY"]}
open(os.path.join(os.environ["HOME"], ".harnessrc"), "w").write("mine")
task = open("task.txt").read()
ask(task)
open("answer.txt", "w").write(task)
seen["left"] = [subprocess.Popen(["sleep", "600"]).pid, daemon()]
print(json.dumps(seen), flush=True)
"""
    def check(work):  # the rollout's index, from the answer its harness wrote: i / 16
        return int((work / "answer.txt").read_text().split("/")[1]) / 16, {"files": float(len(os.listdir(work)))}

    cfg = AgentConfig(mode="chat", max_turns=2, max_tokens_per_turn=4, timeout_s=120, log_dir=str(tmp_path))
    ros = rollouts(loop, tok, agent(src, check, files=lambda ctx: {"task.txt": ctx.rollout_id}), cfg, n=16)
    assert [(r.status, r.reward, r.info["files"], r.info["turns"]) for r in ros] == [
        ("ok", i / 16, 2.0, 1.0) for i in range(16)], [r.error for r in ros]
    seen = [json.loads((tmp_path / f"g_{i}.log").read_text().splitlines()[-1]) for i in range(16)]
    for key in ("cwd", "home", "tmp", "key"):
        assert len({s[key] for s in seen}) == 16, key
    allowed = set(PASSED) | {"OPENAI_BASE_URL", "OPENAI_API_KEY", "HOME", "TMPDIR", MARK, "LC_CTYPE"}  # Python sets
    # LC_CTYPE itself where LANG is not set (PEP 538)
    assert all(s["files"] == ["task.txt"] and set(s["env"]) <= allowed for s in seen)
    assert all(gone(pid) for s in seen for pid in s["left"])
    assert not any(Path(s["cwd"]).parent.exists() for s in seen)


@contextlib.contextmanager
def listener(answer: bool, key: str):
    """A loopback HTTP server recording each request (path, lowercased headers, the processes carrying `key` in
    their environment at that moment and their process groups); it answers 400 in Anthropic's error shape, or holds
    the request open."""
    seen, release = [], threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            # (process, its environment now): psutil shares Process objects between process_iter calls, so a later
            # call elsewhere (harness.py looking for strays) overwrites `info` (None once the process is gone)
            procs = [(p, p.info["environ"]) for p in psutil.process_iter(["environ"])
                     if key in (p.info["environ"] or {}).values()]
            groups = {os.getpgid(p.pid) for p, _ in procs}
            seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, procs, groups))
            if not answer:
                release.wait(60)
                return
            body = b'{"type": "error", "error": {"type": "invalid_request_error", "message": "molt test listener"}}'
            self.send_response(400)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}", seen
    finally:
        release.set()
        srv.shutdown()
        srv.server_close()


# (harness, the path its first request must reach, the header that must carry the rollout's key)
CLIS = [("claude", "/s/sid/v1/messages?beta=true", ("x-api-key", "{key}")),
        ("codex", "/s/sid/v1/responses", ("authorization", "Bearer {key}"))]


@pytest.mark.parametrize("name, path, auth", CLIS, ids=[c[0] for c in CLIS])
def test_the_real_cli_reaches_the_rollout_url_and_dies_at_its_deadline(loop, tmp_path, name, path, auth):
    if not (BIN / name).is_file():
        pytest.skip(f"{BIN / name} is not installed: `make setup` installs the agent CLIs (needs npm)")
    key = f"molt-test-{os.getpid()}-{name}"

    def ctx(url):
        return ChatContext(f"{url}/s/sid/v1", f"{url}/s/sid", key, "policy", {"messages": []}, 64, 2, "r/0",
                           harness=name, log_dir=str(tmp_path))

    with listener(True, key) as (url, seen):  # an error: the CLI exits non-zero, the rollout fails with its words
        with pytest.raises(HarnessFailed, match=f"{name} exited with 1: .*molt test listener"):
            run(loop, run_cli(ctx(url), "Create hello.txt", check=lambda work: 1.0), timeout=120)
    assert seen and seen[0][0] == path and seen[0][1][auth[0]] == auth[1].format(key=key), seen[0][:2]
    assert "molt test listener" in (tmp_path / "r_0.log").read_text()  # its output, kept
    with listener(False, key) as (url, seen):  # no answer: killed at the deadline, with all it started
        with pytest.raises(HarnessFailed, match=f"{name} ran past timeout_s=4 and was killed"):
            run(loop, run_cli(ctx(url), "Create hello.txt", check=lambda work: 1.0, timeout_s=4), timeout=120)
        path_seen, _, procs, groups = seen[0]
        assert procs and path_seen == path
        env = procs[0][1]
        assert Path(env["HOME"]) == Path(env[MARK]) / "home" and Path(env["TMPDIR"]) == Path(env[MARK]) / "tmp"
    assert all(gone(p.pid) for p, _ in procs) and not Path(env[MARK]).exists()
    assert all(group_pids(g) == [] for g in groups)


def test_a_missing_cli_is_a_guard_rail_naming_make_setup(monkeypatch, tmp_path):
    cfg = compose("experiment=claude_code")
    if (BIN / "claude").is_file():
        assert guards.check(cfg) is None
    monkeypatch.setattr(harness, "BIN", tmp_path / "node_modules" / ".bin")
    msg = guards.agent_harness(cfg, {})
    assert "agent.harness=claude" in msg and "run `make setup`" in msg and "is not installed" in msg


def test_the_examples_score_the_directory(tmp_path):
    from experiments.claude_code.agent import score as hello
    from experiments.codex.agent import score as fixed

    row = json.loads((REPO / "experiments/codex/data/train.jsonl").read_text().splitlines()[0])
    path = tmp_path / row["file"]
    assert (hello(tmp_path, "hello.txt", "molt"), fixed(tmp_path, row)) == (0.0, 0.0)  # nothing written
    for text, reward in [("molt\n", 1.0), ("I wrote molt.", 0.5), ("nope", 0.2)]:
        (tmp_path / "hello.txt").write_text(text)
        assert hello(tmp_path, "hello.txt", "molt") == reward
    for text, reward in [(row["text"], 0.0), (row["text"].replace(row["wrong"], row["right"]), 1.0),
                         (row["text"].replace(row["wrong"], row["right"]) + "extra\n", 0.5)]:
        path.write_text(text)
        assert fixed(tmp_path, row) == reward
