"""Env mode: chat-template deltas, the quickstart reward, and rollouts against a real vLLM engine."""
import asyncio
import os
import signal

import pytest
from transformers import AutoTokenizer

from experiments.quickstart import task
from experiments.quickstart.task import make_env, reward, target
from molt.agents import RESTARTS, run_group
from molt.agents.env import run_env_rollout
import molt.agents.render as rendering
from molt.agents.render import TemplateError, _first_prompt, render_delta, render_prompt
from molt.config import AgentConfig, EngineConfig
from molt.net import free_port
from molt.reaper import shared_memory
from molt.rollout.engine import EngineClient, group_pids, launch_engines
from molt.rollout.router import Router
from molt.types import EngineDied

CONVERSATION = [
    {"role": "system", "content": "You count."},
    {"role": "user", "content": "Count up from 4:"},
    {"role": "assistant", "content": "4567"},
    {"role": "user", "content": "Now from 8, please."},
    {"role": "assistant", "content": "8901 is the answer"},
    {"role": "tool", "content": "ok"},
    {"role": "user", "content": "And from 9?"},
]


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("text, answer, expected", [
    ("4567", "4567", 1.0),
    ("  4567\n", "4567", 1.0),             # stripped first
    ("4568", "4567", (1 + 1 + 1 + 2 / 3) / 4),  # last step does not count up
    ("45678", "4567", (1 + 4 / 5 + 1 + 1) / 4),  # one char too many: length 4/5; counting looks at s[:4]
    ("8901", "8901", 1.0),                  # 9 -> 0 wraps
    ("8910", "8901", (1 + 1 + 1 + 1 / 3) / 4),
    ("5678", "4567", (1 + 1 + 0 + 1) / 4),  # counts up, from the wrong digit
    ("4a", "4567", (0.5 + 0.5 + 1 + 0) / 4),
    ("abcd", "4567", 0.25),                 # right length, nothing else
    ("", "4567", 0.0),
    ("1234567890", "1234", (1 + 0.4 + 1 + 1) / 4),
    ("4 5 6 7", "4567", (4 / 7 + 4 / 7 + 1 + 0) / 4),
])
def test_count_reward_hand_worked(text, answer, expected):
    assert reward(text, answer) == pytest.approx(expected)


def test_count_env_and_targets():
    assert [target(d) for d in (0, 4, 7, 9)] == ["0123", "4567", "7890", "9012"]
    env = make_env({"messages": [{"role": "user", "content": "Count up from 4:"}], "answer": "4567"})
    assert not hasattr(env, "reset")  # the runner's default first observation is exercised
    assert env.step("4560") == ([], pytest.approx((1 + 1 + 1 + 2 / 3) / 4), True)  # 6 -> 0 does not count up


def test_deltas_reproduce_the_full_template(tok):
    """prompt + assistant ids (as the template tokenizes them, ending with <|im_end|>) + deltas
    == the full rendering of the conversation: no earlier turn needs re-rendering."""
    ids = render_prompt(tok, CONVERSATION[:2])
    i = 2
    while i < len(CONVERSATION):
        assert CONVERSATION[i]["role"] == "assistant"
        ids += tok.encode(CONVERSATION[i]["content"], add_special_tokens=False) + [tok.eos_token_id]
        j = next((k for k in range(i + 1, len(CONVERSATION)) if CONVERSATION[k]["role"] == "assistant"),
                 len(CONVERSATION))
        delta = render_delta(tok, CONVERSATION[i + 1:j], last_token_id=ids[-1])
        assert tok.decode(delta).startswith("\n<|im_start|>")  # the glue after <|im_end|>, not a second one
        ids += delta
        i = j
    full = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert ids == tok.encode(full, add_special_tokens=False)


def test_first_prompts_rendered_once_per_group_are_the_templates_and_each_rollouts_own(tok, monkeypatch):
    """The rollouts of a group share one rendering of their first messages; each gets its own list of those ids."""
    rendered = []
    monkeypatch.setattr(rendering, "render_prompt", lambda *a: rendered.append(a) or render_prompt(*a))
    four, five = ([{"role": "user", "content": f"Count up from {k}, once:"}] for k in (4, 5))
    first = _first_prompt(tok, four)
    assert first == render_prompt(tok, four)
    first.append(-1)  # a rollout extends its own segment
    assert _first_prompt(tok, four) == render_prompt(tok, four)
    assert _first_prompt(tok, five) == render_prompt(tok, five) != render_prompt(tok, four)
    assert len(rendered) == 2, "one rendering per distinct first messages"


def test_delta_after_a_turn_without_eos_closes_the_turn(tok):
    obs = [{"role": "user", "content": "go on"}]
    delta = render_delta(tok, obs, last_token_id=tok.encode("7", add_special_tokens=False)[0])
    assert tok.decode(delta) == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    assert render_delta(tok, obs, tok.eos_token_id) == delta[1:]


def unstable_template(path):
    """A tokenizer whose template ends the assistant turn differently when it is the last message."""
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}"
                         "{% if loop.last and m['role'] == 'assistant' %}{{ '<|endoftext|>' }}{% else %}{{ '\n' }}"
                         "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    return tok


def test_delta_rejects_a_template_that_rewrites_the_assistant_turn(tok):
    with pytest.raises(TemplateError, match="prefix-stable"):
        render_delta(unstable_template(tok.name_or_path), [{"role": "user", "content": "x"}], None)


# ---- rollouts against a real vLLM engine (tiny random model; one server for the module) ----

STOP_EVERY = 4  # a random model rarely emits <|im_end|>: stopping on 3/4 of the vocab makes turns short


class TurnsEnv:
    """A small multi-turn env: `turns` assistant turns, a user follow-up after each, reward 0.25 a step."""

    def __init__(self, sample, turns=3, fail_at=None):
        self.sample, self.turns, self.fail_at, self.actions = sample, turns, fail_at, []

    async def reset(self):  # async on purpose: both kinds are accepted
        return self.sample["messages"]

    async def step(self, action):  # async too (the quickstart env is sync)
        self.actions.append(action)
        if len(self.actions) == self.fail_at:
            raise RuntimeError("env exploded")
        done = len(self.actions) == self.turns
        return ([] if done else [{"role": "user", "content": f"Continue {len(self.actions)}:"}]), 0.25, done


@pytest.fixture(scope="module")
def router(tiny_engine):
    return Router([tiny_engine.client(60.0)])


def recording(router):
    """Wrap Router.generate and keep every call's (rollout_id, prompt ids, max_tokens, completion)."""
    calls = []

    async def generate(rollout_id, token_ids, max_tokens, **kw):
        c = await router.generate(rollout_id, token_ids, max_tokens, **kw)
        calls.append((rollout_id, list(token_ids), max_tokens, c))
        return c

    return generate, calls


def run(coro):
    return asyncio.run(coro)


SAMPLE = {"messages": [{"role": "user", "content": "Count up from 4:"}], "answer": "4567"}


def stop_ids(tok):
    return [i for i in range(len(tok)) if i % STOP_EVERY]  # includes <|im_end|> (id 2)


def segment_parts(seg):
    assert len(seg.token_ids) == len(seg.loss_mask) == len(seg.logprobs) == len(seg.versions)
    gen = [k for k, m in enumerate(seg.loss_mask) if m]
    obs = [k for k, m in enumerate(seg.loss_mask) if not m]
    return gen, obs


def test_multiturn_rollout_is_token_exact(router, tok):
    envs = []

    def mk(sample):
        envs.append(TurnsEnv(sample, turns=3))
        return envs[-1]

    generate, calls = recording(router)
    cfg = AgentConfig(max_turns=5, max_tokens_per_turn=8, max_total_tokens=400)
    ro = run(run_group("env", generate, tok, mk, SAMPLE, "g0", 1, cfg,
                       {"temperature": 1.0, "stop_token_ids": stop_ids(tok)})).rollouts[0]
    assert (ro.status, ro.info["turns"], ro.reward) == ("ok", 3.0, 0.75)
    seg, comps = ro.segments[0], [c for *_, c in calls]
    assert len(comps) == 3 and all(c.finish_reason == "stop" for c in comps)
    # the sequence is: rendered prompt, then per turn the engine's ids and the template delta
    expected = render_prompt(tok, SAMPLE["messages"])
    mask = [0] * len(expected)
    for k, c in enumerate(comps):
        assert calls[k][1] == expected  # the engine saw exactly the history so far
        expected, mask = expected + c.token_ids, mask + [1] * len(c.token_ids)
        if k < 2:
            delta = render_delta(tok, [{"role": "user", "content": f"Continue {k + 1}:"}], c.token_ids[-1])
            expected, mask = expected + delta, mask + [0] * len(delta)
    assert seg.token_ids == expected and seg.loss_mask == mask
    gen, obs = segment_parts(seg)
    assert [seg.token_ids[k] for k in gen] == [t for c in comps for t in c.token_ids]
    assert [seg.logprobs[k] for k in gen] == [lp for c in comps for lp in c.logprobs]
    assert [seg.versions[k] for k in gen] == [c.version for c in comps for _ in c.token_ids]
    assert all(seg.versions[k] >= 0 for k in gen)
    assert all(seg.logprobs[k] == 0.0 and seg.versions[k] == -1 for k in obs)
    assert all(lp <= 0.0 for lp in seg.logprobs) and any(lp < 0.0 for lp in seg.logprobs)
    assert envs[0].actions == [tok.decode(c.token_ids, skip_special_tokens=True) for c in comps]
    assert ro.info["gen_tokens"] == len(gen) and ro.info["tokens"] == len(seg.token_ids)


def test_max_turns_truncates(router, tok):
    generate, calls = recording(router)
    cfg = AgentConfig(max_turns=2, max_tokens_per_turn=8, max_total_tokens=400)
    ro = run(run_env_rollout(generate, tok, lambda s: TurnsEnv(s, turns=3), SAMPLE, "r1", "g1", cfg,
                             {"stop_token_ids": stop_ids(tok)}))
    assert (ro.status, ro.info["turns"], len(calls), ro.reward) == ("truncated", 2.0, 2, 0.5)
    assert ro.segments[0].loss_mask[-1] == 1  # ends with the last generated turn


@pytest.mark.parametrize("extra", [0, 5, 40])
def test_total_token_budget(router, tok, extra):
    generate, calls = recording(router)
    limit = len(render_prompt(tok, SAMPLE["messages"])) + extra
    cfg = AgentConfig(max_turns=20, max_tokens_per_turn=8, max_total_tokens=limit)
    ro = run(run_env_rollout(generate, tok, lambda s: TurnsEnv(s, turns=20), SAMPLE, f"r2-{extra}", "g2", cfg,
                             {"stop_token_ids": stop_ids(tok)}))
    assert ro.status == "truncated" and len(ro.segments[0].token_ids) <= limit
    assert [m for *_, m, _ in calls] == [min(8, limit - len(p)) for _, p, _, _ in calls]
    assert [m for *_, m, _ in calls[:1]] == ([min(8, extra)] if extra else [])  # a prompt that fills it: no call


def test_turn_cut_by_length_truncates(router, tok):
    generate, calls = recording(router)
    envs = []
    cfg = AgentConfig(max_turns=3, max_tokens_per_turn=3, max_total_tokens=400)
    mk = lambda s: envs.append(TurnsEnv(s)) or envs[-1]  # noqa: E731
    ro = run(run_env_rollout(generate, tok, mk, SAMPLE, "r3", "g3", cfg, {"temperature": 0.0}))
    assert calls[0][3].finish_reason == "length"  # greedy on the fixed random model: no <|im_end|> in 3 tokens
    assert (ro.status, ro.info["turns"], ro.reward, len(envs[0].actions)) == ("truncated", 1.0, 0.25, 1)


def test_env_failures_fail_the_rollout_not_the_group(router, tok):
    made = []

    def mk(sample):
        made.append(len(made))
        if made[-1] == 2:
            raise KeyError("no such task field")
        env = TurnsEnv(sample, turns=2, fail_at=2 if made[-1] == 1 else None)
        if made[-1] == 3:
            env.step = lambda action: "not a (messages, reward, done) tuple"
        return env

    cfg = AgentConfig(max_turns=3, max_tokens_per_turn=8, max_total_tokens=400)
    group = run(run_group("env", router.generate, tok, mk, SAMPLE, "g4", 4, cfg, {"stop_token_ids": stop_ids(tok)},
                          release=router.release))
    assert not any(k.startswith("g4/") for k in router.assigned)  # stickiness released, failed ones too
    assert [r.rollout_id for r in group.rollouts] == [f"g4/{i}" for i in range(4)]
    statuses = sorted((r.status, r.reward, r.info.get("failed", 0.0)) for r in group.rollouts)
    assert statuses == [("failed", 0.0, 1.0)] * 3 + [("ok", 0.5, 0.0)]
    for r in group.rollouts:
        r.segments[0].check()


def test_a_groups_first_turn_is_one_engine_request(tiny_engine, tok):
    """The n rollouts of a group render their prompt in the same event-loop tick, so the router coalesces their first
    turns into one engine request with n samples (rendered on threads, they straggled in: 1.9 requests per group)."""
    client, sent = tiny_engine.client(60.0), []
    real = client.generate_n

    async def counted(ids, max_tokens, n, **kw):
        sent.append(n)
        return await real(ids, max_tokens, n, **kw)

    client.generate_n = counted
    router = Router([client], seed=0)

    async def groups():
        return await asyncio.gather(*(run_group("env", router, tok, make_env, SAMPLE, f"g{i}", 8,
                                                AgentConfig(max_tokens_per_turn=4), {"temperature": 1.0},
                                                release=router.release) for i in range(4)))

    done = run(groups())
    assert sorted(sent) == [8] * 4
    assert all(len(g.rollouts) == 8 and all(r.status != "failed" for r in g.rollouts) for g in done)


def test_template_errors_are_fatal_not_failed_rollouts(router, model_dir):
    # a wrong template would otherwise quietly fail every multi-turn rollout of the run
    tok = unstable_template(model_dir)
    with pytest.raises(TemplateError):
        run(run_env_rollout(router.generate, tok, TurnsEnv, SAMPLE, "r7", "g7", AgentConfig(max_turns=2),
                            {"stop_token_ids": stop_ids(tok)}))


def test_engine_errors_propagate(tok):
    dead = Router([EngineClient("gone", f"http://127.0.0.1:{free_port()}", 5.0)])
    with pytest.raises(EngineDied):
        run(run_group("env", dead.generate, tok, lambda s: TurnsEnv(s), SAMPLE, "g5", 2, AgentConfig(), {}))


def test_rollouts_whose_engine_dies_start_again_from_scratch(model_dir, tok, tmp_path):
    """retry=True (engine.max_restarts > 0): the engine is killed with every rollout's request in it, the router reports
    it once and holds new requests, the engine is replaced, and every rollout starts again: no partial trajectory
    survives. Seeded, the retried group draws exactly what a fresh run of the group draws from the same weights. The
    shared memory the killed processes left in /dev/shm goes with them (issue 23 item 4)."""
    cfg = AgentConfig(max_turns=3, max_tokens_per_turn=200, max_total_tokens=700)
    reports = []
    # bound (auto): vLLM's worker in a process of its own, fed through message queues in /dev/shm (nobind has none)
    with launch_engines(EngineConfig(cpu_threads_bind="auto"), model_dir, tmp_path) as servers:
        server = servers[0]
        router = Router([server.client(60.0)], seed=5, on_down=lambda name, epoch: reports.append((name, epoch)))
        segments = set()  # /dev/shm/psm_* of the engine's processes (vLLM's message queues)

        def group(gid):
            return run_group("env", router, tok, TurnsEnv, SAMPLE, gid, 4, cfg, {"temperature": 1.0},
                             release=router.release, retry=True)

        async def main():
            # frozen first (requests held, none answered): under load a request could otherwise end before the kill
            await router.clients[server.name].pause("keep")
            task = asyncio.create_task(group("g9"))
            while sum(router.inflight.values()) < 4:  # all four: each renders its prompt in a thread first, and one
                await asyncio.sleep(0.005)  # that asks after the engine is reported down is held, not started again
            segments.update(shared_memory(group_pids(server.proc.pid)))
            os.killpg(server.proc.pid, signal.SIGKILL)  # the API server and its EngineCore
            while group_pids(server.proc.pid):
                await asyncio.sleep(0.05)
            assert all(os.path.exists(s) for s in segments), "left behind by the killed processes"
            while not reports:
                await asyncio.sleep(0.05)
            server.restart()  # blocking: the rollouts wait in the router meanwhile
            assert not any(os.path.exists(s) for s in segments), "the stop before the restart removed them"
            await router.up(server.name)
            retried = await task
            return retried, await group("g9")

        retried, fresh = run(main())
    assert reports == [("engine0", 0)] and segments
    assert [r.info["retried"] for r in retried.rollouts] == [1.0] * 4 and [r.info["retried"] for r in fresh.rollouts] == [0.0] * 4
    assert "failed" not in [r.status for r in retried.rollouts]
    assert [(r.status, r.segments[0].token_ids) for r in retried.rollouts] == \
        [(r.status, r.segments[0].token_ids) for r in fresh.rollouts]


def test_a_rollout_whose_engine_always_fails_is_retried_a_bounded_number_of_times(tok):
    """Issue 23 item 9: an engine that answers every request of a rollout with a 5xx (a render route that always
    fails on its images) fails the rollout after RESTARTS restarts, with the reason, instead of looping forever."""
    calls = []

    async def broken(rollout_id, token_ids, max_tokens, **sampling):  # stands in for the router of a broken engine
        calls.append(rollout_id)
        await asyncio.sleep(0)  # a real request yields to the event loop
        raise EngineDied("engine0", "POST /v1/chat/completions/render: HTTP 500 boom")

    group = run(asyncio.wait_for(run_group("env", broken, tok, TurnsEnv, SAMPLE, "g8", 2, AgentConfig(), {},
                                           retry=True), timeout=10))
    assert len(calls) == 2 * (RESTARTS + 1)
    for r in group.rollouts:
        assert (r.status, r.reward, r.info["failed"], r.info["retried"]) == ("failed", 0.0, 1.0, RESTARTS)
        assert f"its engine failed it {RESTARTS + 1} times" in r.error and "HTTP 500 boom" in r.error


def test_quickstart_rollouts_score_the_decoded_engine_ids(router, tok):
    row = {"messages": [{"role": "user", "content": "Count up from 7:"}], "answer": "7890"}
    group = run(run_group("env", router.generate, tok, task.make_env, row, "g6", 4, AgentConfig(), {"temperature": 1.0}))
    assert group.sample is row and len(group.rollouts) == 4
    for r in group.rollouts:
        seg = r.segments[0]
        assert r.status == "ok" and r.info["turns"] == 1.0
        gen = [t for t, m in zip(seg.token_ids, seg.loss_mask) if m]
        assert 1 <= len(gen) <= AgentConfig().max_tokens_per_turn
        assert r.reward == task.reward(tok.decode(gen, skip_special_tokens=True), "7890")


def test_the_worker_hands_over_every_group_it_finished_and_each_engine_it_saw_fail(tiny_engine, model_dir, tmp_path):
    """The rollout worker as the loop drives it (molt/agents/pool.py): a group per credit, every finished one taken
    (RolloutWorker.take, one Ray call for all it holds), none twice; a take without any returns empty at its timeout,
    and an engine the router saw fail wakes a waiting take at once."""
    import time

    import ray
    from omegaconf import OmegaConf

    from molt.agents.pool import RolloutWorker
    from molt.loop import ray_session
    from molt.reaper import private_tmp
    from tests.test_config import compose

    cfg = OmegaConf.create(OmegaConf.to_container(compose("experiment=quickstart", "rollout.seed=0", f"output_dir={tmp_path}"),
                                                 resolve=True))
    with private_tmp() as tmp, ray_session(tmp):
        worker = RolloutWorker.remote(cfg, [tiny_engine.client(60.0)], str(model_dir), 3, retry=True)
        ray.get(worker.start.remote(0))
        taken = []
        while len(taken) < 3:
            items, down = ray.get(worker.take.remote(60.0))
            assert items and down == [], "a take returns once it has something"
            taken += items
        assert [kind for kind, _ in taken] == ["group"] * 3, taken
        assert len({g.index for _, g in taken}) == 3 and all(len(g.rollouts) == cfg.rollout.n for _, g in taken)
        t0 = time.monotonic()
        assert ray.get(worker.take.remote(0.5)) == ([], []), "no credit left: nothing more, and nothing again"
        assert time.monotonic() - t0 >= 0.5
        waiting = worker.take.remote(60.0)
        t0 = time.monotonic()
        ray.get(worker._engine_down.remote("engine0", 0))  # what the router calls on a failed request
        assert ray.get(waiting) == ([], [("engine0", 0)]) and time.monotonic() - t0 < 10
        ray.get(worker.grant.remote(1))
        items, _ = ray.get(worker.take.remote(60.0))
        assert [kind for kind, _ in items] == ["group"] and items[0][1].index not in {g.index for _, g in taken}
        ray.get(worker.stop.remote())
        ray.kill(worker)
